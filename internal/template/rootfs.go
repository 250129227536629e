// Package template makes template root filesystems: a Debian suite installed with debootstrap
// (cached as a tarball keyed by suite, mirror and package list) or an OCI/Docker image (from a
// registry or an archive), made into an E2B-style template (user `user`, uid 1000 where free,
// passwordless sudo where sudo exists, envd as the init process). Image layers, and the
// debootstrap tarball, are unpacked once per node by internal/image and stacked (overlayfs)
// under the template's own top layer, which holds this package's files: nothing is ever
// written into a shared layer. Booting a template and checkpointing it is the sandbox Manager's job; this package
// only writes directories. A finished rootfs is never modified again: sandboxes share it
// read-only.
package template

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// DefaultPackages are installed on top of debootstrap's minbase variant.
var DefaultPackages = []string{
	"bash", "coreutils", "procps", "python3", "python-is-python3", "ca-certificates", "git", "curl", "sudo",
}

// Builder builds template root filesystems.
type Builder struct {
	// CacheDir holds debootstrap tarballs (reused across builds).
	CacheDir string
	// EnvdPath is the envd binary copied into every rootfs.
	EnvdPath string
	// Mirror is the Debian mirror; Suite the Debian suite (bookworm).
	Mirror string
	Suite  string
	// Packages extra to minbase; DefaultPackages when nil.
	Packages []string
}

// EnvdInRootFS is where envd lives inside a template.
const EnvdInRootFS = "/usr/local/bin/envd"

// Progress receives one line of progress output.
type Progress func(line string)

func (b *Builder) packages() []string {
	if b.Packages != nil {
		return b.Packages
	}
	return DefaultPackages
}

func (b *Builder) cacheKey() string {
	h := sha256.Sum256([]byte(b.Suite + "\n" + b.Mirror + "\n" + strings.Join(b.packages(), ",")))
	return hex.EncodeToString(h[:6])
}

// BuildRootFS writes a complete template rootfs to dest (which must not exist). It is written
// next to dest and renamed into place, so dest is complete or absent.
func (b *Builder) BuildRootFS(ctx context.Context, dest string, progress Progress) error {
	if progress == nil {
		progress = func(string) {}
	}
	if _, err := os.Stat(dest); err == nil {
		return fmt.Errorf("rootfs %s already exists", dest)
	}
	if _, err := os.Stat(b.EnvdPath); err != nil {
		return fmt.Errorf("envd binary: %w", err)
	}
	tarball, err := b.debootstrapTarball(ctx, progress)
	if err != nil {
		return err
	}
	tmp := dest + ".tmp"
	os.RemoveAll(tmp)
	if err := os.MkdirAll(tmp, 0o755); err != nil {
		return err
	}
	progress("unpacking " + filepath.Base(tarball))
	if err := run(ctx, nil, "tar", "--numeric-owner", "-xpf", tarball, "-C", tmp); err != nil {
		os.RemoveAll(tmp)
		return fmt.Errorf("unpack rootfs: %w", err)
	}
	progress("adding user `user`, sudo and envd")
	if err := customize(tmp, b.EnvdPath); err != nil {
		os.RemoveAll(tmp)
		return fmt.Errorf("customize rootfs: %w", err)
	}
	if err := os.Rename(tmp, dest); err != nil {
		os.RemoveAll(tmp)
		return err
	}
	progress("rootfs ready")
	return nil
}

