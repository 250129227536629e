package e2e

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"log"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
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
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/ember-sandbox/ember/internal/testutil"
	testnode "github.com/ember-sandbox/ember/internal/testutil/node"
)

// fileLayer is an uncompressed layer read from a tar file (the debootstrap base rootfs).
type fileLayer struct {
	path string
	hash v1.Hash
	size int64
}

func newFileLayer(t *testing.T, p string) *fileLayer {
	t.Helper()
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		t.Fatal(err)
	}
	return &fileLayer{path: p, size: n, hash: v1.Hash{Algorithm: "sha256", Hex: hex.EncodeToString(h.Sum(nil))}}
}

func (l *fileLayer) Digest() (v1.Hash, error)             { return l.hash, nil }
func (l *fileLayer) DiffID() (v1.Hash, error)             { return l.hash, nil }
func (l *fileLayer) Compressed() (io.ReadCloser, error)   { return os.Open(l.path) }
func (l *fileLayer) Uncompressed() (io.ReadCloser, error) { return os.Open(l.path) }
func (l *fileLayer) Size() (int64, error)                 { return l.size, nil }
func (l *fileLayer) MediaType() (types.MediaType, error)  { return types.OCIUncompressedLayer, nil }

type memLayer struct{ b []byte }

func (l memLayer) Digest() (v1.Hash, error) {
	s := sha256.Sum256(l.b)
	return v1.Hash{Algorithm: "sha256", Hex: hex.EncodeToString(s[:])}, nil
}
func (l memLayer) DiffID() (v1.Hash, error)             { return l.Digest() }
func (l memLayer) Compressed() (io.ReadCloser, error)   { return io.NopCloser(bytes.NewReader(l.b)), nil }
func (l memLayer) Uncompressed() (io.ReadCloser, error) { return l.Compressed() }
func (l memLayer) Size() (int64, error)                 { return int64(len(l.b)), nil }
func (l memLayer) MediaType() (types.MediaType, error)  { return types.OCIUncompressedLayer, nil }

type tent struct {
	name, body string
	dir        bool
	uid        int
}

func tarLayer(t *testing.T, ents ...tent) memLayer {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range ents {
		h := &tar.Header{Name: e.name, Mode: 0o644, Typeflag: tar.TypeReg, Size: int64(len(e.body)), Uid: e.uid, Gid: e.uid, ModTime: time.Now()}
		if e.dir {
			h.Typeflag, h.Mode, h.Size = tar.TypeDir, 0o755, 0
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		tw.Write([]byte(e.body))
	}
	tw.Close()
	return memLayer{buf.Bytes()}
}

// baseFile reads one file of the debootstrap tarball.
func baseFile(t *testing.T, tarball, name string) string {
	t.Helper()
	f, err := os.Open(tarball)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if err != nil {
			t.Fatalf("%s not in %s: %v", name, tarball, err)
		}
		if strings.TrimPrefix(h.Name, "./") == name {
			b, _ := io.ReadAll(tr)
			return string(b)
		}
	}
}

func debootstrapTarball(t *testing.T) string {
	t.Helper()
	cache := testnode.CacheDir()
	m, _ := filepath.Glob(filepath.Join(cache, "debootstrap", "debootstrap-bookworm-*.tar"))
	testutil.Need(t, len(m) > 0, "no debootstrap tarball in the cache (the base template build makes it)")
	return m[0]
}

// imageRegistry runs a registry on loopback (blobs on disk) and pushes imgs.
func imageRegistry(t *testing.T, imgs map[string]v1.Image) string {
	t.Helper()
	blobs := t.TempDir()
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0)), registry.WithBlobHandler(registry.NewDiskBlobHandler(blobs))))
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

func imageOf(t *testing.T, cfg v1.Config, layers ...v1.Layer) v1.Image {
	t.Helper()
	img, err := mutate.AppendLayers(empty.Image, layers...)
	if err != nil {
		t.Fatal(err)
	}
	cf, _ := img.ConfigFile()
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture, cf.Config = "linux", "amd64", cfg
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		t.Fatal(err)
	}
	return img
}

