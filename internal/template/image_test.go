package template

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"log"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/image"
	"github.com/ember-sandbox/ember/internal/overlayfs"
	"github.com/ember-sandbox/ember/internal/testutil"
)

type tfile struct {
	name, body, link string
	typ              byte
	mode             int64
}

func layer(t *testing.T, files ...tfile) v1.Layer {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, f := range files {
		h := &tar.Header{Name: f.name, Typeflag: f.typ, Mode: f.mode, Linkname: f.link, Size: int64(len(f.body)), ModTime: time.Unix(1700000000, 0)}
		if f.typ == 0 {
			h.Typeflag = tar.TypeReg
		}
		if h.Typeflag != tar.TypeReg {
			h.Size = 0
		}
		if h.Mode == 0 {
			h.Mode = 0o644
		}
		tw.WriteHeader(h)
		tw.Write([]byte(f.body))
	}
	tw.Close()
	data := buf.Bytes()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil })
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func pushed(t *testing.T, cfg v1.Config, layers ...v1.Layer) string {
	t.Helper()
	img, err := mutate.AppendLayers(empty.Image, layers...)
	if err != nil {
		t.Fatal(err)
	}
	cf, _ := img.ConfigFile()
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture, cf.Config = "linux", "amd64", cfg
	img, _ = mutate.ConfigFile(img, cf)
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	t.Cleanup(srv.Close)
	ref := strings.TrimPrefix(srv.URL, "http://") + "/test/img:v1"
	r, _ := name.ParseReference(ref)
	if err := remote.Write(r, img); err != nil {
		t.Fatal(err)
	}
	return ref
}

func newImageBuilder(t *testing.T) (*Builder, ImageConfig, string) {
	t.Helper()
	dir := t.TempDir()
	envd := filepath.Join(dir, "envd")
	os.WriteFile(envd, []byte("#!/bin/sh\necho envd\n"), 0o755)
	cfg := ImageConfig{Layers: &image.Store{Root: filepath.Join(dir, "layers"), MaxImageBytes: 1 << 20}, Resolver: &image.Resolver{Allow: []string{"127.0.0.1"}}} // the tests' own registries
	os.MkdirAll(filepath.Join(dir, "templates"), 0o700)
	return &Builder{EnvdPath: envd}, cfg, dir
}

// mountStack mounts a built template's stack read-only for the test to look at, as a sandbox
// sees it.
func mountStack(t *testing.T, st image.Stack) string {
	t.Helper()
	m := t.TempDir()
	if err := overlayfs.Mount(m, st.Dirs(), "", ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { overlayfs.Unmount(m) })
	return m
}

