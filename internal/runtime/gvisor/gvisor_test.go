package gvisor_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/runtime/drivertest"
	"github.com/ember-sandbox/ember/internal/runtime/gvisor"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// newDriver makes a driver with a runsc root of its own, for real runsc (root needed).
func newDriver(t testing.TB, mod func(*gvisor.Config)) *gvisor.Driver {
	t.Helper()
	testutil.RequireRoot(t)
	cfg := gvisor.Config{Runsc: testutil.Runsc(t), Root: filepath.Join(t.TempDir(), "runsc-root")}
	if mod != nil {
		mod(&cfg)
	}
	d, err := gvisor.New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	// runsc bind-mounts the gofers' shared empty network namespace at <root>/null-netns; it
	// stays for the life of the root. Unmount it so the temp dir can go.
	t.Cleanup(func() { _ = unix.Unmount(filepath.Join(cfg.Root, "null-netns"), unix.MNT_DETACH) })
	return d
}

func TestConformance(t *testing.T) {
	drivertest.Run(t, func(t *testing.T) drivertest.Driver { return newDriver(t, nil) }, nil)
}

func TestConformanceIgnoreCgroups(t *testing.T) {
	testutil.SkipShort(t, "a second conformance run")
	drivertest.Run(t, func(t *testing.T) drivertest.Driver {
		return newDriver(t, func(c *gvisor.Config) { c.IgnoreCgroups = true })
	}, nil)
}

// TestConformanceRunscCLI: the suite with freeze, thaw and checkpoint through runsc's CLI (the
// fallback benchmarks compare the control socket with).
func TestConformanceRunscCLI(t *testing.T) {
	testutil.SkipShort(t, "the conformance suite once more, through runsc's CLI")
	drivertest.Run(t, func(t *testing.T) drivertest.Driver {
		return newDriver(t, func(c *gvisor.Config) { c.RunscCLI = true })
	}, nil)
}

func TestNewValidatesConfig(t *testing.T) {
	tests := []struct {
		name string
		cfg  gvisor.Config
	}{
		{"missing runsc", gvisor.Config{Runsc: "/nonexistent/runsc"}},
		{"relative root", gvisor.Config{Runsc: "/bin/true", Root: "rel"}},
		{"bad compression", gvisor.Config{Runsc: "/bin/true", Root: "/tmp/x", Compression: "zstd"}},
		{"background needs none", gvisor.Config{Runsc: "/bin/true", Root: "/tmp/x", Compression: "flate-best-speed", RestoreBackground: true}},
		{"absolute cgroup parent", gvisor.Config{Runsc: "/bin/true", Root: "/tmp/x", CgroupParent: "/ember"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := gvisor.New(tc.cfg); !errors.Is(err, errdefs.ErrInvalid) {
				t.Errorf("New(%+v) = %v, want ErrInvalid", tc.cfg, err)
			}
		})
	}
}

func TestInvalidIDs(t *testing.T) {
	d, err := gvisor.New(gvisor.Config{Runsc: "/bin/true", Root: t.TempDir(), IgnoreCgroups: true})
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"", "UPPER", "a/b", "a_b", "-lead", strings.Repeat("a", 65), "a b"} {
		t.Run(id, func(t *testing.T) {
			if _, err := d.State(context.Background(), id); !errors.Is(err, errdefs.ErrInvalid) {
				t.Errorf("State(%q) = %v, want ErrInvalid", id, err)
			}
			if err := d.Delete(context.Background(), id); !errors.Is(err, errdefs.ErrInvalid) {
				t.Errorf("Delete(%q) = %v, want ErrInvalid", id, err)
			}
		})
	}
}

