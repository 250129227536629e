package gvisor_test

import (
	"context"
	"encoding/json"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/runtime/drivertest"
	"github.com/ember-sandbox/ember/internal/runtime/gvisor"
)

// runscStatus is what `runsc state` says of id.
func runscStatus(t *testing.T, d *gvisor.Driver, id string) string {
	t.Helper()
	cfg := d.Config()
	out, err := exec.Command(cfg.Runsc, "--root="+cfg.Root, "state", id).Output()
	if err != nil {
		t.Fatalf("runsc state %s: %v", id, err)
	}
	var st struct {
		Status string `json:"status"`
	}
	if err := json.Unmarshal(out, &st); err != nil {
		t.Fatalf("runsc state %s: %v: %s", id, err, out)
	}
	return st.Status
}

// TestFreezeKeepsRunscInStep: a freeze or thaw over the control socket leaves runsc's own view
// as `runsc pause` / `runsc resume` would: `runsc state` says paused, runsc resumes what the
// driver froze and the driver thaws what runsc paused, and a new driver on the same root (the
// daemon restarted) sees the instance frozen. Both ways (socket, CLI) pass the same checks.
func TestFreezeKeepsRunscInStep(t *testing.T) {
	root := filepath.Join(t.TempDir(), "runsc-root")
	sock := newDriver(t, func(c *gvisor.Config) { c.Root = root })
	cli := newDriver(t, func(c *gvisor.Config) { c.Root = root; c.RunscCLI = true })
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rootfs := drivertest.BusyboxRootFS(t)
	sp := runtime.Spec{
		ID: "ctl-000000000001", RootFS: rootfs, StateDir: filepath.Join(t.TempDir(), "inst"),
		Args: []string{"/bin/sleep", "100000"}, Env: []string{"PATH=/bin"}, Cwd: "/", MemoryMB: 256, CPUCount: 1,
	}
	if err := sock.Start(ctx, sp); err != nil {
		t.Fatal(err)
	}
	defer sock.Delete(context.Background(), sp.ID)

	for _, c := range []struct {
		name         string
		freeze, thaw *gvisor.Driver
	}{{"socket", sock, sock}, {"socket then CLI", sock, cli}, {"CLI then socket", cli, sock}, {"CLI", cli, cli}} {
		t.Run(c.name, func(t *testing.T) {
			if err := c.freeze.Freeze(ctx, sp.ID); err != nil {
				t.Fatalf("Freeze: %v", err)
			}
			if got := runscStatus(t, sock, sp.ID); got != "paused" {
				t.Errorf("runsc state after Freeze: %q, want paused", got)
			}
			restarted := newDriver(t, func(cf *gvisor.Config) { cf.Root = root })
			if st, err := restarted.State(ctx, sp.ID); err != nil || st.State != runtime.StateRunning || !st.Frozen {
				t.Errorf("State from a new driver on the root: %+v, %v; want running and frozen", st, err)
			}
			if err := c.thaw.Thaw(ctx, sp.ID); err != nil {
				t.Fatalf("Thaw: %v", err)
			}
			if got := runscStatus(t, sock, sp.ID); got != "running" {
				t.Errorf("runsc state after Thaw: %q, want running", got)
			}
			if out, code, err := sock.Exec(ctx, sp.ID, []string{"echo", "alive"}); err != nil || code != 0 || strings.TrimSpace(string(out)) != "alive" {
				t.Errorf("Exec after Thaw: %q, %d, %v", out, code, err)
			}
		})
	}
}
