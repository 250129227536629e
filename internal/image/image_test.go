package image

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/overlayfs"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// ent is one tar entry of a test layer.
type ent struct {
	name, body, link string
	typ              byte
	mode             int64
	uid, gid         int
	xattrs           map[string]string
}

func file(name, body string) ent { return ent{name: name, body: body, typ: tar.TypeReg, mode: 0o644} }
func dir(name string) ent        { return ent{name: name, typ: tar.TypeDir, mode: 0o755} }
func symlink(name, target string) ent {
	return ent{name: name, link: target, typ: tar.TypeSymlink, mode: 0o777}
}
func hardlink(name, target string) ent { return ent{name: name, link: target, typ: tar.TypeLink} }

func tarOf(t testing.TB, ents ...ent) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range ents {
		h := &tar.Header{Name: e.name, Linkname: e.link, Typeflag: e.typ, Mode: e.mode, Uid: e.uid, Gid: e.gid,
			Size: int64(len(e.body)), ModTime: time.Unix(1700000000, 0), Format: tar.FormatPAX}
		if e.typ != tar.TypeReg {
			h.Size = 0
		}
		if e.typ == tar.TypeChar {
			h.Devmajor, h.Devminor = 1, 3
		}
		for k, v := range e.xattrs {
			if h.PAXRecords == nil {
				h.PAXRecords = map[string]string{}
			}
			h.PAXRecords["SCHILY.xattr."+k] = v
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Size > 0 {
			tw.Write([]byte(e.body))
		}
	}
	tw.Close()
	return buf.Bytes()
}

func layerOf(t testing.TB, ents ...ent) v1.Layer {
	t.Helper()
	data := tarOf(t, ents...)
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil })
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// snapshot lists a directory tree with contents, to prove nothing changed.
func snapshot(t *testing.T, root string) string {
	t.Helper()
	var out []string
	filepath.Walk(root, func(p string, info os.FileInfo, err error) error {
		if err != nil {
			return nil
		}
		rel, _ := filepath.Rel(root, p)
		line := rel + " " + info.Mode().String()
		if info.Mode().IsRegular() {
			b, _ := os.ReadFile(p)
			line += " " + string(b)
		}
		out = append(out, line)
		return nil
	})
	sort.Strings(out)
	return strings.Join(out, "\n")
}

func TestUnpackHostile(t *testing.T) {
	testutil.RequireRoot(t)
	for _, tc := range []struct {
		name    string
		ents    func(sentinel string) []ent
		wantErr bool
	}{
		{"dotdot", func(string) []ent { return []ent{file("../escape", "x")} }, true},
		{"dotdot inside", func(string) []ent { return []ent{dir("a"), file("a/../../escape", "x")} }, true},
		{"absolute", func(s string) []ent { return []ent{file(s+"/abs", "x")} }, true},
		{"symlink escape then write", func(s string) []ent { return []ent{symlink("l", s), file("l/evil", "x")} }, true},
		{"relative symlink escape", func(string) []ent { return []ent{symlink("l", "../../../../.."), file("l/evil", "x")} }, true},
		{"symlink overwritten by file", func(s string) []ent { return []ent{symlink("f", s+"/keep"), file("f", "x")} }, false},
		{"symlink overwritten by dir", func(s string) []ent { return []ent{symlink("d", s), dir("d"), file("d/keep", "x")} }, false},
		{"hard link outside", func(string) []ent { return []ent{hardlink("h", "../outside")} }, true},
		{"hard link absolute", func(s string) []ent { return []ent{hardlink("h", s+"/keep")} }, true},
		{"hard link through symlink", func(s string) []ent { return []ent{symlink("s", s), hardlink("h", "s/keep")} }, true},
		{"device node", func(string) []ent { return []ent{{name: "dev/null", typ: tar.TypeChar, mode: 0o666}, file("ok", "x")} }, false},
		{"block device", func(string) []ent { return []ent{{name: "sda", typ: tar.TypeBlock, mode: 0o666}} }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			base := t.TempDir()
			sentinel := filepath.Join(base, "sentinel")
			os.MkdirAll(sentinel, 0o755)
			os.WriteFile(filepath.Join(sentinel, "keep"), []byte("original"), 0o644)
			root := filepath.Join(base, "a", "b", "root")
			os.MkdirAll(root, 0o755)
			before := snapshot(t, sentinel)
			var logs []string
			meta, err := Unpack(context.Background(), bytes.NewReader(tarOf(t, tc.ents(sentinel)...)), root, Limits{}, func(s string) { logs = append(logs, s) })
			if (err != nil) != tc.wantErr {
				t.Fatalf("err = %v, want error %v", err, tc.wantErr)
			}
			if err != nil && !errors.Is(err, errdefs.ErrInvalid) {
				t.Errorf("error %v is not ErrInvalid", err)
			}
			if got := snapshot(t, sentinel); got != before {
				t.Fatalf("sentinel changed:\n%s\nwas\n%s", got, before)
			}
			for _, p := range []string{filepath.Join(base, "escape"), filepath.Join(base, "a", "escape"), filepath.Join(base, "a", "b", "escape"), filepath.Join(base, "a", "b", "outside"), "/evil", "/escape"} {
				if _, err := os.Lstat(p); err == nil {
					t.Fatalf("%s was written", p)
				}
			}
			if strings.Contains(tc.name, "device") || strings.Contains(tc.name, "block") {
				if len(meta.Skipped) != 1 || len(logs) != 1 {
					t.Fatalf("skipped %v, logs %v", meta.Skipped, logs)
				}
				if _, err := os.Lstat(filepath.Join(root, meta.Skipped[0])); err == nil {
					t.Fatal("device node was created")
				}
			}
		})
	}
}