// TestBundle checks the OCI spec written for an instance: limits, namespace, logs location.
func TestBundle(t *testing.T) {
	d := newDriver(t, nil)
	rootfs := drivertest.BusyboxRootFS(t)
	sp := runtime.Spec{ID: "gv-bundle01", RootFS: rootfs, StateDir: t.TempDir(), Args: []string{"/bin/sleep", "1000"}, MemoryMB: 128, CPUCount: 1}
	ctx := context.Background()
	if err := d.Start(ctx, sp); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Delete(context.Background(), sp.ID) })
	b, err := os.ReadFile(filepath.Join(sp.StateDir, "bundle", "config.json"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"limit": 134217728`, `"quota": 100000`, `"type": "network"`, `"path": "` + filepath.Join(sp.StateDir, "rootfs") + `"`, `"cgroupsPath": "ember/gv-bundle01"`} {
		if !strings.Contains(string(b), want) {
			t.Errorf("config.json lacks %s", want)
		}
	}
	if _, err := os.Stat(filepath.Join(sp.StateDir, "logs", "runsc.log")); err != nil {
		t.Errorf("no per-instance runsc log: %v", err)
	}
	st, err := d.Stats(ctx, sp.ID)
	if err != nil {
		t.Fatal(err)
	}
	if st.MemoryLimit != 128<<20 {
		t.Errorf("Stats.MemoryLimit = %d, want %d", st.MemoryLimit, 128<<20)
	}
	// The sandbox sees the limit as its total memory.
	out, _, err := d.Exec(ctx, sp.ID, []string{"sh", "-c", "grep MemTotal /proc/meminfo"})
	if err != nil || !strings.Contains(string(out), "131072 kB") {
		t.Errorf("MemTotal inside = %q, %v; want 131072 kB", out, err)
	}
}

// TestMemoryLimitEnforced pins what the host memory cgroup does to a gVisor sandbox that goes
// past MemoryMB. Memory the Sentry itself fills (file data it caches, a read(2) into a huge
// buffer, as `python3 -c "x=bytearray(8<<30)"` and `dd bs=2000M` do) gets the Sentry picked
// by the host's OOM killer: the whole sandbox stops and Wait reports ExitOOM. Memory an
// application process touches itself lives in that process's systrap stub, which the OOM
// killer picks instead: the process dies of SIGKILL (exit 137) and the sandbox lives on.
func TestMemoryLimitEnforced(t *testing.T) {
	d := newDriver(t, nil)
	rootfs := drivertest.BusyboxRootFS(t)
	cases := []struct {
		name     string
		memoryMB int
		script   string
		sandbox  bool // the sandbox dies (else only the process)
	}{
		// Past the host limit, which has headroom above MemoryMB (cgroup.go: 64 + 256 + 32 MiB).
		{"file data in the sentry", 64, "dd if=/dev/zero of=/tmp/big bs=1M count=600", true},
		{"one huge buffer", 256, "dd if=/dev/zero of=/dev/null bs=2000M count=1", true},
		{"process touches its memory", 256, `awk 'BEGIN{s="a"; for(i=0;i<30;i++) s=s s}'`, false},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			sp := runtime.Spec{ID: fmt.Sprintf("gv-memlim%02d", i), RootFS: rootfs, StateDir: t.TempDir(), Args: []string{"/bin/sleep", "1000"}, MemoryMB: tc.memoryMB}
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			if err := d.Start(ctx, sp); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = d.Delete(context.Background(), sp.ID) })
			waited := make(chan runtime.Exit, 1)
			go func() { e, _ := d.Wait(ctx, sp.ID); waited <- e }()
			t0 := time.Now()
			_, code, _ := d.Exec(ctx, sp.ID, []string{"sh", "-c", tc.script})
			if !tc.sandbox {
				if code != 137 {
					t.Errorf("the hog's exit code = %d, want 137 (SIGKILL)", code)
				}
				if out, code, err := d.Exec(ctx, sp.ID, []string{"echo", "alive"}); err != nil || code != 0 || string(out) != "alive\n" {
					t.Fatalf("the sandbox after its process was OOM-killed: %q %d %v", out, code, err)
				}
				t.Logf("process killed after %v; the sandbox lives on", time.Since(t0))
				return
			}
			select {
			case e := <-waited:
				if e.Reason != runtime.ExitOOM {
					t.Fatalf("Wait = %+v, want %q", e, runtime.ExitOOM)
				}
				t.Logf("Wait reported %q %v after the hog started", e.Reason, time.Since(t0))
			case <-time.After(30 * time.Second):
				t.Fatal("the sandbox still runs 30 s after going past its memory limit")
			}
		})
	}
}

// TestExecProcessesDieOnRestore pins a gVisor behaviour callers must know: processes descended
// from `runsc exec` (Driver.Exec) are killed when an image is restored; processes of the init
// process (envd) survive.
func TestExecProcessesDieOnRestore(t *testing.T) {
	d := newDriver(t, func(c *gvisor.Config) { c.IgnoreCgroups = true })
	rootfs := drivertest.BusyboxRootFS(t)
	args := []string{"/bin/sh", "-c", "sleep 1001 & exec sleep 1000000"}
	sp := runtime.Spec{ID: "gv-execdie1", RootFS: rootfs, StateDir: t.TempDir(), Args: args}
	ctx := context.Background()
	if err := d.Start(ctx, sp); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Delete(context.Background(), sp.ID) })
	if _, code, err := d.Exec(ctx, sp.ID, []string{"sh", "-c", "sleep 1002 </dev/null >/dev/null 2>&1 &"}); err != nil || code != 0 {
		t.Fatalf("Exec: %d, %v", code, err)
	}
	img := t.TempDir()
	if err := d.Checkpoint(ctx, sp.ID, img, runtime.CheckpointOptions{LeaveRunning: true}); err != nil {
		t.Fatal(err)
	}
	clone := runtime.Spec{ID: "gv-execdie2", RootFS: rootfs, StateDir: t.TempDir(), Args: args}
	if err := d.Restore(ctx, clone, img); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Delete(context.Background(), clone.ID) })
	// ps lists zombies as [sleep]; live processes with their arguments.
	out, _, err := d.Exec(ctx, clone.ID, []string{"ps"})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(out), "sleep 1001") || strings.Contains(string(out), "sleep 1002") {
		t.Errorf("after restore want init's child alive and exec's child dead; ps:\n%s", out)
	}
}

// TestSandboxOutlivesCaller checks the sandbox process runs in a session of its own, so killing
// the daemon (its process group, its session) does not take sandboxes down.
func TestSandboxOutlivesCaller(t *testing.T) {
	d := newDriver(t, func(c *gvisor.Config) { c.IgnoreCgroups = true })
	sp := runtime.Spec{ID: "gv-session1", RootFS: drivertest.BusyboxRootFS(t), StateDir: t.TempDir(), Args: []string{"/bin/sleep", "1000"}}
	ctx := context.Background()
	if err := d.Start(ctx, sp); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Delete(context.Background(), sp.ID) })
	st, err := d.State(ctx, sp.ID)
	if err != nil {
		t.Fatal(err)
	}
	sid, err := unix.Getsid(st.Pid)
	if err != nil {
		t.Fatal(err)
	}
	if own, _ := unix.Getsid(0); sid == own {
		t.Errorf("sandbox pid %d is in the caller's session %d", st.Pid, own)
	}
	if pgid, _ := unix.Getpgid(st.Pid); pgid == unix.Getpgrp() {
		t.Errorf("sandbox pid %d is in the caller's process group", st.Pid)
	}
}
