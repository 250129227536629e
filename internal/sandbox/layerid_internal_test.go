package sandbox

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// noStore is an ImageStore that has nothing: a layer not found on the node cannot be loaded.
type noStore struct{ ImageStore }

func (noStore) Fetch(ctx context.Context, id, destDir string, unpack func(ctx context.Context, srcDir, dstDir string) error) error {
	return errdefs.ErrNotFound
}

// layerRig is a data directory with one layer of each kind ember makes, and a guest's symlink
// to a host directory inside a step layer's files.
func layerRig(t testing.TB) (*Manager, string, string) {
	t.Helper()
	data := t.TempDir()
	host := t.TempDir() // a host directory outside the data dir
	os.WriteFile(filepath.Join(host, "secret"), []byte("s"), 0o600)
	key := strings.Repeat("ab", 32)
	for _, d := range []string{
		"layers/sha256-" + key + "/root",
		"layers/step-" + key + "/image/upper",
		"templates/base/rootfs-0a1b2c3d",
		"templates/.image-0123456789abcdef/rootfs-0a1b2c3d",
		"forks/i0123456789/layer/upper",
	} {
		if err := os.MkdirAll(filepath.Join(data, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	os.WriteFile(filepath.Join(data, "layers/step-"+key, "layer.json"), []byte(`{"key":"`+key+`","root":"image/upper"}`), 0o600)
	os.WriteFile(filepath.Join(data, "api-key"), []byte("k"), 0o600)
	if err := os.Symlink(host, filepath.Join(data, "layers/step-"+key, "image/upper/evil")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(host, filepath.Join(data, "templates/base/rootfs-link")); err != nil {
		t.Fatal(err)
	}
	m := &Manager{cfg: Config{DataDir: data, Images: noStore{}}}
	return m, data, key
}

// A template's layer list from another node (etcd, the image store) names layers by identity:
// only a layer ember made is taken from the node's data dir; ".", "..", a symlink, a path into
// a layer's files or anything else is refused, never mounted.
func TestImportLayerRefusesWhatIsNotALayer(t *testing.T) {
	m, data, key := layerRig(t)
	ctx := context.Background()
	for _, good := range []string{
		"layers/sha256-" + key + "/root",
		"layers/step-" + key + "/image/upper",
		"templates/base/rootfs-0a1b2c3d",
		"templates/.image-0123456789abcdef/rootfs-0a1b2c3d",
	} {
		dir, err := m.importLayer(ctx, nil, good, 1<<20)
		if err != nil || dir != filepath.Join(data, good) {
			t.Errorf("importLayer(%q) = %q, %v; want the local layer", good, dir, err)
		}
	}
	for _, bad := range []string{
		".", "./", "..", "layers", "layers/..", "templates/base", "templates", "remote",
		"layers/step-" + key + "/image/upper/evil",
		"layers/step-" + key + "/image/upper/evil/",
		"layers/step-" + key + "/image",
		"layers/step-" + key,
		"layers/sha256-" + key,
		"templates/base/rootfs-link",
		"templates/base/rootfs-0a1b2c3d/../../..",
		"templates/base/./rootfs-0a1b2c3d",
		"templates//base/rootfs-0a1b2c3d",
		"templates/base/rootfs-0a1b2c3d/etc",
		"api-key",
		"layers\\sha256-" + key + "\\root",
	} {
		dir, err := m.importLayer(ctx, nil, bad, 1<<20)
		if err == nil {
			t.Errorf("importLayer(%q) = %q; want an error", bad, dir)
			continue
		}
		if !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("importLayer(%q): %v; want ErrInvalid (refused before any load)", bad, err)
		}
	}
}

// Every path that stacks layers checks the stack: a template record whose stack names the
// data dir itself, a symlink or a directory that is no layer is refused before anything boots
// on it or composes from it.
func TestCheckStackRefusesWhatIsNotALayer(t *testing.T) {
	m, data, key := layerRig(t)
	top := filepath.Join(data, "templates/base/rootfs-0a1b2c3d")
	good := []string{filepath.Join(data, "layers/sha256-"+key+"/root"), filepath.Join(data, "layers/step-"+key+"/image/upper")}
	if err := m.checkStack(top, good); err != nil {
		t.Fatalf("a stack of ember's layers: %v", err)
	}
	for _, bad := range []string{
		data, data + "/", filepath.Join(data, "."), filepath.Join(data, "templates"),
		filepath.Join(data, "layers/step-"+key+"/image/upper/evil"),
		filepath.Join(data, "templates/base/rootfs-link"),
		filepath.Join(data, "templates/base/rootfs-0a1b2c3d/.."),
		"/", "/etc", t.TempDir(), "relative/path",
	} {
		if err := m.checkStack(top, append(good, bad)); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("lower %q: %v; want ErrInvalid", bad, err)
		}
		if err := m.checkStack(bad, good); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("top %q: %v; want ErrInvalid", bad, err)
		}
	}
}

// BenchmarkCheckStack: what the stack check adds to every launch (a template's top, a step
// layer and an image layer).
func BenchmarkCheckStack(b *testing.B) {
	m, data, key := layerRig(b)
	top := filepath.Join(data, "templates/base/rootfs-0a1b2c3d")
	lowers := []string{filepath.Join(data, "layers/step-"+key+"/image/upper"), filepath.Join(data, "layers/sha256-"+key+"/root")}
	for b.Loop() {
		if err := m.checkStack(top, lowers); err != nil {
			b.Fatal(err)
		}
	}
}