// TestComposeDoesNotFollowSymlinks: a lower layer's symlink to a host directory, then an
// upper layer's whiteout and opaque directory below that name, must not touch the host.
func TestComposeDoesNotFollowSymlinks(t *testing.T) {
	testutil.RequireRoot(t)
	base := t.TempDir()
	sentinel := filepath.Join(base, "sentinel")
	os.MkdirAll(sentinel, 0o755)
	os.WriteFile(filepath.Join(sentinel, "keep"), []byte("original"), 0o644)
	before := snapshot(t, sentinel)
	st := &Store{Root: filepath.Join(base, "layers")}
	l1 := mustLayer(t, st, layerOf(t, symlink("etc", sentinel), symlink("opq", sentinel)))
	l2 := mustLayer(t, st, layerOf(t, file("etc/.wh.keep", ""), file("opq/.wh..wh..opq", "")))
	top := filepath.Join(base, "top")
	os.Mkdir(top, 0o755)
	stack, _, err := Compose(context.Background(), top, []LayerDir{l1, l2})
	if err != nil {
		t.Fatal(err)
	}
	err = stack.Edit(context.Background(), func(tr *Tree) error {
		if err := tr.WriteFile("etc/new", []byte("x"), 0o644, 0, 0); err != nil {
			return err
		}
		return tr.MkdirAll("opq/d", 0o755, 0, 0)
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := snapshot(t, sentinel); got != before {
		t.Fatalf("sentinel changed:\n%s", got)
	}
	for _, p := range []string{"etc/new", "opq/d"} {
		if _, err := os.Lstat(filepath.Join(top, p)); err != nil {
			t.Errorf("edit of %s did not land in the top layer: %v", p, err)
		}
	}
}

func mustLayer(t *testing.T, st *Store, l v1.Layer) LayerDir {
	t.Helper()
	ld, err := st.Layer(context.Background(), l, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	return ld
}

func TestComposeWhiteoutsOpaqueAttrs(t *testing.T) {
	testutil.RequireRoot(t)
	base := t.TempDir()
	st := &Store{Root: filepath.Join(base, "layers")}
	suid := file("bin/tool", "tool")
	suid.mode, suid.uid, suid.gid = 0o4755, 123, 456
	suid.xattrs = map[string]string{"user.origin": "layer1", "trusted.overlay.opaque": "y"}
	private := dir("private")
	private.mode, private.uid = 0o700, 1000
	l1 := mustLayer(t, st, layerOf(t,
		dir("a"), file("a/1", "one"), file("a/2", "two"), dir("b"), file("b/x", "x"), dir("c"), file("c/y", "y"),
		dir("bin"), suid, hardlink("bin/tool-link", "bin/tool"), symlink("bin/sym", "tool"), private,
		ent{name: "fifo", typ: tar.TypeFifo, mode: 0o600}, file("replaced", "old"), symlink("lib", "usr/lib")))
	l2 := mustLayer(t, st, layerOf(t,
		file("a/.wh.1", ""), file(".wh.b", ""), file("c/.wh..wh..opq", ""), file("c/z", "z"), file("replaced", "new"),
		hardlink("a/link-to-lower", "a/2"), dir("lib"), file("lib/libx.so", "x")))
	top := filepath.Join(base, "top")
	os.Mkdir(top, 0o755)
	stack, cs, err := Compose(context.Background(), top, []LayerDir{l1, l2})
	if err != nil {
		t.Fatal(err)
	}
	if cs.Links != 1 {
		t.Errorf("links into lower layers made: %d, want 1", cs.Links)
	}
	dest := filepath.Join(base, "merged")
	os.Mkdir(dest, 0o755)
	if err := overlayfs.Mount(dest, stack.Dirs(), "", ""); err != nil {
		t.Fatal(err)
	}
	defer overlayfs.Unmount(dest)
	exists := func(p string) bool { _, err := os.Lstat(filepath.Join(dest, p)); return err == nil }
	for p, want := range map[string]bool{"a/1": false, "a/2": true, "b": false, "b/x": false, "c/y": false, "c/z": true, "lib/libx.so": true} {
		if exists(p) != want {
			t.Errorf("%s exists = %v, want %v", p, !want, want)
		}
	}
	if b, _ := os.ReadFile(filepath.Join(dest, "replaced")); string(b) != "new" {
		t.Errorf("replaced = %q", b)
	}
	var fi syscall.Stat_t
	syscall.Lstat(filepath.Join(dest, "bin/tool"), &fi)
	if fi.Mode&0o7777 != 0o4755 || fi.Uid != 123 || fi.Gid != 456 {
		t.Errorf("bin/tool mode %o uid %d gid %d", fi.Mode&0o7777, fi.Uid, fi.Gid)
	}
	var li syscall.Stat_t
	syscall.Lstat(filepath.Join(dest, "bin/tool-link"), &li)
	if li.Ino != fi.Ino {
		t.Error("hard link lost")
	}
	var lay syscall.Stat_t
	syscall.Lstat(filepath.Join(l1.RootDir(), "bin/tool"), &lay)
	if lay.Ino != fi.Ino {
		t.Error("merged file is not the layer's inode")
	}
	var ab, lo syscall.Stat_t
	syscall.Lstat(filepath.Join(dest, "a/link-to-lower"), &lo)
	syscall.Lstat(filepath.Join(dest, "a/2"), &ab)
	if lo.Ino != ab.Ino {
		t.Error("cross-layer hard link not resolved")
	}
	buf := make([]byte, 64)
	if n, err := syscall.Getxattr(filepath.Join(dest, "bin/tool"), "user.origin", buf); err != nil || string(buf[:n]) != "layer1" {
		t.Errorf("xattr user.origin: %q %v", buf[:n], err)
	}
	if _, err := syscall.Getxattr(filepath.Join(l1.RootDir(), "bin/tool"), "trusted.overlay.opaque", buf); err == nil {
		t.Error("trusted.* xattr applied")
	}
	if l, _ := os.Readlink(filepath.Join(dest, "bin/sym")); l != "tool" {
		t.Errorf("symlink = %q", l)
	}
	var pd syscall.Stat_t
	syscall.Lstat(filepath.Join(dest, "private"), &pd)
	if pd.Mode&0o7777 != 0o700 || pd.Uid != 1000 {
		t.Errorf("private dir mode %o uid %d", pd.Mode&0o7777, pd.Uid)
	}
	if fi, err := os.Lstat(filepath.Join(dest, "fifo")); err != nil || fi.Mode()&os.ModeNamedPipe == 0 {
		t.Errorf("fifo: %v %v", fi, err)
	}
	// Edits of the stack land in the top layer, never in a shared one.
	overlayfs.Unmount(dest)
	err = stack.Edit(context.Background(), func(tr *Tree) error {
		if err := tr.WriteFile("bin/tool", []byte("changed"), 0o755, 0, 0); err != nil {
			return err
		}
		return tr.WriteFile("lib/../../escape", []byte("x"), 0o644, 0, 0) // cleaned to /escape inside the tree
	})
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(l1.RootDir(), "bin/tool")); string(b) != "tool" {
		t.Fatalf("layer file written through: %q", b)
	}
	if b, _ := os.ReadFile(filepath.Join(top, "bin/tool")); string(b) != "changed" {
		t.Fatalf("edit not in the top layer: %q", b)
	}
	if _, err := os.Lstat(filepath.Join(base, "escape")); err == nil {
		t.Fatal("tree write escaped")
	}
}

// TestUnpackOverlayFormat: a layer directory holds its whiteouts and opaque directories in
// overlayfs's format, and the store re-unpacks a directory of an older format.
func TestUnpackOverlayFormat(t *testing.T) {
	testutil.RequireRoot(t)
	base := t.TempDir()
	st := &Store{Root: filepath.Join(base, "layers")}
	l := layerOf(t, file("a/.wh.gone", ""), file("c/.wh..wh..opq", ""), file("c/z", "z"), file(".wh.d", ""), dir("d"), file("d/x", "x"))
	ld := mustLayer(t, st, l)
	var wh unix.Stat_t
	if err := unix.Lstat(filepath.Join(ld.RootDir(), "a/gone"), &wh); err != nil || !overlayfs.IsWhiteout(&wh) {
		t.Errorf("a/gone: %v, mode %o rdev %d: not an overlay whiteout", err, wh.Mode, wh.Rdev)
	}
	for _, d := range []string{"c", "d"} { // d: the layer's own directory over its whiteout
		buf := make([]byte, 4)
		if n, err := unix.Lgetxattr(filepath.Join(ld.RootDir(), d), overlayfs.OpaqueXattr, buf); err != nil || string(buf[:n]) != "y" {
			t.Errorf("%s: opaque xattr %q, %v", d, buf[:n], err)
		}
	}
	if _, err := os.Lstat(filepath.Join(ld.RootDir(), ".wh.d")); err == nil {
		t.Error("whiteout file written as a file")
	}
	// An older format's directory (whiteouts only in meta.json) is unpacked again.
	os.WriteFile(filepath.Join(ld.Dir, metaFile), []byte(`{"whiteouts":["a/gone"],"bytes":2,"entries":6}`), 0o600)
	os.Remove(filepath.Join(ld.RootDir(), "a/gone"))
	again := mustLayer(t, st, l)
	if again.Written == 0 || again.Meta.Format != LayerFormat {
		t.Fatalf("old-format layer reused: written %d, format %d", again.Written, again.Meta.Format)
	}
	if err := unix.Lstat(filepath.Join(again.RootDir(), "a/gone"), &wh); err != nil || !overlayfs.IsWhiteout(&wh) {
		t.Errorf("re-unpacked a/gone: %v", err)
	}
}

// TestStoreGC: layers that nothing keeps are removed, kept and held ones stay.
func TestStoreGC(t *testing.T) {
	testutil.RequireRoot(t)
	base := t.TempDir()
	st := &Store{Root: filepath.Join(base, "layers")}
	kept := mustLayer(t, st, layerOf(t, file("kept", "k")))
	gone := mustLayer(t, st, layerOf(t, file("gone", "g")))
	held := mustLayer(t, st, layerOf(t, file("held", "h")))
	st.Release([]LayerDir{kept, gone}, false)
	removed, err := st.GC([]string{kept.RootDir()})
	if err != nil {
		t.Fatal(err)
	}
	if len(removed) != 1 || removed[0] != gone.Digest {
		t.Errorf("removed %v, want [%s]", removed, gone.Digest)
	}
	for _, c := range []struct {
		l    LayerDir
		want bool
	}{{kept, true}, {gone, false}, {held, true}} {
		if _, err := os.Stat(c.l.Dir); (err == nil) != c.want {
			t.Errorf("%s present = %v, want %v", c.l.Dir, err == nil, c.want)
		}
	}
	st.Release([]LayerDir{held}, false)
	if removed, _ := st.GC(nil); len(removed) != 2 {
		t.Errorf("second GC removed %v", removed)
	}
}

func TestStoreSharesAndLimits(t *testing.T) {
	testutil.RequireRoot(t)
	base := t.TempDir()
	st := &Store{Root: filepath.Join(base, "layers")}
	big := layerOf(t, file("big", strings.Repeat("x", 1<<20)))
	var wg sync.WaitGroup
	results := make([]LayerDir, 4)
	errs := make([]error, 4)
	for i := range results {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i], errs[i] = st.Layer(context.Background(), big, nil, nil)
		}()
	}
	wg.Wait()
	written := 0
	for i, r := range results {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		if r.Written > 0 {
			written++
		}
	}
	if written != 1 {
		t.Fatalf("%d of 4 concurrent calls unpacked the layer, want 1", written)
	}

	lim := &Store{Root: filepath.Join(base, "limited"), MaxLayerBytes: 1000}
	_, err := lim.Layer(context.Background(), big, nil, nil)
	if !errors.Is(err, errdefs.ErrExhausted) || !strings.Contains(err.Error(), "limit") {
		t.Fatalf("over-limit layer: %v", err)
	}
	if e, _ := os.ReadDir(lim.Root); len(e) != 0 {
		t.Fatalf("left behind: %v", e)
	}
	budget := int64(4000)
	imgLim := &Store{Root: filepath.Join(base, "img"), MaxImageBytes: 4000}
	_, err = imgLim.Layer(context.Background(), big, &budget, nil)
	if !errors.Is(err, errdefs.ErrExhausted) || !strings.Contains(err.Error(), "image") {
		t.Fatalf("over-limit image: %v", err)
	}
	// A corrupt layer (content not matching its diff id) is refused.
	bad := badDiff{layerOf(t, file("a", "a"))}
	if _, err := st.Layer(context.Background(), bad, nil, nil); !errors.Is(err, errdefs.ErrCorrupt) {
		t.Fatalf("corrupt layer: %v", err)
	}
}

