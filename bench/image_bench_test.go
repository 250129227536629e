package bench

import (
	"archive/tar"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"log"
	"log/slog"
	"math/rand"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/daemon"
	"github.com/ember-sandbox/ember/internal/image"
	"github.com/ember-sandbox/ember/internal/overlayfs"
	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/template"
	"github.com/ember-sandbox/ember/internal/testutil"
	testnode "github.com/ember-sandbox/ember/internal/testutil/node"
)

// uncompressed layers: a file (the debootstrap base) or bytes.
type fileLayer struct {
	path string
	hash v1.Hash
	size int64
}

func (l *fileLayer) Digest() (v1.Hash, error)             { return l.hash, nil }
func (l *fileLayer) DiffID() (v1.Hash, error)             { return l.hash, nil }
func (l *fileLayer) Compressed() (io.ReadCloser, error)   { return os.Open(l.path) }
func (l *fileLayer) Uncompressed() (io.ReadCloser, error) { return os.Open(l.path) }
func (l *fileLayer) Size() (int64, error)                 { return l.size, nil }
func (l *fileLayer) MediaType() (types.MediaType, error)  { return types.OCIUncompressedLayer, nil }

func hashFile(b *testing.B, p string) *fileLayer {
	f, err := os.Open(p)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	n, _ := io.Copy(h, f)
	return &fileLayer{path: p, size: n, hash: v1.Hash{Algorithm: "sha256", Hex: hex.EncodeToString(h.Sum(nil))}}
}

// ownLayer writes a tar of files with random (incompressible) content totalling size bytes.
func ownLayer(b *testing.B, dir, tag string, files int, size int) *fileLayer {
	p := filepath.Join(dir, "layer-"+tag+".tar")
	f, err := os.Create(p)
	if err != nil {
		b.Fatal(err)
	}
	tw := tar.NewWriter(f)
	rng := rand.New(rand.NewSource(int64(len(tag)) + int64(tag[len(tag)-1])))
	buf := make([]byte, size/files)
	tw.WriteHeader(&tar.Header{Name: "opt/" + tag + "/", Typeflag: tar.TypeDir, Mode: 0o755, ModTime: time.Now()})
	for i := 0; i < files; i++ {
		rng.Read(buf)
		copy(buf, tag)
		tw.WriteHeader(&tar.Header{Name: fmt.Sprintf("opt/%s/f%04d", tag, i), Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(buf)), ModTime: time.Now()})
		tw.Write(buf)
	}
	tw.Close()
	f.Close()
	return hashFile(b, p)
}

func imageOf(b *testing.B, layers ...v1.Layer) v1.Image {
	img, err := mutate.AppendLayers(empty.Image, layers...)
	if err != nil {
		b.Fatal(err)
	}
	cf, _ := img.ConfigFile()
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", "amd64"
	cf.Config.Env = []string{"PATH=/usr/local/bin:/usr/bin:/bin"}
	img, _ = mutate.ConfigFile(img, cf)
	return img
}

// fsUsed is the bytes in use on p's filesystem, after making everything durable.
func fsUsed(p string) int64 {
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	if err == nil {
		unix.Syncfs(fd)
		unix.Close(fd)
	}
	var st unix.Statfs_t
	unix.Statfs(p, &st)
	return int64(st.Blocks-st.Bfree) * st.Bsize
}

func mib(n int64) string { return fmt.Sprintf("%.2f MiB", float64(n)/(1<<20)) }