// duBytes is the disk usage of paths counted together (each hard-linked inode once).
func duBytes(t *testing.T, paths ...string) int64 {
	t.Helper()
	seen := map[uint64]bool{}
	var total int64
	for _, p := range paths {
		filepath.Walk(p, func(_ string, info os.FileInfo, err error) error {
			if err != nil {
				return nil
			}
			st := info.Sys().(*syscall.Stat_t)
			if seen[st.Ino] {
				return nil
			}
			seen[st.Ino] = true
			total += st.Blocks * 512
			return nil
		})
	}
	return total
}

// contentBytes is the file content allocated under paths (regular files, each inode once).
func contentBytes(paths ...string) int64 {
	seen := map[uint64]bool{}
	var total int64
	for _, p := range paths {
		filepath.Walk(p, func(_ string, info os.FileInfo, err error) error {
			if err != nil || !info.Mode().IsRegular() {
				return nil
			}
			st := info.Sys().(*syscall.Stat_t)
			if !seen[st.Ino] {
				seen[st.Ino] = true
				total += st.Blocks * 512
			}
			return nil
		})
	}
	return total
}

func TestTemplateFromImage(t *testing.T) {
	d := need(t)
	tarball := debootstrapTarball(t)
	base := newFileLayer(t, tarball)
	passwd := baseFile(t, tarball, "etc/passwd") + "app:x:1234:1234::/home/app:/bin/bash\n"
	group := baseFile(t, tarball, "etc/group") + "app:x:1234:\n"
	layerA := tarLayer(t, tent{name: "etc/passwd", body: passwd}, tent{name: "etc/group", body: group},
		tent{name: "home/app/", dir: true, uid: 1234}, tent{name: "app/", dir: true}, tent{name: "etc/app-a.txt", body: "from image a\n"})
	ownB := strings.Repeat("b", 256<<10)
	layerB := tarLayer(t, tent{name: "etc/app-b.txt", body: "from image b\n"}, tent{name: "opt/b.bin", body: ownB})
	imgA := imageOf(t, v1.Config{Env: []string{"PATH=/usr/local/bin:/usr/bin:/bin", "APP_MODE=image-a"}, WorkingDir: "/app", User: "app"}, base, layerA)
	imgB := imageOf(t, v1.Config{Env: []string{"PATH=/usr/local/bin:/usr/bin:/bin", "APP_MODE=image-b"}, Cmd: []string{"bash"}}, base, layerB)
	host := imageRegistry(t, map[string]v1.Image{"test/a:v1": imgA, "test/b:v1": imgB})

	cli := func(args ...string) (string, error) {
		cmd := exec.Command(d.bin, append([]string{"--url", "http://" + d.addr}, args...)...)
		cmd.Env = append(os.Environ(), "EMBER_API_KEY="+d.key, "E2B_API_KEY="+d.key)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	t0 := time.Now()
	out, err := cli("template", "build", "img-a", "--from-image", host+"/test/a:v1", "--insecure-registry")
	if err != nil {
		t.Fatalf("build img-a: %v\n%s\n%s", err, out, d.logs())
	}
	t.Logf("img-a built in %s", time.Since(t0).Round(time.Millisecond))
	if !strings.Contains(out, "layer "+base.hash.Hex[:12]) || !strings.Contains(out, "/s)") {
		t.Errorf("no layer progress lines:\n%s", out)
	}
	t.Cleanup(func() { d.api(t, "DELETE", "/templates/img-a", nil, nil) })

	layers := filepath.Join(d.dataDir, "layers")
	duBefore, contentBefore := duBytes(t, layers), contentBytes(layers)
	out, err = cli("template", "build", "img-b", "--from-image", host+"/test/b:v1")
	if err != nil {
		t.Fatalf("build img-b: %v\n%s\n%s", err, out, d.logs())
	}
	t.Cleanup(func() { d.api(t, "DELETE", "/templates/img-b", nil, nil) })
	t.Logf("ember template build img-b (piped):\n%s", out)
	if !strings.Contains(out, "already on this node") {
		t.Errorf("img-b did not reuse the base layer:\n%s", out)
	}
	rootB, _ := filepath.Glob(filepath.Join(d.dataDir, "templates", "img-b", "rootfs-*"))
	if len(rootB) != 1 {
		t.Fatalf("img-b rootfs: %v", rootB)
	}
	own := int64(len(layerB.b))
	content := contentBytes(layers, rootB[0]) - contentBefore
	disk := duBytes(t, layers, rootB[0]) - duBefore
	t.Logf("second template: own layer %d bytes; new file content %d bytes; disk incl. directories and metadata %d bytes", own, content, disk)
	if content > own+1<<20 {
		t.Errorf("second template wrote %d bytes of files, more than its own layer (%d) + 1 MiB", content, own)
	}
	if disk > own+1<<20 {
		t.Errorf("second template took %d bytes of disk with directories and metadata, more than its own layer (%d) + 1 MiB", disk, own)
	}

	a := d.create(t, map[string]any{"templateID": "img-a"})
	r := d.run(t, a, `echo "$APP_MODE"; pwd; whoami; cat /etc/app-a.txt`)
	if want := "image-a\n/app\napp\nfrom image a\n"; r.stdout != want || r.exitCode != 0 {
		t.Errorf("img-a sandbox: %q (stderr %q, exit %d), want %q", r.stdout, r.stderr, r.exitCode, want)
	}
	b := d.create(t, map[string]any{"templateID": "img-b"})
	r = d.run(t, b, `echo "$APP_MODE"; pwd; whoami; id -u; cat /etc/app-b.txt; test -e /etc/app-a.txt || echo no-a; sudo -n true && echo sudo-ok`)
	if want := "image-b\n/home/user\nuser\n1000\nfrom image b\nno-a\nsudo-ok\n"; r.stdout != want || r.exitCode != 0 {
		t.Errorf("img-b sandbox: %q (stderr %q, exit %d), want %q", r.stdout, r.stderr, r.exitCode, want)
	}

	// Two builds of one name at once: one is refused.
	var wg sync.WaitGroup
	outs := make([]string, 2)
	errs := make([]error, 2)
	for i := range outs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			outs[i], errs[i] = cli("template", "build", "img-c", "--from-image", host+"/test/b:v1")
		}()
	}
	wg.Wait()
	t.Cleanup(func() { d.api(t, "DELETE", "/templates/img-c", nil, nil) })
	if (errs[0] == nil) == (errs[1] == nil) {
		t.Errorf("two concurrent builds of img-c: errors %v / %v\n%s\n%s", errs[0], errs[1], outs[0], outs[1])
	} else if !strings.Contains(outs[0]+outs[1], "being built") {
		t.Errorf("refused build does not say why:\n%s\n%s", outs[0], outs[1])
	}
}