type badDiff struct{ v1.Layer }

func (badDiff) DiffID() (v1.Hash, error) {
	return v1.NewHash("sha256:" + strings.Repeat("ab", 32))
}

// localRegistry serves an in-process registry and pushes imgs to it by repo:tag.
func localRegistry(t *testing.T, imgs map[string]v1.Image) string {
	t.Helper()
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	t.Cleanup(srv.Close)
	host := strings.TrimPrefix(srv.URL, "http://")
	for ref, img := range imgs {
		r, err := name.ParseReference(host + "/" + ref)
		if err != nil {
			t.Fatal(err)
		}
		if err := remote.Write(r, img); err != nil {
			t.Fatal(err)
		}
	}
	return host
}

func testImage(t *testing.T, cfg v1.Config, layers ...v1.Layer) v1.Image {
	t.Helper()
	img, err := mutate.AppendLayers(empty.Image, layers...)
	if err != nil {
		t.Fatal(err)
	}
	cf, _ := img.ConfigFile()
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture, cf.Config = "linux", "amd64", cfg
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

func TestPullAndConfig(t *testing.T) {
	img := testImage(t, v1.Config{Env: []string{"PATH=/usr/bin:/bin", "APP=yes"}, WorkingDir: "/app", User: "app", Entrypoint: []string{"python3", "-m"}, Cmd: []string{"http.server", "8080"}},
		layerOf(t, file("hello", "hi")))
	host := localRegistry(t, map[string]v1.Image{"team/app:v1": img})
	r := &Resolver{Aliases: map[string]string{"app": host + "/team/app:v1"}, Allow: []string{host}}
	got, err := r.Pull(context.Background(), r.Resolve("app"), true, nil)
	if err != nil {
		t.Fatal(err)
	}
	layers, cf, err := Layers(got, 0)
	if err != nil || len(layers) != 1 {
		t.Fatalf("layers %d %v", len(layers), err)
	}
	d := ConfigDefaults(cf)
	if d.Env["APP"] != "yes" || d.Workdir != "/app" || d.User != "app" || d.StartCmd != "python3 -m http.server 8080" {
		t.Fatalf("defaults %+v", d)
	}
	if _, err := r.Pull(context.Background(), host+"/team/missing:v1", true, nil); !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), host) {
		t.Fatalf("missing image: %v", err)
	}
	if got := (&Resolver{}).Resolve("e2bdev/base"); got != "template:base" {
		t.Fatalf("e2bdev/base resolves to %q", got)
	}
	if got := (&Resolver{}).Resolve("e2bdev/base:latest"); got != "template:base" {
		t.Fatalf("e2bdev/base:latest resolves to %q", got)
	}
	if got := (&Resolver{Aliases: map[string]string{"e2bdev/base": "mirror/base:1"}}).Resolve("e2bdev/base"); got != "mirror/base:1" {
		t.Fatalf("override resolves to %q", got)
	}
	// A mirror stands in for the image's registry.
	mr := &Resolver{Mirrors: map[string]string{"index.docker.io": host}}
	if _, err := mr.Pull(context.Background(), "team/app:v1", true, nil); err != nil {
		t.Fatalf("pull through mirror: %v", err)
	}
}