// BenchmarkImage: templates from OCI images (issue: bring your own environment). A ~300 MB
// image in a local registry: ember's rootfs build against plain pull + untar of the same
// layers, a full template build, the bytes the second template of a pair writes, and the
// disk 20 templates on one base use.
func BenchmarkImage(b *testing.B) {
	testutil.RequireRoot(b)
	n := startImageNode(b)
	ctx := context.Background()
	cache := testnode.CacheDir()
	tarballs, _ := filepath.Glob(filepath.Join(cache, "debootstrap", "debootstrap-bookworm-*.tar"))
	testutil.Need(b, len(tarballs) > 0, "no debootstrap tarball in the cache (the base template build makes it)")
	work := filepath.Join(n.dataDir, "bench-image")
	os.MkdirAll(work, 0o700)
	defer os.RemoveAll(work)
	scratch := filepath.Join(filepath.Dir(n.dataDir), "image-src")
	os.MkdirAll(scratch, 0o700)
	defer os.RemoveAll(scratch)

	base := hashFile(b, tarballs[0])
	app := ownLayer(b, scratch, "app", 400, 40<<20)
	pair := ownLayer(b, scratch, "pair", 16, 1<<20)
	imgs := map[string]v1.Image{"bench/app:v1": imageOf(b, base, app), "bench/pair:v1": imageOf(b, base, pair)}
	var own20 int64
	for i := 0; i < 20; i++ {
		l := ownLayer(b, scratch, fmt.Sprintf("t%02d", i), 4, 64<<10)
		own20 += l.size
		imgs[fmt.Sprintf("bench/t%02d:v1", i)] = imageOf(b, base, l)
	}
	os.MkdirAll(filepath.Join(scratch, "blobs"), 0o700)
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0)), registry.WithBlobHandler(registry.NewDiskBlobHandler(filepath.Join(scratch, "blobs")))))
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")
	for ref, img := range imgs {
		r, _ := name.ParseReference(host + "/" + ref)
		if err := remote.Write(r, img); err != nil {
			b.Fatal(err)
		}
	}
	imgBytes := base.size + app.size
	fmt.Printf("\n== ember images (local registry, uncompressed layers, data dir on %s) ==\n", n.fs)
	fmt.Printf("image bench/app:v1: 2 layers, %s (base %s + app %s)\n", mib(imgBytes), mib(base.size), mib(app.size))

	// Baseline: plain HTTP GET of each layer blob piped into tar, on the same filesystem.
	var plain, plainSync dist
	for i := 0; i < 3; i++ {
		dir := filepath.Join(work, fmt.Sprintf("plain-%d", i))
		os.MkdirAll(dir, 0o755)
		start := time.Now()
		for _, l := range []*fileLayer{base, app} {
			resp, err := http.Get(srv.URL + "/v2/bench/app/blobs/" + l.hash.String())
			if err != nil {
				b.Fatal(err)
			}
			cmd := exec.Command("tar", "--numeric-owner", "-xpf", "-", "-C", dir)
			cmd.Stdin = resp.Body
			if out, err := cmd.CombinedOutput(); err != nil {
				b.Fatalf("tar: %v %s", err, out)
			}
			resp.Body.Close()
		}
		plain = append(plain, time.Since(start))
		fsUsed(dir)
		plainSync = append(plainSync, time.Since(start))
		os.RemoveAll(dir)
	}
	report(b, "baseline: HTTP GET | tar -x (2 layers)", plain)
	report(b, "baseline: HTTP GET | tar -x, then syncfs", plainSync)

	// ember's rootfs from the image with an empty layer store (pull, verify, unpack, compose,
	// user account, envd, syncfs).
	bld := &template.Builder{EnvdPath: filepath.Join(filepath.Dir(n.dataDir), "envd")}
	var cold dist
	for i := 0; i < 3; i++ {
		cfg := template.ImageConfig{Layers: &image.Store{Root: filepath.Join(work, fmt.Sprintf("layers-%d", i))}, Resolver: &image.Resolver{Allow: []string{"127.0.0.1"}}} // the benchmark's own registry, on loopback
		dest := filepath.Join(work, fmt.Sprintf("rootfs-%d", i))
		start := time.Now()
		if _, _, err := bld.BuildFromImage(ctx, cfg, template.ImageSource{Ref: host + "/bench/app:v1", Insecure: true}, dest, nil); err != nil {
			b.Fatal(err)
		}
		cold = append(cold, time.Since(start))
		os.RemoveAll(dest)
		os.RemoveAll(cfg.Layers.Root)
	}
	report(b, "ember rootfs from image, empty layer store", cold)
	fmt.Printf("ratio ember / plain pull+untar (p50): %.2fx (vs with syncfs: %.2fx)\n",
		float64(cold.pct(0.5))/float64(plain.pct(0.5)), float64(cold.pct(0.5))/float64(plainSync.pct(0.5)))

	// A full template build through the Manager (rootfs + boot + checkpoint).
	start := time.Now()
	if _, err := n.Builds.BuildTemplate(ctx, sandbox.BuildRequest{Name: "bench-app", From: "docker://" + host + "/bench/app:v1"}, nil); err != nil {
		b.Fatal(err)
	}
	report(b, "ember template build (rootfs+boot+checkpoint)", dist{time.Since(start)})
	defer n.Manager.DeleteTemplate(ctx, "bench-app")

	// The second template of a pair sharing the base: bytes it writes.
	cfg := template.ImageConfig{Layers: &image.Store{Root: filepath.Join(n.dataDir, "layers")}, Resolver: &image.Resolver{Allow: []string{"127.0.0.1"}}} // the benchmark's own registry, on loopback
	before := fsUsed(work)
	start = time.Now()
	_, pairStack, err := bld.BuildFromImage(ctx, cfg, template.ImageSource{Ref: host + "/bench/pair:v1", Insecure: true}, filepath.Join(work, "pair"), nil)
	if err != nil {
		b.Fatal(err)
	}
	second := time.Since(start)
	wrote := fsUsed(work) - before
	fmt.Printf("second template of a pair: %s written on the filesystem (own layer %s; allowance own + 1 MiB = %s) in %s\n",
		mib(wrote), mib(pair.size), mib(pair.size+1<<20), second.Round(time.Millisecond))
	b.ReportMetric(float64(wrote)/(1<<20), "second_template_written_MiB")

	// 20 templates on one base.
	before = fsUsed(work)
	start = time.Now()
	for i := 0; i < 20; i++ {
		if _, _, err := bld.BuildFromImage(ctx, cfg, template.ImageSource{Ref: fmt.Sprintf("%s/bench/t%02d:v1", host, i), Insecure: true}, filepath.Join(work, fmt.Sprintf("t%02d", i)), nil); err != nil {
			b.Fatal(err)
		}
	}
	all := time.Since(start)
	used := fsUsed(work) - before
	var baseDisk int64
	filepath.Walk(filepath.Join(cfg.Layers.Root, "sha256-"+base.hash.Hex), func(_ string, info os.FileInfo, err error) error {
		if err == nil {
			baseDisk += info.Sys().(*syscall.Stat_t).Blocks * 512
		}
		return nil
	})
	var tops int64
	for i := 0; i < 20; i++ {
		filepath.Walk(filepath.Join(work, fmt.Sprintf("t%02d", i)), func(_ string, info os.FileInfo, err error) error {
			if st, ok := info.Sys().(*syscall.Stat_t); err == nil && ok && (st.Nlink == 1 || info.IsDir()) {
				tops += st.Blocks * 512 // envd is a hard link to the store's one copy
			}
			return nil
		})
	}
	fmt.Printf("20 templates on one base: %s more on disk (their own image layers: %s; their own top layers (user account, envd link, ember's files): %s, %s each; %s per template beyond its image layer) in %s; the shared base layer holds %s once\n",
		mib(used), mib(own20), mib(tops), mib(tops/20), mib((used-own20)/20), all.Round(time.Millisecond), mib(baseDisk))
	b.ReportMetric(float64(used)/(1<<20), "twenty_templates_MiB")

	// Start and restore of an instance on the layer stack against one tree (the layout before
	// stacks): the pair's stack (top, own layer, base), a stack of ten image layers, and the
	// pair's rootfs flattened into one directory.
	deep := []v1.Layer{base}
	for i := 0; i < 9; i++ {
		deep = append(deep, ownLayer(b, scratch, fmt.Sprintf("deep%d", i), 4, 64<<10))
	}
	r, _ := name.ParseReference(host + "/bench/deep:v1")
	if err := remote.Write(r, imageOf(b, deep...)); err != nil {
		b.Fatal(err)
	}
	_, deepStack, err := bld.BuildFromImage(ctx, cfg, template.ImageSource{Ref: host + "/bench/deep:v1", Insecure: true}, filepath.Join(work, "deep"), nil)
	if err != nil {
		b.Fatal(err)
	}
	flat := filepath.Join(work, "flat")
	flatten(b, pairStack, flat)
	cases := []stackCase{
		{name: "one tree (old layout)", rootfs: flat},
		{name: fmt.Sprintf("stack of %d (1 image layer + base)", 1+len(pairStack.Lowers)), rootfs: pairStack.Top, lowers: pairStack.Lowers},
		{name: fmt.Sprintf("stack of %d (10 image layers)", 1+len(deepStack.Lowers)), rootfs: deepStack.Top, lowers: deepStack.Lowers},
	}
	startRestore(b, n, filepath.Join(work, "inst"), cases, 16)
	for _, c := range cases {
		report(b, "instance start, "+c.name, c.starts)
		report(b, "instance restore, "+c.name, c.restores)
	}
}