func TestBuildFromImage(t *testing.T) {
	testutil.RequireRoot(t)
	b, cfg, dir := newImageBuilder(t)
	base := layer(t,
		tfile{name: "etc/", typ: tar.TypeDir, mode: 0o755},
		tfile{name: "etc/passwd", body: "root:x:0:0:root:/root:/bin/sh\nother:x:1000:1000::/home/other:/bin/sh\n"},
		tfile{name: "etc/group", body: "root:x:0:\nother:x:1000:\n"},
		tfile{name: "etc/skel/", typ: tar.TypeDir, mode: 0o755},
		tfile{name: "etc/skel/.profile", body: "PS1=x\n"},
		tfile{name: "etc/resolv.conf", typ: tar.TypeSymlink, link: "/run/systemd/resolve/resolv.conf"},
		tfile{name: "usr/bin/sudo", body: "sudo", mode: 0o4755},
		tfile{name: "bin", typ: tar.TypeSymlink, link: "usr/bin"},
		tfile{name: "usr/bin/bash", body: "bash", mode: 0o755})
	ref := pushed(t, v1.Config{Env: []string{"FOO=bar"}, WorkingDir: "/srv", Cmd: []string{"bash"}}, base)
	dest := filepath.Join(dir, "templates", "a")
	var lines []string
	defs, stack, err := b.BuildFromImage(context.Background(), cfg, ImageSource{Ref: ref, Insecure: true}, dest, func(s string) { lines = append(lines, s) })
	if err != nil {
		t.Fatal(err)
	}
	if stack.Top != dest || len(stack.Lowers) != 1 {
		t.Fatalf("stack %+v", stack)
	}
	// The top layer holds ember's files only: the image's stay in the shared layer.
	if _, err := os.Lstat(filepath.Join(dest, "usr/bin/bash")); err == nil {
		t.Fatal("an image file was copied into the template's own layer")
	}
	top := dest
	dest = mountStack(t, stack)
	if defs.Env["FOO"] != "bar" || defs.Workdir != "/srv" || defs.StartCmd != "" {
		t.Fatalf("defaults %+v", defs)
	}
	passwd, _ := os.ReadFile(filepath.Join(dest, "etc/passwd"))
	if !strings.Contains(string(passwd), "user:x:1001:1001::/home/user:/bin/bash") {
		t.Fatalf("passwd:\n%s", passwd)
	}
	if s, _ := os.ReadFile(filepath.Join(dest, "etc/sudoers.d/user")); !strings.Contains(string(s), "NOPASSWD") {
		t.Fatal("no sudoers entry")
	}
	var st syscall.Stat_t
	if err := syscall.Stat(filepath.Join(dest, "home/user/.profile"), &st); err != nil || st.Uid != 1001 {
		t.Fatalf("home: %v uid %d", err, st.Uid)
	}
	if fi, err := os.Lstat(filepath.Join(dest, "etc/resolv.conf")); err != nil || !fi.Mode().IsRegular() {
		t.Fatalf("resolv.conf: %v %v", fi, err)
	}
	// The shared layer's files were replaced, not written through.
	layers, _ := filepath.Glob(filepath.Join(cfg.Layers.Root, "sha256-*", "root", "etc", "passwd"))
	if len(layers) != 1 {
		t.Fatalf("layer dirs: %v", layers)
	}
	if lp, _ := os.ReadFile(layers[0]); strings.Contains(string(lp), "user:") {
		t.Fatal("layer's /etc/passwd was modified")
	}
	var e1, e2 syscall.Stat_t
	syscall.Stat(filepath.Join(top, EnvdInRootFS), &e1)
	envds, _ := filepath.Glob(filepath.Join(cfg.Layers.Root, "envd-sha256-*"))
	if len(envds) != 1 {
		t.Fatalf("envd store: %v", envds)
	}
	syscall.Stat(envds[0], &e2)
	if e1.Ino != e2.Ino {
		t.Fatal("envd is not shared")
	}
	// A second template on the same image shares every layer.
	lines = nil
	if _, _, err := b.BuildFromImage(context.Background(), cfg, ImageSource{Ref: ref, Insecure: true}, filepath.Join(dir, "templates", "b"), func(s string) { lines = append(lines, s) }); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(strings.Join(lines, "\n"), "already on this node") {
		t.Fatalf("second build did not share: %v", lines)
	}
}

// TestFailedBuildKeepsSharedLayers: a failed build takes back only what it unpacked.
func TestFailedBuildKeepsSharedLayers(t *testing.T) {
	testutil.RequireRoot(t)
	b, cfg, dir := newImageBuilder(t)
	shared := layer(t, tfile{name: "shared", body: "s"})
	good := pushed(t, v1.Config{}, shared)
	_, goodStack, err := b.BuildFromImage(context.Background(), cfg, ImageSource{Ref: good, Insecure: true}, filepath.Join(dir, "templates", "good"), nil)
	if err != nil {
		t.Fatal(err)
	}
	bad := pushed(t, v1.Config{}, shared, layer(t, tfile{name: "new", body: "n"}), layer(t, tfile{name: "/abs", body: "x"}))
	if _, _, err := b.BuildFromImage(context.Background(), cfg, ImageSource{Ref: bad, Insecure: true}, filepath.Join(dir, "templates", "bad"), nil); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("bad build: %v", err)
	}
	left, _ := filepath.Glob(filepath.Join(cfg.Layers.Root, "sha256-*"))
	if len(left) != 1 {
		t.Fatalf("layers after the failed build: %v (want only the shared one)", left)
	}
	if b, err := os.ReadFile(filepath.Join(mountStack(t, goodStack), "shared")); err != nil || string(b) != "s" {
		t.Fatalf("good template damaged: %q %v", b, err)
	}
}