func TestUnreachableRegistry(t *testing.T) {
	r := &Resolver{Allow: []string{"127.0.0.1:1"}}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_, err := r.Pull(ctx, "127.0.0.1:1/nothing:v1", true, nil)
	if !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "127.0.0.1:1") {
		t.Fatalf("unreachable registry: %v", err)
	}
}

func TestArchives(t *testing.T) {
	img := testImage(t, v1.Config{WorkingDir: "/w"}, layerOf(t, file("x", "y")))
	dir := t.TempDir()
	docker := filepath.Join(dir, "docker.tar")
	tag, _ := name.NewTag("example/app:v1")
	if err := tarball.WriteToFile(docker, tag, img); err != nil {
		t.Fatal(err)
	}
	lay := filepath.Join(dir, "layout")
	p, err := layout.Write(lay, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.AppendImage(img); err != nil {
		t.Fatal(err)
	}
	oci := filepath.Join(dir, "oci.tar")
	tarDir(t, lay, oci)
	want, _ := img.Digest()
	for _, f := range []string{docker, oci} {
		got, err := OpenArchive(f, filepath.Join(dir, "scratch-"+filepath.Base(f)))
		if err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		cf, err := got.ConfigFile()
		if err != nil || cf.Config.WorkingDir != "/w" {
			t.Fatalf("%s: config %v %v", f, cf, err)
		}
		if d, _ := got.Digest(); filepath.Base(f) == "oci.tar" && d != want {
			t.Fatalf("digest %s want %s", d, want)
		}
	}
	notTar := filepath.Join(dir, "not.tar")
	os.WriteFile(notTar, []byte("hello"), 0o644)
	if _, err := OpenArchive(notTar, filepath.Join(dir, "s3")); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("not an archive: %v", err)
	}
	if _, err := OpenArchive(filepath.Join(dir, "missing.tar"), filepath.Join(dir, "s4")); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("missing archive: %v", err)
	}
}

