package image

import (
	"archive/tar"
	"bytes"
	"context"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/testutil"
)

// FuzzUnpack: whatever a layer holds, nothing is written outside the unpack root.
func FuzzUnpack(f *testing.F) {
	testutil.RequireRoot(f)
	for _, ents := range [][]ent{
		{file("a", "x"), symlink("l", "/"), file("l/x", "y")},
		{dir("d"), symlink("d/up", "../.."), hardlink("h", "d/up"), file("d/up/x", "z")},
		{file(".wh.a", ""), file("a/.wh..wh..opq", ""), hardlink("b", "a")},
		{{name: "dev/zero", typ: tar.TypeChar}, {name: "p", typ: tar.TypeFifo}},
	} {
		f.Add(tarOf(f, ents...))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		base := t.TempDir()
		root := filepath.Join(base, "in", "root")
		os.MkdirAll(root, 0o755)
		sentinel := filepath.Join(base, "sentinel")
		os.WriteFile(sentinel, []byte("s"), 0o644)
		Unpack(context.Background(), bytes.NewReader(data), root, Limits{MaxBytes: 1 << 20, MaxEntries: 1000}, nil)
		entries, _ := os.ReadDir(base)
		if len(entries) != 2 {
			t.Fatalf("written beside the root: %v", entries)
		}
		if e, _ := os.ReadDir(filepath.Join(base, "in")); len(e) != 1 {
			t.Fatalf("written beside the root: %v", e)
		}
		if b, _ := os.ReadFile(sentinel); string(b) != "s" {
			t.Fatal("sentinel changed")
		}
		filepath.Walk(root, func(p string, info os.FileInfo, err error) error {
			if err == nil && info.Mode()&(os.ModeDevice|os.ModeCharDevice) != 0 {
				t.Fatalf("device node %s", p)
			}
			return nil
		})
	})
}

func TestCopyIntoKeepsAttributes(t *testing.T) {
	testutil.RequireRoot(t)
	dir := t.TempDir()
	src := filepath.Join(dir, "src")
	os.WriteFile(src, []byte("content"), 0o600)
	os.Chown(src, 12, 34)
	unix.Chmod(src, 0o4751)
	unix.Setxattr(src, "user.k", []byte("v"), 0)
	out := filepath.Join(dir, "out")
	os.Mkdir(out, 0o755)
	fd, _ := unix.Open(out, unix.O_DIRECTORY|unix.O_RDONLY, 0)
	defer unix.Close(fd)
	if err := copyInto(src, fd, "copy"); err != nil {
		t.Fatal(err)
	}
	var a, b syscall.Stat_t
	syscall.Stat(src, &a)
	syscall.Stat(filepath.Join(out, "copy"), &b)
	data, _ := os.ReadFile(filepath.Join(out, "copy"))
	buf := make([]byte, 8)
	n, _ := unix.Getxattr(filepath.Join(out, "copy"), "user.k", buf)
	if string(data) != "content" || a.Ino == b.Ino || b.Uid != 12 || b.Gid != 34 || b.Mode&0o7777 != 0o4751 || string(buf[:n]) != "v" || a.Mtim != b.Mtim {
		t.Fatalf("copy: %q ino %d/%d uid %d gid %d mode %o xattr %q", data, a.Ino, b.Ino, b.Uid, b.Gid, b.Mode&0o7777, buf[:n])
	}
}
