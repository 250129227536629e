package gvisor_test

import (
	"context"
	"os/exec"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/runtime/drivertest"
)

// Sweep removes what an earlier daemon left: instances it does not keep, and runsc launches
// still in flight for them (a stand-in process with a launch's command line here), which would
// otherwise come up after reconciliation removed their directory.
func TestSweepRemovesOrphansAndLaunchesInFlight(t *testing.T) {
	d := newDriver(t, nil)
	root := d.Config().Root
	rootfs := drivertest.BusyboxRootFS(t)
	ctx := context.Background()
	start := func(id string) {
		sp := runtime.Spec{ID: id, RootFS: rootfs, StateDir: filepath.Join(t.TempDir(), id), Args: []string{"/bin/sleep", "1000"}}
		if err := d.Start(ctx, sp); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Delete(context.Background(), id) })
	}
	start("gv-sweepkeep1")
	start("gv-sweepdrop1")
	// What `runsc restore --detach <id>` of a daemon that died looks like from /proc.
	// A shell that keeps its extra arguments in its argv, as runsc's launch does (two commands,
	// so it does not exec the last one in its own place).
	inflight := exec.Command("/bin/busybox", "sh", "-c", "sleep 1000; :", "--root="+root, "gv-sweepfly01")
	inflight.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := inflight.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- inflight.Wait() }()
	t.Cleanup(func() { syscall.Kill(-inflight.Process.Pid, syscall.SIGKILL) })

	removed, err := d.Sweep(ctx, []string{"gv-sweepkeep1"})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(removed, []string{"gv-sweepdrop1"}) {
		t.Fatalf("removed %v, want the unkept instance", removed)
	}
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("the launch left in flight still runs")
	}
	if st, err := d.State(ctx, "gv-sweepkeep1"); err != nil || st.State != runtime.StateRunning {
		t.Fatalf("kept instance: %v %v", st, err)
	}
	ids, _ := d.List(ctx)
	if !slices.Equal(ids, []string{"gv-sweepkeep1"}) {
		t.Fatalf("instances after sweep: %v", ids)
	}
}
