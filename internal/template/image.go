package template

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/image"
)

// ImageSource names an image to build a template from: a registry reference or an archive.
type ImageSource struct {
	Ref      string // registry reference (python:3.12, localhost:5000/app:v1)
	Archive  string // docker save or OCI layout tarball on this node
	Insecure bool   // plain HTTP to Ref's registry
	Auth     *image.Auth
}

// ImageConfig holds the image side of a Builder. Layers must be on the same filesystem as the
// template rootfs directories (hard links).
type ImageConfig struct {
	Layers   *image.Store
	Resolver *image.Resolver
}

// Default image limits: an image of at most 16 GiB unpacked, a layer of at most 8 GiB and
// 1 Mi entries.
const (
	DefaultMaxLayerBytes   = 8 << 30
	DefaultMaxImageBytes   = 16 << 30
	DefaultMaxLayerEntries = 1 << 20
)

// BuildFromImage makes the template rootfs of src: the image's layers, unpacked once per node in
// the layer store and shared read-only, under the template's own top layer, written to dest
// (which must not exist): ember's files (envd, the `user` account, hostname, resolv.conf), never
// written into a shared layer. dest is complete or absent. It returns the image config's
// defaults and the rootfs's stack (Top = dest).
func (b *Builder) BuildFromImage(ctx context.Context, cfg ImageConfig, src ImageSource, dest string, progress Progress) (image.Defaults, image.Stack, error) {
	var none image.Defaults
	var nostack image.Stack
	if progress == nil {
		progress = func(string) {}
	}
	if _, err := os.Stat(dest); err == nil {
		return none, nostack, fmt.Errorf("rootfs %s already exists", dest)
	}
	envdSum, err := fileSHA256(b.EnvdPath)
	if err != nil {
		return none, nostack, fmt.Errorf("envd binary: %w", err)
	}
	st := cfg.Layers
	if err := os.MkdirAll(st.Root, 0o700); err != nil {
		return none, nostack, err
	}
	var img v1.Image
	label := src.Ref
	if src.Archive != "" {
		label = src.Archive
		scratch, err := os.MkdirTemp(st.Root, ".tmp-archive-")
		if err != nil {
			return none, nostack, err
		}
		defer os.RemoveAll(scratch)
		progress("reading archive " + src.Archive)
		if img, err = image.OpenArchive(src.Archive, scratch); err != nil {
			return none, nostack, err
		}
	} else {
		progress("resolving " + src.Ref)
		if img, err = cfg.Resolver.Pull(ctx, src.Ref, src.Insecure, src.Auth); err != nil {
			return none, nostack, err
		}
	}
	layers, cf, err := image.Layers(img, st.MaxImageBytes)
	if err != nil {
		return none, nostack, fmt.Errorf("image %s: %w", label, err)
	}
	if d, err := img.Digest(); err == nil {
		progress(fmt.Sprintf("image %s (%s): %d layers", label, d, len(layers)))
	}
	t0 := time.Now()
	budget := st.MaxImageBytes
	var bp *int64
	if budget > 0 {
		bp = &budget
	}
	dirs := make([]image.LayerDir, 0, len(layers))
	built := false
	defer func() { st.Release(dirs, !built) }() // a failed build takes back the layers it unpacked
	var written int64
	for i, l := range layers {
		ld, err := st.Layer(ctx, l, bp, func(s string) { progress(fmt.Sprintf("[%d/%d] %s", i+1, len(layers), s)) })
		if err != nil {
			return none, nostack, fmt.Errorf("image %s: %w", label, err)
		}
		if bp != nil && ld.Written == 0 {
			budget -= ld.Meta.Bytes // shared layers count against the image too
			if budget < 0 {
				return none, nostack, fmt.Errorf("image %s: content exceeds the limit of %d bytes: %w", label, st.MaxImageBytes, errdefs.ErrExhausted)
			}
		}
		written += ld.Written
		dirs = append(dirs, ld)
	}
	envdStore, err := b.storeEnvd(st.Root, envdSum)
	if err != nil {
		return none, nostack, err
	}
	tmp := dest + ".tmp"
	os.RemoveAll(tmp)
	if err := os.MkdirAll(tmp, 0o755); err != nil {
		return none, nostack, err
	}
	ok := false
	defer func() {
		if !ok {
			os.RemoveAll(tmp)
		}
	}()
	stack, cs, err := image.Compose(ctx, tmp, dirs)
	if err != nil {
		return none, nostack, fmt.Errorf("image %s: compose rootfs: %w", label, err)
	}
	defs := image.ConfigDefaults(cf)
	err = stack.Edit(ctx, func(t *image.Tree) error {
		if err := customizeTree(t, defs); err != nil {
			return fmt.Errorf("customize rootfs: %w", err)
		}
		if defs.User, err = userName(t, defs.User); err != nil {
			return fmt.Errorf("image %s: %w", label, err)
		}
		return nil
	})
	if err != nil {
		return none, nostack, err
	}
	if err := linkEnvd(tmp, envdStore); err != nil {
		return none, nostack, err
	}
	if err := os.Rename(tmp, dest); err != nil {
		return none, nostack, err
	}
	stack.Top = dest
	ok, built = true, true
	progress(fmt.Sprintf("rootfs: %d shared layers (%s unpacked for this build), own layer %s, in %s",
		cs.Layers, image.HumanBytes(written), image.HumanBytes(treeBytes(dest)), time.Since(t0).Round(time.Millisecond)))
	return defs, stack, nil
}