func TestFailedImageBuildLeavesNothing(t *testing.T) {
	testutil.RequireRoot(t)
	for _, tc := range []struct {
		name   string
		layers func(t *testing.T) []v1.Layer
		want   error
	}{
		{"hostile layer", func(t *testing.T) []v1.Layer {
			return []v1.Layer{layer(t, tfile{name: "ok", body: "x"}), layer(t, tfile{name: "../../escape", body: "x"})}
		}, errdefs.ErrInvalid},
		{"over the image limit", func(t *testing.T) []v1.Layer {
			return []v1.Layer{layer(t, tfile{name: "a", body: strings.Repeat("a", 700<<10)}), layer(t, tfile{name: "b", body: strings.Repeat("b", 700<<10)})}
		}, errdefs.ErrExhausted},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, cfg, dir := newImageBuilder(t)
			ref := pushed(t, v1.Config{}, tc.layers(t)...)
			dest := filepath.Join(dir, "templates", "x")
			_, _, err := b.BuildFromImage(context.Background(), cfg, ImageSource{Ref: ref, Insecure: true}, dest, nil)
			if !errors.Is(err, tc.want) {
				t.Fatalf("err = %v, want %v", err, tc.want)
			}
			if e, _ := os.ReadDir(filepath.Join(dir, "templates")); len(e) != 0 {
				t.Fatalf("left in templates: %v", e)
			}
			left, _ := filepath.Glob(filepath.Join(cfg.Layers.Root, ".tmp-*"))
			if len(left) != 0 {
				t.Fatalf("temporary layer dirs left: %v", left)
			}
			if left, _ := filepath.Glob(filepath.Join(cfg.Layers.Root, "sha256-*")); len(left) != 0 {
				t.Fatalf("the failed build left layers it unpacked: %v", left)
			}
			if _, err := os.Lstat(filepath.Join(dir, "escape")); err == nil {
				t.Fatal("escaped")
			}
		})
	}
}