func tarDir(t *testing.T, src, dst string) {
	t.Helper()
	f, err := os.Create(dst)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	tw := tar.NewWriter(f)
	defer tw.Close()
	filepath.Walk(src, func(p string, info os.FileInfo, err error) error {
		rel, _ := filepath.Rel(src, p)
		if rel == "." || err != nil {
			return err
		}
		h, _ := tar.FileInfoHeader(info, "")
		h.Name = rel
		tw.WriteHeader(h)
		if info.Mode().IsRegular() {
			b, _ := os.ReadFile(p)
			tw.Write(b)
		}
		return nil
	})
}

// TestWhiteoutOfDotDot: a whiteout named `.wh...` (target `..`) must not remove the directory
// above the tree: refused when unpacked, and refused by Compose if it ever got into a Meta.
func TestWhiteoutOfDotDot(t *testing.T) {
	testutil.RequireRoot(t)
	for _, name := range []string{".wh...", "a/.wh...", ".wh..", "a/.wh."} {
		t.Run(name, func(t *testing.T) {
			root := t.TempDir()
			_, err := Unpack(context.Background(), bytes.NewReader(tarOf(t, dir("a"), file(name, ""))), root, Limits{}, nil)
			if !errors.Is(err, errdefs.ErrInvalid) {
				t.Fatalf("unpack %s: %v", name, err)
			}
		})
	}
	for _, w := range []string{"..", "a/..", ".", "", "a/../.."} {
		t.Run("compose "+w, func(t *testing.T) {
			base := t.TempDir()
			sibling := filepath.Join(base, "sibling")
			os.WriteFile(sibling, []byte("keep"), 0o644)
			dest := filepath.Join(base, "rootfs")
			os.MkdirAll(filepath.Join(dest, "a"), 0o755)
			empty := filepath.Join(base, "layer")
			os.MkdirAll(filepath.Join(empty, "root"), 0o755)
			_, _, err := Compose(context.Background(), dest, []LayerDir{{Digest: "sha256:00", Dir: empty, Meta: Meta{Whiteouts: []string{w}}}})
			if !errors.Is(err, errdefs.ErrInvalid) {
				t.Fatalf("compose whiteout %q: %v", w, err)
			}
			if b, _ := os.ReadFile(sibling); string(b) != "keep" {
				t.Fatal("a file beside the tree was removed")
			}
		})
	}
}