// storeEnvd keeps one copy of envd per content digest in the layer store, to hard-link into
// every image rootfs.
func (b *Builder) storeEnvd(root, sum string) (string, error) {
	p := filepath.Join(root, "envd-sha256-"+sum)
	if _, err := os.Stat(p); err == nil {
		return p, nil
	}
	tmp := fmt.Sprintf("%s.tmp-%d", p, time.Now().UnixNano())
	if err := copyFile(b.EnvdPath, tmp, 0o755); err != nil {
		os.Remove(tmp)
		return "", err
	}
	if err := os.Chown(tmp, 0, 0); err != nil {
		os.Remove(tmp)
		return "", err
	}
	return p, os.Rename(tmp, p)
}

func fileSHA256(p string) (string, error) {
	f, err := os.Open(p)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// customizeTree makes an image rootfs (t: the template's stack, mounted for editing) into a
// template the way the Debian base is made, without writing into any shared layer: the `user`
// account (uid 1000 where free, home /home/user, passwordless sudo where sudo exists) unless
// the image has one, hostname, hosts, resolv.conf, and the directory of EnvdInRootFS in the top
// layer (linkEnvd puts envd there once the stack is unmounted).
func customizeTree(t *image.Tree, defs image.Defaults) error {
	if err := ensureUser(t); err != nil {
		return err
	}
	if err := t.MkdirAll("etc", 0o755, 0, 0); err != nil {
		return err
	}
	if err := t.WriteFile("etc/hostname", []byte("sandbox\n"), 0o644, 0, 0); err != nil {
		return err
	}
	hosts := "127.0.0.1\tlocalhost\n127.0.1.1\tsandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n"
	if err := t.WriteFile("etc/hosts", []byte(hosts), 0o644, 0, 0); err != nil {
		return err
	}
	resolv, err := os.ReadFile("/etc/resolv.conf")
	if err != nil {
		resolv = []byte("nameserver 1.1.1.1\n")
	}
	if err := t.WriteFile("etc/resolv.conf", resolv, 0o644, 0, 0); err != nil {
		return err
	}
	envdDir := filepath.Dir(strings.TrimPrefix(EnvdInRootFS, "/"))
	if err := t.MkdirAll(envdDir, 0o755, 0, 0); err != nil {
		return fmt.Errorf("envd directory: %w", err)
	}
	// Have overlayfs copy the directory (and its parents) up into the top layer, with the
	// image's owners and modes, so that envd can be linked there.
	for p := envdDir; p != "."; p = filepath.Dir(p) {
		st, err := t.Lstat(p)
		if err != nil {
			return fmt.Errorf("envd directory: %w", err)
		}
		if err := t.Chown(p, int(st.Uid), int(st.Gid)); err != nil {
			return fmt.Errorf("envd directory: %w", err)
		}
	}
	_ = t.MkdirAll("tmp", 0o1777, 0, 0)
	return nil
}

// linkEnvd links the stored envd at EnvdInRootFS in the top layer top (its directory is there:
// customizeTree).
func linkEnvd(top, envd string) error {
	t, err := image.OpenTree(top)
	if err != nil {
		return err
	}
	defer t.Close()
	return t.Link(strings.TrimPrefix(EnvdInRootFS, "/"), envd)
}

// treeBytes is the disk a directory tree takes (allocated blocks), for progress lines.
func treeBytes(root string) int64 {
	var n int64
	_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		var st syscall.Stat_t
		if syscall.Lstat(p, &st) == nil && (st.Nlink == 1 || d.IsDir()) {
			n += st.Blocks * 512
		}
		return nil
	})
	return n
}