func TestBuildDebianSharesTheBaseLayer(t *testing.T) {
	testutil.RequireRoot(t)
	_, cfg, dir := newImageBuilder(t)
	b := &Builder{CacheDir: filepath.Join(dir, "cache"), EnvdPath: filepath.Join(dir, "envd"), Suite: "bookworm", Mirror: "http://example.invalid/debian"}
	os.MkdirAll(b.CacheDir, 0o755)
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range []tfile{
		{name: "./", typ: tar.TypeDir, mode: 0o755},
		{name: "./etc/", typ: tar.TypeDir, mode: 0o755},
		{name: "./etc/passwd", body: "root:x:0:0:root:/root:/bin/bash\n"},
		{name: "./etc/group", body: "root:x:0:\nsudo:x:27:\n"},
		{name: "./etc/shadow", body: "root:*:19000:0:99999:7:::\n", mode: 0o640},
		{name: "./etc/skel/", typ: tar.TypeDir, mode: 0o755},
		{name: "./etc/skel/.bashrc", body: "# bashrc\n"},
		{name: "./etc/sudoers.d/", typ: tar.TypeDir, mode: 0o755},
		{name: "./usr/bin/bash", body: "bash", mode: 0o755},
		{name: "./usr/bin/sudo", body: "sudo", mode: 0o4755},
		{name: "./dev/null", typ: tar.TypeChar, mode: 0o666},
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
	tarball := filepath.Join(b.CacheDir, "debootstrap-bookworm-"+b.cacheKey()+".tar")
	os.WriteFile(tarball, buf.Bytes(), 0o644)
	var lines []string
	merged := map[string]string{}
	for _, name := range []string{"base", "other"} {
		stack, err := b.BuildDebian(context.Background(), cfg, filepath.Join(dir, "templates", name), func(s string) { lines = append(lines, s) })
		if err != nil {
			t.Fatal(err)
		}
		dest := mountStack(t, stack)
		merged[name] = dest
		passwd, _ := os.ReadFile(filepath.Join(dest, "etc/passwd"))
		if !strings.Contains(string(passwd), "user:x:1000:1000::/home/user:/bin/bash") {
			t.Fatalf("%s passwd:\n%s", name, passwd)
		}
		shadow, _ := os.ReadFile(filepath.Join(dest, "etc/shadow"))
		if !strings.Contains(string(shadow), "user:*:") {
			t.Fatalf("%s shadow:\n%s", name, shadow)
		}
		if _, err := os.Stat(filepath.Join(dest, "home/user/.bashrc")); err != nil {
			t.Fatal(err)
		}
	}
	if !strings.Contains(strings.Join(lines, "\n"), "already on this node") {
		t.Fatalf("second build did not share the layer: %v", lines)
	}
	var a, o syscall.Stat_t
	syscall.Stat(filepath.Join(merged["base"], "usr/bin/bash"), &a)
	syscall.Stat(filepath.Join(merged["other"], "usr/bin/bash"), &o)
	if a.Ino != o.Ino {
		t.Fatal("templates do not share the layer's files")
	}
	if a.Mode&0o777 != 0o755 {
		t.Fatalf("bash mode %o", a.Mode)
	}
}

func TestUserName(t *testing.T) {
	root := t.TempDir()
	os.MkdirAll(filepath.Join(root, "etc"), 0o755)
	os.WriteFile(filepath.Join(root, "etc/passwd"), []byte("root:x:0:0::/root:/bin/sh\napp:x:1234:1234::/home/app:/bin/sh\n"), 0o644)
	for _, tc := range []struct {
		in, want string
		err      bool
	}{{"", "", false}, {"app", "app", false}, {"1234", "app", false}, {"app:app", "app", false}, {"0:0", "root", false}, {"4321", "", true}, {"ghost", "", true}} {
		tr, err := image.OpenTree(root)
		if err != nil {
			t.Fatal(err)
		}
		got, err := userName(tr, tc.in)
		tr.Close()
		if got != tc.want || (err != nil) != tc.err {
			t.Errorf("userName(%q) = %q, %v; want %q (error %v)", tc.in, got, err, tc.want, tc.err)
		}
	}
}

// TestConcurrentBuildsShareOneUnpack: builds of different images on one base, at once, unpack
// the base once and both get a complete rootfs.
func TestConcurrentBuildsShareOneUnpack(t *testing.T) {
	testutil.RequireRoot(t)
	b, cfg, dir := newImageBuilder(t)
	files := []tfile{{name: "etc/", typ: tar.TypeDir, mode: 0o755}, {name: "etc/passwd", body: "root:x:0:0::/root:/bin/sh\n"}}
	for i := 0; i < 200; i++ {
		files = append(files, tfile{name: "usr/share/f" + strings.Repeat("x", i%7) + string(rune('a'+i%26)) + strconv.Itoa(i), body: strings.Repeat("b", 1000)})
	}
	base := layer(t, files...)
	refs := []string{pushed(t, v1.Config{}, base, layer(t, tfile{name: "one", body: "1"})), pushed(t, v1.Config{}, base, layer(t, tfile{name: "two", body: "2"}))}
	errs := make(chan error, 2)
	var mu sync.Mutex
	var lines []string
	stacks := make([]image.Stack, len(refs))
	for i, ref := range refs {
		go func() {
			var err error
			_, stacks[i], err = b.BuildFromImage(context.Background(), cfg, ImageSource{Ref: ref, Insecure: true}, filepath.Join(dir, "templates", strconv.Itoa(i)), func(s string) {
				mu.Lock()
				lines = append(lines, s)
				mu.Unlock()
			})
			errs <- err
		}()
	}
	for range refs {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	unpacked := strings.Count(strings.Join(lines, "\n"), "in 202 entries")
	if unpacked != 1 {
		t.Fatalf("base unpacked %d times:\n%s", unpacked, strings.Join(lines, "\n"))
	}
	for i := range refs {
		if e, _ := os.ReadDir(filepath.Join(mountStack(t, stacks[i]), "usr/share")); len(e) != 200 {
			t.Fatalf("template %d has %d files in usr/share", i, len(e))
		}
	}
}