// debootstrapTarball returns the cached debootstrap output for the builder's suite and
// packages, making it first if needed.
func (b *Builder) debootstrapTarball(ctx context.Context, progress Progress) (string, error) {
	if err := os.MkdirAll(b.CacheDir, 0o755); err != nil {
		return "", err
	}
	tarball := filepath.Join(b.CacheDir, fmt.Sprintf("debootstrap-%s-%s.tar", b.Suite, b.cacheKey()))
	if _, err := os.Stat(tarball); err == nil {
		progress("using cached debootstrap " + filepath.Base(tarball))
		return tarball, nil
	}
	if _, err := exec.LookPath("debootstrap"); err != nil {
		return "", fmt.Errorf("debootstrap is not installed (run `make setup`): %w", err)
	}
	dir, err := os.MkdirTemp(b.CacheDir, "debootstrap-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(dir)
	progress(fmt.Sprintf("debootstrap %s (minbase + %s) from %s", b.Suite, strings.Join(b.packages(), ","), b.Mirror))
	args := []string{"--variant=minbase", "--include=" + strings.Join(b.packages(), ","), b.Suite, dir, b.Mirror}
	if err := run(ctx, progress, "debootstrap", args...); err != nil {
		return "", fmt.Errorf("debootstrap: %w", err)
	}
	// Lean: drop downloaded packages and lists, docs and man pages.
	for _, p := range []string{"var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man", "usr/share/info"} {
		entries, _ := os.ReadDir(filepath.Join(dir, p))
		for _, e := range entries {
			if e.Name() == "lock" || e.Name() == "partial" {
				continue
			}
			os.RemoveAll(filepath.Join(dir, p, e.Name()))
		}
	}
	progress("packing debootstrap cache")
	tmp := tarball + ".tmp"
	if err := run(ctx, nil, "tar", "--numeric-owner", "-cpf", tmp, "-C", dir, "."); err != nil {
		os.Remove(tmp)
		return "", fmt.Errorf("pack rootfs cache: %w", err)
	}
	if err := syncFile(tmp); err != nil {
		return "", err
	}
	return tarball, os.Rename(tmp, tarball)
}

func customize(root, envdPath string) error {
	// The root directory's mode comes from the (0700) temporary dir debootstrap ran in.
	if err := os.Chmod(root, 0o755); err != nil {
		return err
	}
	appendLine := func(rel, line string) error {
		p := filepath.Join(root, rel)
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		for _, l := range strings.Split(string(data), "\n") {
			if strings.HasPrefix(l, strings.SplitN(line, ":", 2)[0]+":") {
				return nil
			}
		}
		f, err := os.OpenFile(p, os.O_APPEND|os.O_WRONLY, 0)
		if err != nil {
			return err
		}
		defer f.Close()
		_, err = f.WriteString(line + "\n")
		return err
	}
	steps := []struct{ file, line string }{
		{"etc/passwd", "user:x:1000:1000::/home/user:/bin/bash"},
		{"etc/group", "user:x:1000:"},
		{"etc/shadow", "user:*:19000:0:99999:7:::"},
		{"etc/gshadow", "user:!::"},
	}
	for _, s := range steps {
		if err := appendLine(s.file, s.line); err != nil {
			return err
		}
	}
	// Add user to the sudo group as E2B's base image does, and allow sudo without a password.
	if err := os.WriteFile(filepath.Join(root, "etc/sudoers.d/user"), []byte("user ALL=(ALL:ALL) NOPASSWD: ALL\n"), 0o440); err != nil {
		return err
	}
	home := filepath.Join(root, "home/user")
	if err := os.MkdirAll(home, 0o755); err != nil {
		return err
	}
	if err := copyTree(filepath.Join(root, "etc/skel"), home); err != nil {
		return err
	}
	if err := filepath.Walk(home, func(p string, _ os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		return os.Lchown(p, 1000, 1000)
	}); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(root, "etc/hostname"), []byte("sandbox\n"), 0o644); err != nil {
		return err
	}
	hosts := "127.0.0.1\tlocalhost\n127.0.1.1\tsandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n"
	if err := os.WriteFile(filepath.Join(root, "etc/hosts"), []byte(hosts), 0o644); err != nil {
		return err
	}
	resolv, err := os.ReadFile("/etc/resolv.conf")
	if err != nil {
		resolv = []byte("nameserver 1.1.1.1\n")
	}
	os.Remove(filepath.Join(root, "etc/resolv.conf"))
	if err := os.WriteFile(filepath.Join(root, "etc/resolv.conf"), resolv, 0o644); err != nil {
		return err
	}
	return copyFile(envdPath, filepath.Join(root, EnvdInRootFS), 0o755)
}

func copyTree(src, dst string) error {
	return filepath.Walk(src, func(p string, info os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		target := filepath.Join(dst, rel)
		switch {
		case info.IsDir():
			return os.MkdirAll(target, info.Mode().Perm())
		case info.Mode().IsRegular():
			return copyFile(p, target, info.Mode().Perm())
		}
		return nil
	})
}

func copyFile(src, dst string, mode os.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	if err := out.Close(); err != nil {
		return err
	}
	return os.Chmod(dst, mode)
}

func syncFile(p string) error {
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}

// run runs a command, sending each output line to progress (or discarding it when nil) and
// returning the last lines in the error on failure.
func run(ctx context.Context, progress Progress, name string, args ...string) error {
	cmd := exec.CommandContext(ctx, name, args...)
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	if err := cmd.Start(); err != nil {
		return err
	}
	var tail []string
	done := make(chan struct{})
	go func() {
		defer close(done)
		sc := bufio.NewScanner(pr)
		sc.Buffer(make([]byte, 64*1024), 1024*1024)
		for sc.Scan() {
			line := sc.Text()
			if progress != nil {
				progress(line)
			}
			tail = append(tail, line)
			if len(tail) > 10 {
				tail = tail[1:]
			}
		}
		io.Copy(io.Discard, pr)
	}()
	err := cmd.Wait()
	pw.Close()
	<-done
	if err != nil {
		return fmt.Errorf("%s: %w: %s", name, err, strings.Join(tail, " | "))
	}
	return nil
}