// ensureUser adds the `user` account unless the image has one.
func ensureUser(t *image.Tree) error {
	passwd, err := t.ReadFile("etc/passwd")
	if errors.Is(err, os.ErrNotExist) {
		passwd, err = []byte("root:x:0:0:root:/root:/bin/sh\n"), nil
	}
	if err != nil {
		return fmt.Errorf("/etc/passwd: %w", err)
	}
	group, err := t.ReadFile("etc/group")
	if errors.Is(err, os.ErrNotExist) {
		group, err = []byte("root:x:0:\n"), nil
	}
	if err != nil {
		return fmt.Errorf("/etc/group: %w", err)
	}
	if _, ok := findEntry(passwd, "user"); ok {
		return nil
	}
	usedU, usedG := ids(passwd, 2), ids(group, 2)
	id := 1000
	for usedU[id] || usedG[id] {
		id++
	}
	shell := "/bin/sh"
	for _, p := range []string{"bin/bash", "usr/bin/bash"} {
		if t.Exists(p) {
			shell = "/bin/bash"
		}
	}
	sid := strconv.Itoa(id)
	if err := t.MkdirAll("etc", 0o755, 0, 0); err != nil {
		return err
	}
	if err := t.WriteFile("etc/passwd", appendLine(passwd, "user:x:"+sid+":"+sid+"::/home/user:"+shell), 0o644, 0, 0); err != nil {
		return err
	}
	if _, ok := findEntry(group, "user"); !ok {
		if err := t.WriteFile("etc/group", appendLine(group, "user:x:"+sid+":"), 0o644, 0, 0); err != nil {
			return err
		}
	}
	for _, f := range []struct{ file, line string }{{"etc/shadow", "user:*:19000:0:99999:7:::"}, {"etc/gshadow", "user:!::"}} {
		data, err := t.ReadFile(f.file)
		if err != nil {
			continue // an image without shadow files keeps none
		}
		if _, ok := findEntry(data, "user"); ok {
			continue
		}
		st, _ := t.Lstat(f.file)
		if err := t.WriteFile(f.file, appendLine(data, f.line), st.Mode&0o777, int(st.Uid), int(st.Gid)); err != nil {
			return err
		}
	}
	if t.Exists("usr/bin/sudo") || t.Exists("bin/sudo") {
		if err := t.MkdirAll("etc/sudoers.d", 0o755, 0, 0); err != nil {
			return err
		}
		if err := t.WriteFile("etc/sudoers.d/user", []byte("user ALL=(ALL:ALL) NOPASSWD: ALL\n"), 0o440, 0, 0); err != nil {
			return err
		}
	}
	if t.Exists("home/user") {
		return nil
	}
	if err := t.MkdirAll("home", 0o755, 0, 0); err != nil {
		return err
	}
	if err := t.MkdirAll("home/user", 0o755, id, id); err != nil {
		return err
	}
	var skel []os.DirEntry
	if st, err := t.Lstat("etc/skel"); err == nil && st.Mode&syscall.S_IFMT == syscall.S_IFDIR {
		skel, _ = os.ReadDir(filepath.Join(t.Path, "etc/skel")) // a real directory of the tree
	}
	for _, e := range skel {
		if !e.Type().IsRegular() {
			continue
		}
		data, err := t.ReadFile("etc/skel/" + e.Name())
		if err != nil {
			continue
		}
		if err := t.WriteFile("home/user/"+e.Name(), data, 0o644, id, id); err != nil {
			return err
		}
	}
	return nil
}

func findEntry(data []byte, name string) (string, bool) {
	for _, l := range strings.Split(string(data), "\n") {
		if strings.HasPrefix(l, name+":") {
			return l, true
		}
	}
	return "", false
}

// ids returns the numeric ids in field f of a passwd or group file.
func ids(data []byte, f int) map[int]bool {
	out := map[int]bool{}
	for _, l := range strings.Split(string(data), "\n") {
		fs := strings.Split(l, ":")
		if len(fs) > f {
			if n, err := strconv.Atoi(fs[f]); err == nil {
				out[n] = true
			}
		}
	}
	return out
}

func appendLine(data []byte, line string) []byte {
	s := string(data)
	if s != "" && !strings.HasSuffix(s, "\n") {
		s += "\n"
	}
	return []byte(s + line + "\n")
}

