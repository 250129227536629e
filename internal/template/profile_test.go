package template

import (
	"archive/tar"
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/testutil"
)

// debianProfile has the shape of Debian's /etc/profile: the uid decides PATH.
const debianProfile = `if [ "$(id -u)" -eq 0 ]; then
  PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
else
  PATH="/usr/local/bin:/usr/bin:/bin:/usr/local/games:/usr/games"
fi
export PATH
`

const debianRootProfile = `# ~/.profile: executed by Bourne-compatible login shells.

if [ "$BASH" ]; then
  if [ -f ~/.bashrc ]; then
    . ~/.bashrc
  fi
fi

mesg n 2> /dev/null || true
`

// TestBuildDebianLeanLoginShell: the base template's login shell sets the PATH Debian's sets
// without running id (bash knows its uid), sh still gets it from id, and root's .profile runs
// mesg only on a terminal. The files are new inodes, not writes into the cached layer.
func TestBuildDebianLeanLoginShell(t *testing.T) {
	testutil.RequireRoot(t)
	_, err := exec.LookPath("bash")
	testutil.Need(t, err == nil, "no bash")
	_, cfg, dir := newImageBuilder(t)
	b := &Builder{CacheDir: filepath.Join(dir, "cache"), EnvdPath: filepath.Join(dir, "envd"), Suite: "bookworm", Mirror: "http://example.invalid/debian"}
	os.MkdirAll(b.CacheDir, 0o755)
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range []tfile{
		{name: "./", typ: tar.TypeDir, mode: 0o755},
		{name: "./etc/", typ: tar.TypeDir, mode: 0o755},
		{name: "./etc/passwd", body: "root:x:0:0:root:/root:/bin/bash\n"},
		{name: "./etc/group", body: "root:x:0:\n"},
		{name: "./etc/profile", body: debianProfile},
		{name: "./root/", typ: tar.TypeDir, mode: 0o700},
		{name: "./root/.profile", body: debianRootProfile},
	} {
		h := &tar.Header{Name: e.name, Typeflag: e.typ, Mode: e.mode, Size: int64(len(e.body)), ModTime: time.Unix(1700000000, 0)}
		if h.Typeflag == 0 {
			h.Typeflag = tar.TypeReg
		}
		if h.Mode == 0 {
			h.Mode = 0o644
		}
		tw.WriteHeader(h)
		tw.Write([]byte(e.body))
	}
	tw.Close()
	os.WriteFile(filepath.Join(b.CacheDir, "debootstrap-bookworm-"+b.cacheKey()+".tar"), buf.Bytes(), 0o644)
	dest := filepath.Join(dir, "templates", "base")
	if _, err := b.BuildDebian(context.Background(), cfg, dest, nil); err != nil {
		t.Fatal(err)
	}

	// A fake id and mesg first on PATH record whether the start-up files ran them.
	bin := t.TempDir()
	calls := filepath.Join(bin, "calls")
	for _, name := range []string{"id", "mesg"} {
		script := "#!/bin/sh\necho " + name + " >> " + calls + "\nexec /usr/bin/" + name + " \"$@\"\n"
		os.WriteFile(filepath.Join(bin, name), []byte(script), 0o755)
	}
	source := func(shell, file string) (path, ran string) {
		t.Helper()
		os.Remove(calls)
		cmd := exec.Command(shell, "-c", `. "$0"; printf %s "$PATH"`, filepath.Join(dest, file))
		cmd.Env = []string{"PATH=" + bin + ":/usr/bin:/bin", "HOME=" + filepath.Join(dest, "root")}
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%s . %s: %v: %s", shell, file, err, out)
		}
		r, _ := os.ReadFile(calls)
		return string(out), strings.TrimSpace(string(r))
	}
	rootPath := "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	if path, ran := source("bash", "etc/profile"); path != rootPath || ran != "" {
		t.Fatalf("bash: PATH %q, ran %q; want PATH %q and no program run", path, ran, rootPath)
	}
	if sh, err := exec.LookPath("dash"); err == nil {
		if path, ran := source(sh, "etc/profile"); path != rootPath || ran != "id" {
			t.Fatalf("dash: PATH %q, ran %q; want PATH %q from id", path, ran, rootPath)
		}
	}
	if _, ran := source("bash", "root/.profile"); ran != "" {
		t.Fatalf("root's .profile ran %q without a terminal", ran)
	}

	var layer, built syscall.Stat_t
	profiles, _ := filepath.Glob(filepath.Join(dir, "layers", "*", "*", "etc", "profile"))
	for _, p := range profiles {
		syscall.Stat(p, &layer)
		if data, _ := os.ReadFile(p); string(data) != debianProfile {
			t.Fatalf("the cached layer's %s was modified:\n%s", p, data)
		}
	}
	syscall.Stat(filepath.Join(dest, "etc/profile"), &built)
	if len(profiles) > 0 && layer.Ino == built.Ino {
		t.Fatal("the template's /etc/profile is the layer's file")
	}
	if built.Mode&0o777 != 0o644 {
		t.Fatalf("/etc/profile mode %o", built.Mode&0o777)
	}
}
