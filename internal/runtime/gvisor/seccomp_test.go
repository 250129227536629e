package gvisor_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/runtime/drivertest"
	"github.com/ember-sandbox/ember/internal/runtime/gvisor"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// The runsc that scripts/setup.sh builds loads precompiled seccomp programs, in the sentry and
// the gofer, at a start and inside a restore, and the sentry runs under its filter.
func TestSeccompPrecompiledAndOn(t *testing.T) {
	root := filepath.Join(t.TempDir(), "runsc-root")
	d := newDriver(t, func(c *gvisor.Config) { c.Root = root; c.IgnoreCgroups = true; c.Debug = true })
	rootfs := drivertest.BusyboxRootFS(t)
	ctx := context.Background()
	spec := func(id string) runtime.Spec {
		return runtime.Spec{ID: id, RootFS: rootfs, StateDir: filepath.Join(t.TempDir(), id), Args: []string{"/bin/sleep", "1000000"}, MemoryMB: 256, CPUCount: 1}
	}
	src := spec("sc-start0001")
	if err := d.Start(ctx, src); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Delete(ctx, src.ID) })
	checkSeccomp(t, testutil.Runsc(t), root, src)
	img := t.TempDir()
	if err := d.Checkpoint(ctx, src.ID, img, runtime.CheckpointOptions{LeaveRunning: true}); err != nil {
		t.Fatal(err)
	}
	dst := spec("sc-rstr0001")
	if err := d.Restore(ctx, dst, img); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Delete(ctx, dst.ID) })
	checkSeccomp(t, testutil.Runsc(t), root, dst)
}

// checkSeccomp reads the instance's debug logs (sandbox and gofer) and its sandbox process's
// seccomp mode.
func checkSeccomp(t *testing.T, runsc, root string, sp runtime.Spec) {
	t.Helper()
	for _, kind := range []string{"boot", "gofer"} {
		logs, _ := filepath.Glob(filepath.Join(sp.StateDir, "logs", "*."+kind+".txt"))
		if len(logs) == 0 {
			t.Fatalf("%s: no %s debug log in %s/logs", sp.ID, kind, sp.StateDir)
		}
		for _, l := range logs {
			b, err := os.ReadFile(l)
			if err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(string(b), "Loaded precompiled seccomp instructions") || strings.Contains(string(b), "No precompiled program found") {
				t.Errorf("%s: %s compiled its seccomp filters at run time (runsc not built by scripts/setup.sh?)", sp.ID, filepath.Base(l))
			}
		}
	}
	out, err := exec.Command(runsc, "--root", root, "state", sp.ID).Output()
	if err != nil {
		t.Fatalf("runsc state: %v", err)
	}
	var st struct{ Pid int }
	if err := json.Unmarshal(out, &st); err != nil || st.Pid <= 0 {
		t.Fatalf("runsc state: %q %v", out, err)
	}
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", st.Pid))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(status), "\nSeccomp:\t2\n") {
		t.Errorf("%s: sandbox process %d is not in seccomp filter mode:\n%s", sp.ID, st.Pid, status)
	}
}