// TestRegistryCredentials: a registry that wants a password gets the build request's
// credentials, else those of ~/.docker/config.json ($DOCKER_CONFIG); none or wrong ones are
// ErrUnauthorized naming the registry.
func TestRegistryCredentials(t *testing.T) {
	reg := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if u, p, ok := r.BasicAuth(); !ok || u != "alice" || p != "s3cret" {
			w.Header().Set("WWW-Authenticate", `Basic realm="test"`)
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		reg.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	host := strings.TrimPrefix(srv.URL, "http://")
	ref := host + "/team/private:v1"
	r, _ := name.ParseReference(ref)
	if err := remote.Write(r, testImage(t, v1.Config{}, layerOf(t, file("x", "y"))), remote.WithAuth(&authn.Basic{Username: "alice", Password: "s3cret"})); err != nil {
		t.Fatal(err)
	}
	t.Setenv("DOCKER_CONFIG", t.TempDir())
	res := &Resolver{Allow: []string{host}}
	ctx := context.Background()
	if _, err := res.Pull(ctx, ref, true, nil); !errors.Is(err, errdefs.ErrUnauthorized) || !strings.Contains(err.Error(), host) {
		t.Fatalf("no credentials: %v", err)
	}
	if _, err := res.Pull(ctx, ref, true, &Auth{Username: "alice", Password: "wrong"}); !errors.Is(err, errdefs.ErrUnauthorized) {
		t.Fatalf("wrong credentials: %v", err)
	}
	if _, err := res.Pull(ctx, ref, true, &Auth{Username: "alice", Password: "s3cret"}); err != nil {
		t.Fatalf("request credentials: %v", err)
	}
	cfg := fmt.Sprintf(`{"auths":{%q:{"auth":%q}}}`, host, base64.StdEncoding.EncodeToString([]byte("alice:s3cret")))
	os.WriteFile(filepath.Join(os.Getenv("DOCKER_CONFIG"), "config.json"), []byte(cfg), 0o600)
	if _, err := res.Pull(ctx, ref, true, nil); err != nil {
		t.Fatalf("docker config credentials: %v", err)
	}
}
