package drivertest

import (
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"

	"github.com/ember-sandbox/ember/internal/testutil"
)

var (
	busyboxOnce sync.Once
	busyboxErr  error
)

// findBusybox returns a statically linked busybox, installing Debian's busybox-static when it is
// missing and apt-get is usable.
func findBusybox(t testing.TB) string {
	t.Helper()
	const p = "/bin/busybox"
	busyboxOnce.Do(func() {
		if _, err := os.Stat(p); err == nil {
			return
		}
		if os.Geteuid() != 0 {
			busyboxErr = fmt.Errorf("no %s and not root to install busybox-static", p)
			return
		}
		cmd := exec.Command("apt-get", "install", "-y", "busybox-static")
		cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
		if out, err := cmd.CombinedOutput(); err != nil {
			busyboxErr = fmt.Errorf("apt-get install busybox-static: %v: %s", err, out)
		}
	})
	testutil.Need(t, busyboxErr == nil, fmt.Sprint("busybox: ", busyboxErr))
	out, err := exec.Command("file", "-L", p).CombinedOutput()
	if err == nil && strings.Contains(string(out), "dynamically linked") {
		testutil.Need(t, false, p+" is dynamically linked; install busybox-static")
	}
	return p
}

// BusyboxRootFS builds a tiny root filesystem in a temporary directory removed at the end of t:
// a static busybox with a symlink per applet in /bin, the usual empty top-level directories,
// /etc/passwd and /etc/group for root. It takes a few milliseconds.
func BusyboxRootFS(t testing.TB) string {
	t.Helper()
	bb := findBusybox(t)
	root := filepath.Join(t.TempDir(), "rootfs")
	for _, d := range []string{"bin", "sbin", "usr/bin", "usr/sbin", "etc", "proc", "sys", "dev", "tmp", "root", "var/tmp", "run", "home"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	_ = os.Chmod(filepath.Join(root, "tmp"), 0o1777)
	data, err := os.ReadFile(bb)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "bin", "busybox"), data, 0o755); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(bb, "--list").Output()
	if err != nil {
		t.Fatalf("busybox --list: %v", err)
	}
	for _, applet := range strings.Fields(string(out)) {
		if applet == "busybox" {
			continue
		}
		if err := os.Symlink("busybox", filepath.Join(root, "bin", applet)); err != nil {
			t.Fatal(err)
		}
	}
	files := map[string]string{
		"etc/passwd":   "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
		"etc/group":    "root:x:0:\nnogroup:x:65534:\n",
		"etc/hostname": "sandbox\n",
		"etc/hosts":    "127.0.0.1 localhost\n",
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(root, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

// treeDigest describes every entry of a directory tree (path, mode, size, mtime), so a test can
// show that a tree was not written.
func treeDigest(t testing.TB, root string) string {
	t.Helper()
	var lines []string
	err := filepath.WalkDir(root, func(p string, de fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := de.Info()
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		lines = append(lines, fmt.Sprintf("%s %v %d %d", rel, fi.Mode(), fi.Size(), fi.ModTime().UnixNano()))
		return nil
	})
	if err != nil {
		t.Fatalf("walk %s: %v", root, err)
	}
	sort.Strings(lines)
	return strings.Join(lines, "\n")
}
