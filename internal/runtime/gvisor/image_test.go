package gvisor_test

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/runtime/gvisor"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// bigSparse is the largest 16 TiB-ish size the test's filesystem takes (ext4 stops 4 KiB short).
func bigSparse(t *testing.T, dir string) int64 {
	t.Helper()
	for _, n := range []int64{16 << 40, 16<<40 - 4096} {
		f, err := os.CreateTemp(dir, "probe")
		if err != nil {
			t.Fatal(err)
		}
		err = f.Truncate(n)
		f.Close()
		os.Remove(f.Name())
		if err == nil {
			return n
		}
	}
	t.Fatal("the test filesystem takes no 16 TiB sparse file")
	return 0
}

// imageDriver is a driver for the image methods only (they do not run runsc).
func imageDriver(t *testing.T) *gvisor.Driver {
	t.Helper()
	testutil.RequireRoot(t)
	d, err := gvisor.New(gvisor.Config{Runsc: "/bin/true", Root: filepath.Join(t.TempDir(), "root"), IgnoreCgroups: true})
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// makeImage builds an image directory as Checkpoint leaves it: memory files and a layer whose
// upper has every kind of entry overlayfs and a sandbox produce.
func makeImage(t *testing.T) (dir string, sparseSize int64) {
	t.Helper()
	dir = filepath.Join(t.TempDir(), "img")
	upper := filepath.Join(dir, "layer", "upper")
	must(t, os.MkdirAll(upper, 0o755))
	must(t, os.MkdirAll(filepath.Join(dir, "layer", "work"), 0o700))
	must(t, os.WriteFile(filepath.Join(dir, "checkpoint.img"), []byte("state"), 0o600))
	pages, err := os.Create(filepath.Join(dir, "pages.img"))
	must(t, err)
	must(t, pages.Truncate(1<<30))
	_, err = pages.WriteAt(bytes.Repeat([]byte{7}, 1<<20), 512<<20)
	must(t, err)
	pages.Close()

	w := func(rel, data string, mode os.FileMode) {
		p := filepath.Join(upper, rel)
		must(t, os.MkdirAll(filepath.Dir(p), 0o755))
		must(t, os.WriteFile(p, []byte(data), mode))
		must(t, os.Chmod(p, mode))
	}
	w("etc/app.conf", "conf", 0o640)
	must(t, os.Chown(filepath.Join(upper, "etc/app.conf"), 1000, 1000))
	w("usr/bin/suid", "binary", 0o4755)
	w("home/user/a", "hard", 0o644)
	must(t, os.Link(filepath.Join(upper, "home/user/a"), filepath.Join(upper, "home/user/b")))
	must(t, os.Symlink("/etc/passwd", filepath.Join(upper, "home/user/abs-link")))
	must(t, os.Symlink("../a", filepath.Join(upper, "home/user/rel-link")))
	must(t, unix.Mknod(filepath.Join(upper, "etc/deleted"), unix.S_IFCHR, 0))
	must(t, os.MkdirAll(filepath.Join(upper, "opaque"), 0o755))
	must(t, unix.Setxattr(filepath.Join(upper, "opaque"), "trusted.overlay.opaque", []byte("y"), 0))
	must(t, unix.Setxattr(filepath.Join(upper, "etc/app.conf"), "user.meta", []byte("v1"), 0))
	w("empty", "", 0o600)
	rnd := make([]byte, 3<<20+17) // through copy_file_range, not at block boundaries
	_, _ = rand.Read(rnd)
	w("var/random", string(rnd), 0o644)
	sparseSize = bigSparse(t, upper)
	f, err := os.Create(filepath.Join(upper, "sparse"))
	must(t, err)
	must(t, f.Truncate(sparseSize))
	_, err = f.WriteAt([]byte("tail"), 1<<40)
	must(t, err)
	f.Close()
	// A fifo and a device node are dropped by Export (import would refuse them).
	must(t, unix.Mkfifo(filepath.Join(upper, "fifo"), 0o644))
	must(t, unix.Mknod(filepath.Join(upper, "null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
	old := time.Date(2020, 1, 2, 3, 4, 5, 6000, time.UTC)
	must(t, os.Chtimes(filepath.Join(upper, "etc/app.conf"), old, old))
	must(t, os.Chtimes(filepath.Join(upper, "etc"), old, old))
	return dir, sparseSize
}

// treeOf describes a tree for comparison: type, mode, owner, size, mtime, xattrs, link targets,
// data digests, and hard-link groups.
func treeOf(t *testing.T, root string) []string {
	t.Helper()
	var lines []string
	inodes := map[uint64]string{}
	err := filepath.WalkDir(root, func(p string, de fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if rel == "." {
			return nil
		}
		var st unix.Stat_t
		must(t, unix.Lstat(p, &st))
		line := fmt.Sprintf("%s type=%o mode=%o uid=%d gid=%d", rel, st.Mode&unix.S_IFMT, st.Mode&0o7777, st.Uid, st.Gid)
		if st.Mode&unix.S_IFMT != unix.S_IFDIR {
			line += fmt.Sprintf(" size=%d mtime=%d", st.Size, st.Mtim.Nano())
		}
		if st.Mode&unix.S_IFMT == unix.S_IFDIR && rel == "etc" {
			line += fmt.Sprintf(" mtime=%d", st.Mtim.Nano())
		}
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFLNK:
			target, _ := os.Readlink(p)
			line += " -> " + target
		case unix.S_IFREG:
			if st.Size < 8<<20 {
				b, _ := os.ReadFile(p)
				line += fmt.Sprintf(" sha=%x", sha256.Sum256(b))
			}
			if first, ok := inodes[st.Ino]; ok {
				line += " link=" + first
			} else {
				inodes[st.Ino] = rel
			}
		case unix.S_IFCHR:
			line += fmt.Sprintf(" rdev=%d:%d", unix.Major(st.Rdev), unix.Minor(st.Rdev))
		}
		if st.Mode&unix.S_IFMT != unix.S_IFLNK {
			for _, x := range []string{"trusted.overlay.opaque", "user.meta"} {
				buf := make([]byte, 64)
				if n, err := unix.Lgetxattr(p, x, buf); err == nil {
					line += fmt.Sprintf(" %s=%s", x, buf[:n])
				}
			}
		}
		lines = append(lines, line)
		return nil
	})
	must(t, err)
	sort.Strings(lines)
	return lines
}

func blocks(t *testing.T, p string) int64 {
	t.Helper()
	var st unix.Stat_t
	must(t, unix.Stat(p, &st))
	return st.Blocks
}

func TestExportImportRoundTrip(t *testing.T) {
	d := imageDriver(t)
	ctx := context.Background()
	img, sparseSize := makeImage(t)
	exp := t.TempDir()
	t0 := time.Now()
	if err := d.ExportImage(ctx, img, exp); err != nil {
		t.Fatalf("ExportImage: %v", err)
	}
	t.Logf("ExportImage (1 GiB sparse memory file, %d-byte sparse layer file): %v", sparseSize, time.Since(t0))
	ents, err := os.ReadDir(exp)
	must(t, err)
	var names []string
	for _, e := range ents {
		fi, err := os.Lstat(filepath.Join(exp, e.Name()))
		must(t, err)
		if !fi.Mode().IsRegular() || fi.Mode().Perm() != 0o600 {
			t.Errorf("exported %s: mode %v, want a regular file 0600", e.Name(), fi.Mode())
		}
		names = append(names, e.Name())
	}
	if got := strings.Join(names, " "); got != "checkpoint.img layer.tar pages.img" {
		t.Errorf("exported files = %s", got)
	}
	if b := blocks(t, filepath.Join(exp, "pages.img")); b > 4096 {
		t.Errorf("exported pages.img has %d blocks: holes filled", b)
	}
	if fi, _ := os.Stat(filepath.Join(exp, "layer.tar")); fi.Size() > 8<<20 {
		t.Errorf("layer.tar is %d bytes: holes exported", fi.Size())
	}
	// Standard tools read the archive (sparse data aside).
	if out, err := exec.Command("tar", "-tvf", filepath.Join(exp, "layer.tar")).CombinedOutput(); err != nil {
		t.Errorf("tar -t: %v: %s", err, out)
	}

	dst := filepath.Join(t.TempDir(), "imported")
	t0 = time.Now()
	if err := d.ImportImage(ctx, exp, dst, runtime.ImportOptions{MaxBytes: 64 << 20}); err != nil {
		t.Fatalf("ImportImage: %v", err)
	}
	t.Logf("ImportImage: %v", time.Since(t0))
	want := treeOf(t, filepath.Join(img, "layer", "upper"))
	// Export drops the fifo and the device node.
	var wantKept []string
	for _, l := range want {
		if !strings.HasPrefix(l, "fifo ") && !strings.HasPrefix(l, "null ") {
			wantKept = append(wantKept, l)
		}
	}
	got := treeOf(t, filepath.Join(dst, "layer", "upper"))
	if strings.Join(got, "\n") != strings.Join(wantKept, "\n") {
		t.Errorf("imported layer differs:\ngot:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(wantKept, "\n"))
	}
	if b := blocks(t, filepath.Join(dst, "layer", "upper", "sparse")); b > 64 {
		t.Errorf("imported sparse file has %d blocks, want it sparse", b)
	}
	if b := blocks(t, filepath.Join(dst, "pages.img")); b > 4096 {
		t.Errorf("imported pages.img has %d blocks", b)
	}
	for _, p := range []string{dst, filepath.Join(dst, "layer")} {
		if fi, _ := os.Stat(p); fi.Mode().Perm() != 0o700 {
			t.Errorf("%s: mode %v, want 0700", p, fi.Mode())
		}
	}
	b := make([]byte, 4)
	f, err := os.Open(filepath.Join(dst, "layer", "upper", "sparse"))
	must(t, err)
	_, err = f.ReadAt(b, 1<<40)
	f.Close()
	if err != nil || string(b) != "tail" {
		t.Errorf("sparse data = %q, %v", b, err)
	}
	if err := d.ImportImage(ctx, exp, dst, runtime.ImportOptions{}); !errors.Is(err, errdefs.ErrConflict) {
		t.Errorf("ImportImage into an existing dir = %v, want ErrConflict", err)
	}
	if err := d.ExportImage(ctx, img, exp); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("ExportImage into a non-empty dir = %v, want ErrInvalid", err)
	}
}

// hostile describes one malicious exported image.
type hostile struct {
	name  string
	build func(t *testing.T, src, sentinel string) // writes the exported files into src
	max   int64
}

// tarFile writes layer.tar into src from headers (data for regular files in body).
func tarFile(t *testing.T, src string, entries ...tarEntry) {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := e.hdr
		if h.Format == 0 {
			h.Format = tar.FormatPAX
		}
		if h.Typeflag == tar.TypeReg && h.Size == 0 {
			h.Size = int64(len(e.body))
		}
		if h.Mode == 0 {
			h.Mode = 0o644
		}
		must(t, tw.WriteHeader(&h))
		if len(e.body) > 0 {
			_, err := tw.Write([]byte(e.body))
			must(t, err)
		}
	}
	must(t, tw.Close())
	must(t, os.WriteFile(filepath.Join(src, "layer.tar"), buf.Bytes(), 0o600))
}

type tarEntry struct {
	hdr  tar.Header
	body string
}

func reg(name, body string) tarEntry {
	return tarEntry{tar.Header{Name: name, Typeflag: tar.TypeReg}, body}
}

func withCheckpoint(t *testing.T, src string) {
	t.Helper()
	must(t, os.WriteFile(filepath.Join(src, "checkpoint.img"), []byte("state"), 0o600))
}

func TestImportHostile(t *testing.T) {
	d := imageDriver(t)
	t.Cleanup(gvisor.SetMaxImportEntries(10))
	cases := []hostile{
		{name: "symlink then write through it", build: func(t *testing.T, src, sentinel string) {
			withCheckpoint(t, src)
			tarFile(t, src,
				tarEntry{hdr: tar.Header{Name: "x", Typeflag: tar.TypeSymlink, Linkname: sentinel}},
				reg("x/pwned", "owned"))
		}},
		{name: "symlinked directory component", build: func(t *testing.T, src, sentinel string) {
			withCheckpoint(t, src)
			tarFile(t, src,
				tarEntry{hdr: tar.Header{Name: "d/", Typeflag: tar.TypeDir, Mode: 0o755}},
				tarEntry{hdr: tar.Header{Name: "d/l", Typeflag: tar.TypeSymlink, Linkname: sentinel}},
				tarEntry{hdr: tar.Header{Name: "d/l/sub/", Typeflag: tar.TypeDir, Mode: 0o755}})
		}},
		{name: "dotdot name", build: func(t *testing.T, src, sentinel string) {
			withCheckpoint(t, src)
			tarFile(t, src, reg("../../../sentinel/pwned", "owned"))
		}},
		{name: "dotdot inside name", build: func(t *testing.T, src, sentinel string) {
			withCheckpoint(t, src)
			tarFile(t, src, tarEntry{hdr: tar.Header{Name: "a/", Typeflag: tar.TypeDir, Mode: 0o755}}, reg("a/../../../../sentinel/pwned", "owned"))
		}},
		{name: "absolute name", build: func(t *testing.T, src, sentinel string) {
			withCheckpoint(t, src)
			tarFile(t, src, reg(filepath.Join(sentinel, "pwned"), "owned"))
		}},
		{name: "hard link outside", build: func(t *testing.T, src, sentinel string) {
			withCheckpoint(t, src)
			tarFile(t, src, tarEntry{hdr: tar.Header{Name: "h", Typeflag: tar.TypeLink, Linkname: filepath.Join(sentinel, "keep")}})
		}},
		{name: "hard link dotdot", build: func(t *testing.T, src, sentinel string) {
			withCheckpoint(t, src)
			tarFile(t, src, tarEntry{hdr: tar.Header{Name: "h", Typeflag: tar.TypeLink, Linkname: "../../../sentinel/keep"}})
		}},
		{name: "hard link to a symlink", build: func(t *testing.T, src, sentinel string) {
			withCheckpoint(t, src)
			tarFile(t, src,
				tarEntry{hdr: tar.Header{Name: "l", Typeflag: tar.TypeSymlink, Linkname: filepath.Join(sentinel, "keep")}},
				tarEntry{hdr: tar.Header{Name: "h", Typeflag: tar.TypeLink, Linkname: "l"}})
		}},
		{name: "char device 1:3", build: func(t *testing.T, src, sentinel string) {
			withCheckpoint(t, src)
			tarFile(t, src, tarEntry{hdr: tar.Header{Name: "null", Typeflag: tar.TypeChar, Devmajor: 1, Devminor: 3}})
		}},
		{name: "block device", build: func(t *testing.T, src, sentinel string) {
			withCheckpoint(t, src)
			tarFile(t, src, tarEntry{hdr: tar.Header{Name: "sda", Typeflag: tar.TypeBlock, Devmajor: 8, Devminor: 0}})
		}},
		{name: "fifo", build: func(t *testing.T, src, sentinel string) {
			withCheckpoint(t, src)
			tarFile(t, src, tarEntry{hdr: tar.Header{Name: "p", Typeflag: tar.TypeFifo}})
		}},
		{name: "duplicate name", build: func(t *testing.T, src, sentinel string) {
			withCheckpoint(t, src)
			tarFile(t, src, reg("f", "one"), reg("f", "two"))
		}},
		{name: "data over MaxBytes", max: 1000, build: func(t *testing.T, src, sentinel string) {
			withCheckpoint(t, src)
			tarFile(t, src, reg("big", strings.Repeat("x", 5000)))
		}},
		{name: "memory file over MaxBytes", max: 1000, build: func(t *testing.T, src, sentinel string) {
			withCheckpoint(t, src)
			must(t, os.WriteFile(filepath.Join(src, "pages.img"), bytes.Repeat([]byte{1}, 5000), 0o600))
		}},
		{name: "sparse map over MaxBytes", max: 1000, build: func(t *testing.T, src, sentinel string) {
			withCheckpoint(t, src)
			tarFile(t, src, tarEntry{hdr: tar.Header{Name: "s", Typeflag: tar.TypeReg, Size: 5000,
				PAXRecords: map[string]string{"EMBER.size": "1099511627776", "EMBER.sparse": "0:5000"}}, body: strings.Repeat("x", 5000)})
		}},
		{name: "sparse map beyond size", build: func(t *testing.T, src, sentinel string) {
			withCheckpoint(t, src)
			tarFile(t, src, tarEntry{hdr: tar.Header{Name: "s", Typeflag: tar.TypeReg, Size: 4,
				PAXRecords: map[string]string{"EMBER.size": "10", "EMBER.sparse": "8:4"}}, body: "xxxx"})
		}},
		{name: "truncated archive", build: func(t *testing.T, src, sentinel string) {
			withCheckpoint(t, src)
			tarFile(t, src, reg("a", strings.Repeat("x", 4000)), reg("b", "y"))
			b, _ := os.ReadFile(filepath.Join(src, "layer.tar"))
			must(t, os.WriteFile(filepath.Join(src, "layer.tar"), b[:1500], 0o600))
		}},
		{name: "garbage archive", build: func(t *testing.T, src, sentinel string) {
			withCheckpoint(t, src)
			must(t, os.WriteFile(filepath.Join(src, "layer.tar"), bytes.Repeat([]byte("garbage!"), 200), 0o600))
		}},
		{name: "symlinked memory file", build: func(t *testing.T, src, sentinel string) {
			must(t, os.Symlink(filepath.Join(sentinel, "keep"), filepath.Join(src, "checkpoint.img")))
		}},
		{name: "symlinked archive", build: func(t *testing.T, src, sentinel string) {
			withCheckpoint(t, src)
			must(t, os.Symlink(filepath.Join(sentinel, "keep"), filepath.Join(src, "layer.tar")))
		}},
		{name: "directory in the export", build: func(t *testing.T, src, sentinel string) {
			withCheckpoint(t, src)
			must(t, os.MkdirAll(filepath.Join(src, "layer", "upper"), 0o755))
		}},
		{name: "too many entries", build: func(t *testing.T, src, sentinel string) {
			withCheckpoint(t, src)
			var es []tarEntry
			for i := 0; i < 20; i++ {
				es = append(es, reg(fmt.Sprintf("f%d", i), "x"))
			}
			tarFile(t, src, es...)
		}},
		{name: "no checkpoint", build: func(t *testing.T, src, sentinel string) {
			tarFile(t, src, reg("a", "x"))
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			base := t.TempDir()
			sentinel := filepath.Join(base, "sentinel")
			must(t, os.Mkdir(sentinel, 0o755))
			must(t, os.WriteFile(filepath.Join(sentinel, "keep"), []byte("keep"), 0o644))
			before := treeOf(t, base)
			src := filepath.Join(base, "src")
			must(t, os.Mkdir(src, 0o755))
			tc.build(t, src, sentinel)
			beforeSentinel := treeOf(t, sentinel)
			dst := filepath.Join(base, "dst", "image")
			must(t, os.Mkdir(filepath.Dir(dst), 0o755))
			err := d.ImportImage(context.Background(), src, dst, runtime.ImportOptions{MaxBytes: tc.max})
			if err == nil {
				t.Fatalf("ImportImage accepted it")
			}
			t.Logf("refused: %v", err)
			if _, serr := os.Lstat(dst); !errors.Is(serr, fs.ErrNotExist) {
				t.Errorf("imageDir left behind after the error (lstat: %v)", serr)
			}
			if got := treeOf(t, sentinel); strings.Join(got, "\n") != strings.Join(beforeSentinel, "\n") {
				t.Errorf("the sentinel directory changed:\n%s", strings.Join(got, "\n"))
			}
			if got := treeOf(t, base); len(got) != len(before)+countSrc(t, src)+1 {
				t.Errorf("entries outside imageDir appeared:\n%s", strings.Join(got, "\n"))
			}
		})
	}
}

// countSrc counts the entries under src plus src itself.
func countSrc(t *testing.T, src string) int {
	t.Helper()
	n := 0
	_ = filepath.WalkDir(src, func(string, fs.DirEntry, error) error { n++; return nil })
	return n
}

// A restored image whose layer/upper is a symlink to a host directory is refused, not mounted,
// whether the layer is taken (resume) or cloned (fork).
func TestPrepareRefusesSymlinkedLayer(t *testing.T) {
	testutil.RequireRoot(t)
	lower := t.TempDir()
	for _, tc := range []struct{ name, link string }{
		{"upper", "layer/upper"},
		{"work", "layer/work"},
		{"layer", "layer"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			base := t.TempDir()
			sentinel := filepath.Join(base, "sentinel")
			must(t, os.Mkdir(sentinel, 0o755))
			must(t, os.WriteFile(filepath.Join(sentinel, "keep"), []byte("keep"), 0o644))
			before := treeOf(t, sentinel)
			sbx := filepath.Join(base, "sbx")
			must(t, os.MkdirAll(filepath.Join(sbx, filepath.Dir(tc.link)), 0o700))
			must(t, os.Symlink(sentinel, filepath.Join(sbx, tc.link)))
			merged, cleanup, err := gvisor.PrepareRootFS([]string{lower}, sbx)
			if err == nil {
				_ = cleanup()
				t.Fatalf("PrepareRootFS mounted %s with a symlinked %s", merged, tc.link)
			}
			if !errors.Is(err, errdefs.ErrInvalid) {
				t.Errorf("err = %v, want ErrInvalid", err)
			}
			if got := treeOf(t, sentinel); strings.Join(got, "\n") != strings.Join(before, "\n") {
				t.Errorf("sentinel changed: %v", got)
			}
			if _, err := gvisor.CloneUpper(sbx, filepath.Join(base, "child")); err == nil {
				t.Errorf("CloneUpper cloned a symlinked %s", tc.link)
			}
		})
	}
}

// TestImportDropsXattrs: extended attributes outside the allowed set (an overlayfs redirect, any
// other trusted.* one) are not applied; user.* and the opaque marker are.
func TestImportDropsXattrs(t *testing.T) {
	d := imageDriver(t)
	src := t.TempDir()
	withCheckpoint(t, src)
	tarFile(t, src, tarEntry{hdr: tar.Header{Name: "d/", Typeflag: tar.TypeDir, Mode: 0o755, PAXRecords: map[string]string{
		"SCHILY.xattr.trusted.overlay.opaque":   "y",
		"SCHILY.xattr.trusted.overlay.redirect": "/etc",
		"SCHILY.xattr.trusted.other":            "x",
		"SCHILY.xattr.user.ok":                  "1",
	}}})
	dst := filepath.Join(t.TempDir(), "img")
	must(t, d.ImportImage(context.Background(), src, dst, runtime.ImportOptions{}))
	p := filepath.Join(dst, "layer", "upper", "d")
	buf := make([]byte, 64)
	for name, want := range map[string]bool{"trusted.overlay.opaque": true, "user.ok": true, "trusted.overlay.redirect": false, "trusted.other": false} {
		_, err := unix.Lgetxattr(p, name, buf)
		if got := err == nil; got != want {
			t.Errorf("xattr %s present = %v, want %v", name, got, want)
		}
	}
}