// TestImageLayerGC: deleting a template removes its own layers and the image layers no other
// template uses; a layer another template shares stays, and so does that template.
func TestImageLayerGC(t *testing.T) {
	d := need(t)
	base := newFileLayer(t, debootstrapTarball(t))
	own := map[string]memLayer{}
	imgs := map[string]v1.Image{}
	for _, n := range []string{"gc-a", "gc-b"} {
		own[n] = tarLayer(t, tent{name: "etc/" + n, body: n + "\n"})
		imgs["test/"+n+":v1"] = imageOf(t, v1.Config{}, base, own[n])
	}
	host := imageRegistry(t, imgs)
	layerDir := func(l v1.Layer) string {
		h, _ := l.DiffID()
		return filepath.Join(d.dataDir, "layers", "sha256-"+h.Hex)
	}
	exists := func(p string) bool { _, err := os.Stat(p); return err == nil }
	for _, n := range []string{"gc-a", "gc-b"} {
		cmd := exec.Command(d.bin, "--url", "http://"+d.addr, "template", "build", n, "--from-image", host+"/test/"+n+":v1")
		cmd.Env = append(os.Environ(), "E2B_API_KEY="+d.key)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("build %s: %v\n%s\n%s", n, err, out, d.logs())
		}
		t.Cleanup(func() { d.api(t, "DELETE", "/templates/"+n, nil, nil) })
	}
	topB, _ := filepath.Glob(filepath.Join(d.dataDir, "templates", "gc-b", "rootfs-*"))
	if len(topB) != 1 || !exists(layerDir(own["gc-b"])) || !exists(layerDir(base)) {
		t.Fatalf("before the delete: top %v, own layer %v, base %v", topB, exists(layerDir(own["gc-b"])), exists(layerDir(base)))
	}
	d.api(t, "DELETE", "/templates/gc-b", nil, nil)
	// The warm pool's instances of gc-b go first; a refill cut by the delete goes soon after.
	deadline := time.Now().Add(20 * time.Second)
	for exists(layerDir(own["gc-b"])) && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
	}
	if exists(layerDir(own["gc-b"])) {
		t.Errorf("the deleted template's own image layer %s is still there", layerDir(own["gc-b"]))
	}
	if exists(topB[0]) {
		t.Errorf("the deleted template's top layer %s is still there", topB[0])
	}
	if !exists(layerDir(base)) || !exists(layerDir(own["gc-a"])) {
		t.Fatalf("a layer gc-a uses was removed: base %v, own %v", exists(layerDir(base)), exists(layerDir(own["gc-a"])))
	}
	s := d.create(t, map[string]any{"templateID": "gc-a"})
	if r := d.run(t, s, "cat /etc/gc-a; test -e /etc/gc-b || echo no-b"); r.stdout != "gc-a\nno-b\n" {
		t.Errorf("gc-a after gc-b's delete: %q %q", r.stdout, r.stderr)
	}
}

