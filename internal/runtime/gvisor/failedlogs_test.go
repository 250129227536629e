package gvisor_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/runtime/drivertest"
	"github.com/ember-sandbox/ember/internal/runtime/gvisor"
)

// TestFailedRestoreKeepsLogs: a restore of a corrupt image fails, and its runsc logs (with
// Config.SandboxLogs, the sandbox's too) are kept under Config.FailedLogDir, named in the error
// with the line that says why.
func TestFailedRestoreKeepsLogs(t *testing.T) {
	failed := filepath.Join(t.TempDir(), "failed")
	d := newDriver(t, func(c *gvisor.Config) { c.FailedLogDir, c.SandboxLogs = failed, true })
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rootfs := drivertest.BusyboxRootFS(t)
	sp := runtime.Spec{ID: "gv-flog01", RootFS: rootfs, StateDir: filepath.Join(t.TempDir(), "a"), Args: []string{"/bin/sleep", "1000"}, Cwd: "/", MemoryMB: 128, CPUCount: 1}
	if err := d.Start(ctx, sp); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Delete(context.Background(), sp.ID) })
	img := t.TempDir()
	if err := d.Checkpoint(ctx, sp.ID, img, runtime.CheckpointOptions{}); err != nil {
		t.Fatal(err)
	}
	// Cut the memory image short: the sentry reads past its end while it restores.
	ck := filepath.Join(img, "checkpoint.img")
	fi, err := os.Stat(ck)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(ck, fi.Size()/2); err != nil {
		t.Fatal(err)
	}
	r := sp
	r.ID, r.StateDir = "gv-flog02", filepath.Join(t.TempDir(), "b")
	err = d.Restore(ctx, r, img)
	if err == nil {
		_ = d.Delete(context.Background(), r.ID)
		t.Fatal("Restore of a truncated image succeeded")
	}
	// The error names the kept logs and the line that says why; the instance's log dir is empty.
	var le *runtime.LaunchError
	if !errors.As(err, &le) {
		t.Fatalf("Restore error %T %v: not a runtime.LaunchError", err, err)
	}
	if le.Op != "restore" || le.ID != r.ID || filepath.Dir(le.Logs) != failed {
		t.Errorf("LaunchError = %+v, want op restore, id %s, logs under %s", le, r.ID, failed)
	}
	if !strings.Contains(le.Reason, "EOF") || !strings.Contains(err.Error(), le.Logs) {
		t.Errorf("error %q: want the reason (an EOF decoding the image) and the logs' path", err)
	}
	if len(err.Error()) > 600 {
		t.Errorf("error is %d bytes long, want one short line: %q", len(err.Error()), err)
	}
	var boot string
	ents, _ := os.ReadDir(le.Logs)
	for _, e := range ents {
		if strings.Contains(e.Name(), "boot") {
			boot = filepath.Join(le.Logs, e.Name())
		}
	}
	// The sandbox's log (it may be cut before the sandbox logged its failure: the restore
	// failed and the sandbox was stopped).
	if b, _ := os.ReadFile(boot); !strings.Contains(string(b), "Timer for Restore: Starting") {
		t.Errorf("kept logs %v: no sandbox log of the restore:\n%s", ents, b)
	}
	if b, _ := os.ReadFile(filepath.Join(le.Logs, "init.err")); len(b) == 0 {
		t.Errorf("kept logs: no init.err (runsc's stderr)")
	}
	if ents, _ := os.ReadDir(filepath.Join(r.StateDir, "logs")); len(ents) != 0 {
		t.Errorf("instance log dir still holds %v", ents)
	}

	// A start that fails keeps its logs too (here: no such program).
	bad := sp
	bad.ID, bad.StateDir, bad.Args = "gv-flog03", filepath.Join(t.TempDir(), "c"), []string{"/no/such/program"}
	err = d.Start(ctx, bad)
	if err == nil {
		_ = d.Delete(context.Background(), bad.ID)
		t.Fatal("Start of a missing program succeeded")
	}
	if !errors.As(err, &le) || le.Op != "run" || filepath.Dir(le.Logs) != failed {
		t.Errorf("Start error %v: want a LaunchError of op run with logs under %s", err, failed)
	}
}

// TestRestoreOOMKilledSaysSo: a sandbox the host kernel kills as it restores (here the OOM
// killer: its memory image is larger than the memory limit it is restored with) writes no log;
// the error says what the kernel logged about it.
func TestRestoreOOMKilledSaysSo(t *testing.T) {
	failed := filepath.Join(t.TempDir(), "failed")
	d := newDriver(t, func(c *gvisor.Config) { c.FailedLogDir = failed })
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rootfs := drivertest.BusyboxRootFS(t)
	sp := runtime.Spec{ID: "gv-foom01", RootFS: rootfs, StateDir: filepath.Join(t.TempDir(), "a"), Args: []string{"/bin/sleep", "1000"}, Cwd: "/", MemoryMB: 512, CPUCount: 1}
	if err := d.Start(ctx, sp); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Delete(context.Background(), sp.ID) })
	if out, code, err := d.Exec(ctx, sp.ID, []string{"sh", "-c", "dd if=/dev/urandom of=/dev/shm/fill bs=1M count=60 2>&1"}); err != nil || code != 0 {
		t.Fatalf("fill: %d %v %s", code, err, out)
	}
	img := t.TempDir()
	if err := d.Checkpoint(ctx, sp.ID, img, runtime.CheckpointOptions{}); err != nil {
		t.Fatal(err)
	}
	r := sp
	r.ID, r.StateDir, r.MemoryMB = "gv-foom02", filepath.Join(t.TempDir(), "b"), 40
	err := d.Restore(ctx, r, img)
	if err == nil {
		_ = d.Delete(context.Background(), r.ID)
		t.Fatal("the restore with a memory limit (40 MiB) below its image's memory (60 MiB in /dev/shm) succeeded: want the kernel's OOM kill reported")
	}
	var le *runtime.LaunchError
	if !errors.As(err, &le) || !strings.Contains(le.Reason, "kernel: ") || !strings.Contains(le.Reason, "Killed process") {
		t.Fatalf("Restore error %v: want the OOM killer's record as the reason", err)
	}
	if b, _ := os.ReadFile(filepath.Join(le.Logs, "kernel.log")); !strings.Contains(string(b), "gv-foom02") {
		t.Errorf("kernel.log of the kept logs: %q, want the OOM records naming the instance's cgroup", b)
	}
}