// BuildDebian makes the Debian template rootfs like BuildRootFS, but through the layer store:
// the debootstrap tarball is one layer, unpacked once per node, under the template's own top
// layer written to dest (which must not exist), so `base` and every template resolved to it
// (e2bdev/base) share its bytes. It returns the rootfs's stack (Top = dest).
func (b *Builder) BuildDebian(ctx context.Context, cfg ImageConfig, dest string, progress Progress) (image.Stack, error) {
	var none image.Stack
	if progress == nil {
		progress = func(string) {}
	}
	if _, err := os.Stat(dest); err == nil {
		return none, fmt.Errorf("rootfs %s already exists", dest)
	}
	envdSum, err := fileSHA256(b.EnvdPath)
	if err != nil {
		return none, fmt.Errorf("envd binary: %w", err)
	}
	tarball, err := b.debootstrapTarball(ctx, progress)
	if err != nil {
		return none, err
	}
	st := cfg.Layers
	if err := os.MkdirAll(st.Root, 0o700); err != nil {
		return none, err
	}
	l, err := tarLayer(st.Root, tarball)
	if err != nil {
		return none, err
	}
	ld, err := st.Layer(ctx, l, nil, image.Progress(progress))
	if err != nil {
		return none, fmt.Errorf("debootstrap layer %s: %w", filepath.Base(tarball), err)
	}
	defer st.Release([]image.LayerDir{ld}, false) // the debootstrap layer stays cached
	envdStore, err := b.storeEnvd(st.Root, envdSum)
	if err != nil {
		return none, err
	}
	tmp := dest + ".tmp"
	os.RemoveAll(tmp)
	if err := os.MkdirAll(tmp, 0o755); err != nil {
		return none, err
	}
	stack, _, err := image.Compose(ctx, tmp, []image.LayerDir{ld})
	if err == nil {
		progress("adding user `user`, sudo and envd")
		err = stack.Edit(ctx, func(t *image.Tree) error {
			if err := customizeTree(t, image.Defaults{}); err != nil {
				return err
			}
			return leanLoginShell(t)
		})
	}
	if err == nil {
		err = linkEnvd(tmp, envdStore)
	}
	if err == nil {
		err = os.Rename(tmp, dest)
	}
	if err != nil {
		os.RemoveAll(tmp)
		return none, fmt.Errorf("rootfs: %w", err)
	}
	stack.Top = dest
	progress("rootfs ready")
	return stack, nil
}

// fileTarLayer is an uncompressed tar file as a layer (the debootstrap cache).
type fileTarLayer struct {
	v1.Layer // unused methods panic: the store needs only these
	path     string
	diff     v1.Hash
	size     int64
}

func (l *fileTarLayer) DiffID() (v1.Hash, error)           { return l.diff, nil }
func (l *fileTarLayer) Compressed() (io.ReadCloser, error) { return os.Open(l.path) }
func (l *fileTarLayer) Size() (int64, error)               { return l.size, nil }

// tarLayer makes tarball a layer, its digest cached in the store beside the layers (keyed by
// the tarball's name, size and mtime; the store verifies it when unpacking anyway).
func tarLayer(root, tarball string) (*fileTarLayer, error) {
	fi, err := os.Stat(tarball)
	if err != nil {
		return nil, err
	}
	key := filepath.Join(root, fmt.Sprintf(".digest-%s-%d-%d", filepath.Base(tarball), fi.Size(), fi.ModTime().UnixNano()))
	sum := ""
	if b, err := os.ReadFile(key); err == nil && len(b) == 64 {
		sum = string(b)
	} else {
		if sum, err = fileSHA256(tarball); err != nil {
			return nil, err
		}
		_ = os.WriteFile(key, []byte(sum), 0o600)
	}
	return &fileTarLayer{path: tarball, diff: v1.Hash{Algorithm: "sha256", Hex: sum}, size: fi.Size()}, nil
}

// userName turns an image's USER (name, uid, name:group or uid:gid) into the account name the
// sandbox's processes run as by default; "" stays "" (ember's `user`).
func userName(t *image.Tree, user string) (string, error) {
	u, _, _ := strings.Cut(user, ":")
	if u == "" {
		return "", nil
	}
	passwd, _ := t.ReadFile("etc/passwd")
	for _, l := range strings.Split(string(passwd), "\n") {
		f := strings.Split(l, ":")
		if len(f) > 2 && (f[0] == u || f[2] == u) {
			return f[0], nil
		}
	}
	return "", fmt.Errorf("the image's user %q has no account in /etc/passwd: %w", user, errdefs.ErrInvalid)
}