func TestTemplateFromImageFailures(t *testing.T) {
	d := need(t)
	cli := func(args ...string) (string, error) {
		cmd := exec.Command(d.bin, append([]string{"--url", "http://" + d.addr}, args...)...)
		cmd.Env = append(os.Environ(), "EMBER_API_KEY="+d.key, "E2B_API_KEY="+d.key)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	hostile := tarLayer(t, tent{name: "ok.txt", body: "fine"}, tent{name: "../../../../../../tmp/ember-oci-escape", body: "x"})
	host := imageRegistry(t, map[string]v1.Image{"test/hostile:v1": imageOf(t, v1.Config{}, hostile)})
	for _, tc := range []struct {
		name, ref, want string
	}{
		{"bad-unreachable", "127.0.0.1:1/nothing:v1", "127.0.0.1:1"},
		{"bad-missing", host + "/test/missing:v1", "not found"},
		{"bad-hostile", host + "/test/hostile:v1", "`..` in name"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, err := cli("template", "build", tc.name, "--from-image", tc.ref)
			if err == nil || !strings.Contains(out, tc.want) {
				t.Fatalf("build %s: err %v, output lacks %q:\n%s", tc.ref, err, tc.want, out)
			}
			if _, err := os.Stat(filepath.Join(d.dataDir, "templates", tc.name)); err == nil {
				t.Errorf("failed build left templates/%s", tc.name)
			}
			if _, err := os.Lstat("/tmp/ember-oci-escape"); err == nil {
				t.Errorf("hostile layer wrote outside")
			}
			var tpls []map[string]any
			d.api(t, "GET", "/templates", nil, &tpls)
			for _, tpl := range tpls {
				if tpl["templateID"] == tc.name {
					t.Errorf("failed build is listed: %v", tpl)
				}
			}
		})
	}
}

