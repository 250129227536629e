package gvisor

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// A resume cut by a crash after its layer was taken from the pause image but before runsc made
// an instance (nothing to Delete): Release gives the layer back to the image, so reconcile can
// remove the directory without losing the sandbox's files.
func TestReleaseGivesAConsumedLayerBack(t *testing.T) {
	testutil.RequireRoot(t)
	d, err := New(Config{Runsc: "/bin/true", Root: filepath.Join(t.TempDir(), "root"), IgnoreCgroups: true})
	if err != nil {
		t.Fatal(err)
	}
	lower := t.TempDir()
	image := filepath.Join(t.TempDir(), "image")
	upper := filepath.Join(image, layerDirName, upperDirName)
	if err := os.MkdirAll(upper, 0o755); err != nil {
		t.Fatal(err)
	}
	os.MkdirAll(filepath.Join(image, layerDirName, workDirName), 0o755)
	if err := os.WriteFile(filepath.Join(upper, "precious"), []byte("files"), 0o600); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(image, "checkpoint.img"), []byte("memory"), 0o600)
	state := filepath.Join(t.TempDir(), "run-abcd")
	spec := runtime.Spec{ID: "rel-test0001", RootFS: lower, StateDir: state, Args: []string{"/x"}, ConsumeImage: true}
	if _, err := d.prepareLayer(spec, image); err != nil {
		t.Fatal(err)
	}
	if imageHasLayer(image) {
		t.Fatal("the layer was not taken from the image")
	}
	// The crash: no instance, the daemon restarts, reconcile releases the stale directory.
	if err := d.Release(context.Background(), state); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(upper, "precious")); err != nil || string(b) != "files" {
		t.Fatalf("the image did not get its layer back: %q %v", b, err)
	}
	if err := os.RemoveAll(state); err != nil {
		t.Fatal(err)
	}
	// Once the caller removed the image (a recorded resume), Release deletes the layer.
	state2 := filepath.Join(t.TempDir(), "run-efgh")
	spec.StateDir = state2
	if _, err := d.prepareLayer(spec, image); err != nil {
		t.Fatal(err)
	}
	os.RemoveAll(image)
	if err := d.Release(context.Background(), state2); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(state2, layerDirName)); !os.IsNotExist(err) {
		t.Fatalf("the layer of a recorded resume stayed: %v", err)
	}
}
