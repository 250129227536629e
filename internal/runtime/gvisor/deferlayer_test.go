package gvisor_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/runtime/drivertest"
	"github.com/ember-sandbox/ember/internal/runtime/gvisor"
)

// TestDeferredCheckpointLayer (issue 11 lever 3): a checkpoint with DeferLayer returns once the
// memory image is written, before the layer is in the image; the layer reaches it when the
// instance is deleted or, after a crash of the daemon in between, when a new driver sweeps the
// orphan instance and releases its state dir. Either way a restore of the image has the files
// the sandbox wrote, on a plain layer and on a disk-limited (ext4 image) one.
func TestDeferredCheckpointLayer(t *testing.T) {
	rootfs := drivertest.BusyboxRootFS(t)
	ctx := context.Background()
	for _, tc := range []struct {
		name   string
		diskMB int
		crash  bool
	}{
		{"delete", 0, false},
		{"delete-disk-limit", 64, false},
		{"crash", 0, true},
		{"crash-disk-limit", 64, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := filepath.Join(t.TempDir(), "runsc-root")
			d := newDriver(t, func(c *gvisor.Config) { c.Root = root })
			id := "h5-defer-" + strings.ReplaceAll(tc.name, "-", "")
			sp := runtime.Spec{ID: id, RootFS: rootfs, StateDir: filepath.Join(t.TempDir(), "run-"+id), Args: []string{"/bin/sleep", "100000"},
				DiskMB: tc.diskMB, MemoryMB: 512}
			startInstance(t, d, sp)
			mustExec(t, d, id, "echo kept > /kept.txt")
			img := t.TempDir()
			if err := d.Checkpoint(ctx, id, img, runtime.CheckpointOptions{DeferLayer: true}); err != nil {
				t.Fatal(err)
			}
			if _, err := os.Stat(filepath.Join(img, "checkpoint.img")); err != nil {
				t.Fatalf("no memory image when Checkpoint returned: %v", err)
			}
			if _, err := os.Stat(filepath.Join(img, "layer")); !os.IsNotExist(err) {
				t.Fatalf("the layer is in the image already (want it deferred): %v", err)
			}
			if tc.crash {
				// The daemon dies here; the next one sweeps what its predecessor left.
				d2 := newDriver(t, func(c *gvisor.Config) { c.Root = root })
				if _, err := d2.Sweep(ctx, nil); err != nil {
					t.Fatal(err)
				}
				if err := d2.Release(ctx, sp.StateDir); err != nil {
					t.Fatal(err)
				}
				d = d2
			} else {
				if err := d.Delete(ctx, id); err != nil {
					t.Fatal(err)
				}
				if err := d.Release(ctx, sp.StateDir); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := os.Stat(filepath.Join(img, "layer")); err != nil {
				t.Fatalf("the image did not get its layer: %v", err)
			}
			if err := os.RemoveAll(sp.StateDir); err != nil {
				t.Fatal(err)
			}
			back := runtime.Spec{ID: id + "b", RootFS: rootfs, StateDir: filepath.Join(t.TempDir(), "run-b"), Args: sp.Args,
				DiskMB: tc.diskMB, MemoryMB: 512, ConsumeImage: true}
			if err := d.Restore(ctx, back, img); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { d.Delete(context.Background(), back.ID); d.Release(context.Background(), back.StateDir) })
			if got := mustExec(t, d, back.ID, "cat /kept.txt"); got != "kept\n" {
				t.Fatalf("restored instance reads %q, want the file written before the checkpoint", got)
			}
		})
	}
}