// TestE2BBaseImageIsTheBaseTemplate: E2B's fromBaseImage() (e2bdev/base) builds on ember's own
// base without any registry, sharing the base's layer.
func TestE2BBaseImageIsTheBaseTemplate(t *testing.T) {
	d := need(t)
	cmd := exec.Command(d.bin, "--url", "http://"+d.addr, "template", "build", "from-e2b-base", "--from-image", "e2bdev/base")
	cmd.Env = append(os.Environ(), "E2B_API_KEY="+d.key)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("build: %v\n%s\n%s", err, out, d.logs())
	}
	t.Cleanup(func() { d.api(t, "DELETE", "/templates/from-e2b-base", nil, nil) })
	if !strings.Contains(string(out), "ember's base template") || !strings.Contains(string(out), "already on this node") {
		t.Errorf("e2bdev/base did not resolve to the shared base:\n%s", out)
	}
	s := d.create(t, map[string]any{"templateID": "from-e2b-base"})
	if r := d.run(t, s, "whoami; pwd; python3 -c 'print(6*7)'"); r.stdout != "user\n/home/user\n42\n" {
		t.Errorf("sandbox: %q %q", r.stdout, r.stderr)
	}
}

// TestImageCmdIsTheStartCommand: an image's Entrypoint/Cmd runs as the template's start
// command (no --start-cmd given), so a new sandbox already serves.
func TestImageCmdIsTheStartCommand(t *testing.T) {
	d := need(t)
	base := newFileLayer(t, debootstrapTarball(t))
	site := tarLayer(t, tent{name: "srv/", dir: true}, tent{name: "srv/index.html", body: "served by the image's cmd\n"})
	img := imageOf(t, v1.Config{WorkingDir: "/srv", Entrypoint: []string{"python3", "-m"}, Cmd: []string{"http.server", "8080"}}, base, site)
	host := imageRegistry(t, map[string]v1.Image{"test/web:v1": img})
	cmd := exec.Command(d.bin, "--url", "http://"+d.addr, "template", "build", "img-web", "--from-image", host+"/test/web:v1",
		"--ready-cmd", "curl -sf http://127.0.0.1:8080/index.html")
	cmd.Env = append(os.Environ(), "E2B_API_KEY="+d.key)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s\n%s", err, out, d.logs())
	} else if !strings.Contains(string(out), "start command: python3 -m http.server 8080") {
		t.Errorf("the image's command was not the start command:\n%s", out)
	}
	t.Cleanup(func() { d.api(t, "DELETE", "/templates/img-web", nil, nil) })
	s := d.create(t, map[string]any{"templateID": "img-web"})
	if r := d.run(t, s, "curl -sf http://127.0.0.1:8080/index.html"); r.stdout != "served by the image's cmd\n" {
		t.Errorf("sandbox: %q %q", r.stdout, r.stderr)
	}
}

// TestTemplateFromArchive: `--from-archive` with a `docker save` tarball.
func TestTemplateFromArchive(t *testing.T) {
	d := need(t)
	base := newFileLayer(t, debootstrapTarball(t))
	img := imageOf(t, v1.Config{Env: []string{"FROM_ARCHIVE=yes"}}, base, tarLayer(t, tent{name: "etc/archived", body: "archived\n"}))
	file := filepath.Join(t.TempDir(), "image.tar")
	tag, _ := name.NewTag("example.com/archived:v1")
	if err := tarball.WriteToFile(file, tag, img); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(d.bin, "--url", "http://"+d.addr, "template", "build", "img-archive", "--from-archive", file)
	cmd.Env = append(os.Environ(), "E2B_API_KEY="+d.key)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s\n%s", err, out, d.logs())
	}
	t.Cleanup(func() { d.api(t, "DELETE", "/templates/img-archive", nil, nil) })
	s := d.create(t, map[string]any{"templateID": "img-archive"})
	if r := d.run(t, s, `cat /etc/archived; echo "$FROM_ARCHIVE"`); r.stdout != "archived\nyes\n" {
		t.Errorf("sandbox: %q %q", r.stdout, r.stderr)
	}
}