type stackCase struct {
	name             string
	rootfs           string
	lowers           []string
	image            string
	starts, restores dist
}

// flatten copies the merged view of stack into dst (one tree, as templates were before stacks).
func flatten(b *testing.B, stack image.Stack, dst string) {
	mnt := dst + ".mnt"
	os.MkdirAll(mnt, 0o755)
	defer os.Remove(mnt)
	if err := overlayfs.Mount(mnt, stack.Dirs(), "", ""); err != nil {
		b.Fatal(err)
	}
	defer overlayfs.Unmount(mnt)
	if out, err := exec.Command("cp", "-a", mnt, dst).CombinedOutput(); err != nil {
		b.Fatalf("cp: %v %s", err, out)
	}
}

// startRestore times, for each case, count cold starts of an instance on its rootfs and count
// restores of one checkpoint of it (driver calls only: no network, envd or pool), each
// instance deleted after; the cases take turns, so that drift in the host's load hits all alike.
func startRestore(b *testing.B, n *imageNode, dir string, cases []stackCase, count int) {
	ctx := context.Background()
	seq := 0
	spec := func(c *stackCase) runtime.Spec {
		seq++
		id := fmt.Sprintf("%s-i%03d", envOr("EMBER_BENCH_NODE", "bench"), seq)
		return runtime.Spec{ID: id, RootFS: c.rootfs, Lowers: c.lowers, StateDir: filepath.Join(dir, id),
			Hostname: "sandbox", Args: []string{"/bin/sh", "-c", "while :; do sleep 1; done"},
			Env: []string{"PATH=/usr/bin:/bin"}, Cwd: "/", CPUCount: 1, MemoryMB: 256}
	}
	done := func(sp runtime.Spec) {
		n.Driver.Delete(ctx, sp.ID)
		n.Driver.Release(ctx, sp.StateDir)
		os.RemoveAll(sp.StateDir)
	}
	for i := range cases {
		c := &cases[i]
		sp := spec(c)
		if err := n.Driver.Start(ctx, sp); err != nil {
			b.Fatal(err)
		}
		c.image = filepath.Join(dir, fmt.Sprintf("image-%d", i))
		os.MkdirAll(c.image, 0o700)
		defer os.RemoveAll(c.image)
		if err := n.Driver.Checkpoint(ctx, sp.ID, c.image, runtime.CheckpointOptions{}); err != nil {
			b.Fatal(err)
		}
		done(sp)
	}
	for r := 0; r < count; r++ {
		for i := range cases {
			c := &cases[i]
			sp := spec(c)
			t0 := time.Now()
			if err := n.Driver.Start(ctx, sp); err != nil {
				b.Fatal(err)
			}
			c.starts = append(c.starts, time.Since(t0))
			done(sp)
			sp = spec(c)
			t0 = time.Now()
			if err := n.Driver.Restore(ctx, sp, c.image); err != nil {
				b.Fatal(err)
			}
			c.restores = append(c.restores, time.Since(t0))
			done(sp)
		}
	}
}

