package gvisor_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/runtime/drivertest"
	"github.com/ember-sandbox/ember/internal/runtime/gvisor"
)

// TestGCSettingsAndReduceMemory: the sentry and gofer of an instance start with the Go GC the
// driver was configured with (ember's runsc logs what it applied), an instance restored into a
// pre-started one and a plain restore both take it too, and ReduceMemory of a restored instance
// leaves it running and serving.
func TestGCSettingsAndReduceMemory(t *testing.T) {
	d := newDriver(t, func(c *gvisor.Config) {
		c.SentryGC = gvisor.GCConfig{Percent: 30, MemoryLimit: 1 << 30}
		c.GoferGC = gvisor.GCConfig{Percent: 40}
	})
	rootfs := drivertest.BusyboxRootFS(t)
	ctx := context.Background()
	spec := func(i int) runtime.Spec {
		id := fmt.Sprintf("%sgc-%d-%d", os.Getenv("EMBER_E2E_NODE_PREFIX"), os.Getpid(), i)
		return runtime.Spec{ID: id, RootFS: rootfs, StateDir: filepath.Join(t.TempDir(), id), Args: benchArgs, MemoryMB: 512, CPUCount: 1}
	}
	cleanup := func(id string) { t.Cleanup(func() { d.Delete(context.Background(), id) }) }
	logHas := func(sp runtime.Spec, want ...string) {
		t.Helper()
		b, err := os.ReadFile(filepath.Join(sp.StateDir, "logs", "runsc.log"))
		if err != nil {
			t.Fatal(err)
		}
		for _, w := range want {
			if !strings.Contains(string(b), w) {
				t.Errorf("%s: runsc log lacks %q (is .cache/bin/runsc built by scripts/setup.sh?):\n%s", sp.ID, w, tail(string(b), 2000))
			}
		}
	}
	applied := []string{"ember: sentry gc-percent 30 (was 100)", "ember: sentry memory-limit 1073741824 bytes", "ember: gofer gc-percent 40 (was 100)"}

	src := spec(0)
	if err := d.Start(ctx, src); err != nil {
		t.Fatal(err)
	}
	cleanup(src.ID)
	logHas(src, applied...)
	img := t.TempDir()
	if err := d.Checkpoint(ctx, src.ID, img, runtime.CheckpointOptions{LeaveRunning: true}); err != nil {
		t.Fatal(err)
	}

	restored := spec(1)
	if err := d.Restore(ctx, restored, img); err != nil {
		t.Fatal(err)
	}
	cleanup(restored.ID)
	pre := spec(2)
	if err := d.Prestart(ctx, pre, img); err != nil {
		t.Fatal(err)
	}
	cleanup(pre.ID)
	if err := d.RestoreInto(ctx, pre.ID, img); err != nil {
		t.Fatal(err)
	}
	for _, sp := range []runtime.Spec{restored, pre} {
		logHas(sp, applied...)
		if err := d.ReduceMemory(ctx, sp.ID); err != nil {
			t.Fatalf("ReduceMemory(%s): %v", sp.ID, err)
		}
		out, code, err := d.Exec(ctx, sp.ID, []string{"/bin/echo", "still here"})
		if err != nil || code != 0 || string(out) != "still here\n" {
			t.Fatalf("%s after ReduceMemory: %q exit %d, %v", sp.ID, out, code, err)
		}
		if st, err := d.State(ctx, sp.ID); err != nil || st.State != runtime.StateRunning {
			t.Fatalf("%s after ReduceMemory: %+v %v", sp.ID, st, err)
		}
	}
	if err := d.ReduceMemory(ctx, "no-such-instance"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("ReduceMemory of an unknown instance: %v, want ErrNotFound", err)
	}
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}
