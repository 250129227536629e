package gvisor_test

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/runtime/drivertest"
	"github.com/ember-sandbox/ember/internal/runtime/gvisor"
	"github.com/ember-sandbox/ember/internal/testutil"
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

// TestRestoreIntoOverTheSocket: a restore into a pre-started instance starts no runsc process
// (its network is given to the sentry at pre-start, the restore is containerManager.Restore over
// the control socket), the sentry holds the network runsc's own restore would give it (compared
// with an instance pre-started and restored through the CLI, field by field, the link's MAC
// aside), the restored instance answers on that network's address with its checkpointed
// process, and runsc's state says running.
func TestRestoreIntoOverTheSocket(t *testing.T) {
	dir := t.TempDir()
	root, calls := filepath.Join(dir, "runsc-root"), filepath.Join(dir, "calls")
	// runsc, recording its subcommands.
	wrapper := filepath.Join(dir, "runsc")
	script := "#!/bin/sh\necho \"$*\" >> " + calls + "\nexec " + testutil.Runsc(t) + " \"$@\"\n"
	if err := os.WriteFile(wrapper, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	sock := newDriver(t, func(c *gvisor.Config) { c.Root = root; c.Runsc = wrapper })
	cli := newDriver(t, func(c *gvisor.Config) { c.Root = root; c.Runsc = wrapper; c.RunscCLI = true })
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rootfs := drivertest.BusyboxRootFS(t)
	spec := func(id string) runtime.Spec {
		return runtime.Spec{
			ID: id, RootFS: rootfs, StateDir: filepath.Join(t.TempDir(), "inst"),
			Args: []string{"/bin/sleep", "100000"}, Env: []string{"PATH=/bin"}, Cwd: "/", MemoryMB: 256, CPUCount: 1,
		}
	}
	src := spec("rin-000000000000")
	if err := sock.Start(ctx, src); err != nil {
		t.Fatal(err)
	}
	defer sock.Delete(context.Background(), src.ID)
	img := t.TempDir()
	if err := sock.Checkpoint(ctx, src.ID, img, runtime.CheckpointOptions{LeaveRunning: true}); err != nil {
		t.Fatal(err)
	}

	nets := map[string]map[string]any{}
	for _, c := range []struct {
		name string
		d    *gvisor.Driver
		id   string
	}{{"socket", sock, "rin-000000000001"}, {"CLI", cli, "rin-000000000002"}} {
		sp := spec(c.id)
		sp.NetNSPath = drivertest.NewNetNS(t, "10.254.9.2") // one address in both: compared below
		if out, err := exec.Command("nsenter", "--net="+sp.NetNSPath, "ip", "route", "add", "default", "via", "10.254.9.1").CombinedOutput(); err != nil {
			t.Fatalf("default route: %v: %s", err, out)
		}
		if err := c.d.Prestart(ctx, sp, img); err != nil {
			t.Fatalf("%s: Prestart: %v", c.name, err)
		}
		defer c.d.Delete(context.Background(), sp.ID)
		os.Remove(calls)
		if err := c.d.RestoreInto(ctx, sp.ID, img); err != nil {
			t.Fatalf("%s: RestoreInto: %v", c.name, err)
		}
		b, _ := os.ReadFile(calls)
		if ran := strings.Contains(string(b), "restore"); ran != (c.name == "CLI") {
			t.Errorf("%s: runsc commands during RestoreInto: %q", c.name, b)
		}
		if got := runscStatus(t, sock, sp.ID); got != "running" {
			t.Errorf("%s: runsc state after RestoreInto: %q, want running", c.name, got)
		}
		out, code, err := sock.Exec(ctx, sp.ID, []string{"sh", "-c", "ip -o -4 addr show; ip route; cat /proc/1/cmdline"})
		if err != nil || code != 0 || !strings.Contains(string(out), "10.254.9.2") || !strings.Contains(string(out), "default via 10.254.9.1") || !strings.Contains(string(out), "sleep") {
			t.Errorf("%s: the restored instance's network and process: %q, %d, %v", c.name, out, code, err)
		}
		cfg, err := sock.NetworkConfig(ctx, sp.ID)
		if err != nil {
			t.Fatalf("%s: network config: %v", c.name, err)
		}
		for _, l := range cfg["FDBasedLinks"].([]any) {
			// Each veth has its own MAC, and its IPv6 link-local address is made from it.
			l := l.(map[string]any)
			delete(l, "LinkAddress")
			for _, a := range l["Addresses"].([]any) {
				if a := a.(map[string]any); strings.HasPrefix(a["Address"].(string), "fe80:") {
					a["Address"] = "fe80::(from the MAC)"
				}
			}
		}
		nets[c.name] = cfg
	}
	a, _ := json.MarshalIndent(nets["socket"], "", " ")
	b, _ := json.MarshalIndent(nets["CLI"], "", " ")
	if string(a) != string(b) {
		t.Errorf("the sentry's network differs from runsc's:\nsocket: %s\nCLI: %s", a, b)
	}
}