type imageNode struct {
	*testnode.Node
	dataDir, fs string
}

// startImageNode opens a node of its own (no base template, no pools) on the same layer
// filesystem as the shared bench node, named after $EMBER_BENCH_NODE and in $EMBER_BENCH_CIDR so that it
// never shares node-local names with another daemon on the host (run it alone: the shared
// bench node takes the same range).
func startImageNode(b *testing.B) *imageNode {
	runsc := testutil.Runsc(b)
	tmp, err := os.MkdirTemp("", "ember-bench-image-")
	if err != nil {
		b.Fatal(err)
	}
	bins, err := testnode.Build(tmp, false)
	if err != nil {
		b.Fatal(err)
	}
	dataDir := filepath.Join(tmp, "data")
	os.MkdirAll(dataDir, 0o755)
	n, err := testnode.Start(context.Background(), daemon.Config{
		DataDir: dataDir, CacheDir: filepath.Join(tmp, "cache"), Runsc: runsc, Envd: bins.Envd, PoolSize: 0, SlotPoolSize: -1,
		NodeID: envOr("EMBER_BENCH_NODE", "bench") + "i", CIDR: envOr("EMBER_BENCH_CIDR", "10.240.0.0/16"),
		LayerFS: os.Getenv("EMBER_BENCH_LAYER_FS"),
		Logger:  slog.New(slog.NewTextHandler(io.Discard, nil)),
		Out:     io.Discard,
	})
	if err != nil {
		testnode.RemoveDataDir(dataDir)
		b.Fatal(err)
	}
	b.Cleanup(func() {
		n.Close()
		testnode.RemoveDataDir(dataDir)
	})
	return &imageNode{Node: n, dataDir: dataDir, fs: describeLayerFS(n.LayerFS, tmp)}
}
