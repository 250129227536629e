// Package drivertest is the conformance suite every runtime.Driver passes: exec, isolation
// between instances and from the host, kill/delete without leftovers, checkpoint, restore, fork,
// pause/resume and freeze/thaw. A driver's own test calls Run with a factory. The suite owns no
// production code and only ever touches the instances it created.
package drivertest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

// initArgs is every instance's init process (restore requires the checkpointed spec's args, so
// the suite uses one everywhere). Like envd in production it starts processes on request: a
// script moved to /run/spawn.sh is run in the background and its pid written to /run/spawn.pid.
// Processes must come from init for the pause/resume check because gVisor kills every process
// descended from `runsc exec` on restore (its caller is gone).
var initArgs = []string{"/bin/sh", "-c", `while :; do
  if [ -f /run/spawn.sh ]; then
    mv /run/spawn.sh /run/spawn.run
    sh /run/spawn.run </dev/null >/dev/null 2>&1 &
    echo $! > /run/spawn.tmp && mv /run/spawn.tmp /run/spawn.pid
  fi
  sleep 0.05
done`}

// Driver is a driver under test: a runtime.Driver with the probes the suite looks inside an
// instance with.
type Driver interface {
	runtime.Driver
	runtime.Prober
}

// Run runs the suite. newDriver makes a driver for one subtest (with state of its own, e.g. a
// fresh runsc root); rootfs returns the template rootfs directory (nil: BusyboxRootFS). The
// rootfs is shared by every instance of a subtest and must stay unmodified.
func Run(t *testing.T, newDriver func(t *testing.T) Driver, rootfs func(t testing.TB) string) {
	if rootfs == nil {
		rootfs = BusyboxRootFS
	}
	s := &suite{newDriver: newDriver, rootfs: rootfs}
	tests := []struct {
		name string
		fn   func(t *testing.T)
	}{
		{"Exec", s.testExec},
		{"StartConflict", s.testStartConflict},
		{"UnknownID", s.testUnknownID},
		{"Isolation", s.testIsolation},
		{"HostFilesInvisible", s.testHostFilesInvisible},
		{"KillDelete", s.testKillDelete},
		{"Stats", s.testStats},
		{"CheckpointLeaveRunning", s.testCheckpointLeaveRunning},
		{"ForkParallel", s.testForkParallel},
		{"PauseResume", s.testPauseResume},
		{"FilesOnlyPause", s.testFilesOnlyPause},
		{"ConsumedImageSurvivesAbortedResume", s.testConsumedImageSurvivesAbortedResume},
		{"WaitKilled", s.testWaitKilled},
		{"WaitExited", s.testWaitExited},
		{"WaitLifecycle", s.testWaitLifecycle},
		{"MemoryHog", s.testMemoryHog},
		{"ExportImport", s.testExportImport},
		{"LayeredRootFS", s.testLayeredRootFS},
		{"Prestart", s.testPrestart},
		{"FreezeThaw", s.testFreezeThaw},
		{"FrozenCheckpoint", s.testFrozenCheckpoint},
		{"KillFrozen", s.testKillFrozen},
	}
	for _, tc := range tests {
		t.Run(tc.name, tc.fn)
	}
}

type suite struct {
	newDriver func(t *testing.T) Driver
	rootfs    func(t testing.TB) string
}

// env is one subtest's driver and rootfs.
type env struct {
	t      *testing.T
	d      Driver
	rootfs string
	digest string
}

func (s *suite) env(t *testing.T) *env {
	t.Helper()
	e := &env{t: t, d: s.newDriver(t), rootfs: s.rootfs(t)}
	e.digest = treeDigest(t, e.rootfs)
	t.Cleanup(func() {
		if got := treeDigest(t, e.rootfs); got != e.digest {
			t.Errorf("the shared rootfs %s was modified by the driver", e.rootfs)
		}
	})
	return e
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return c
}

// newID returns a fresh id of fixed length (runsc matches ids by prefix).
func newID() string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return "dt-" + hex.EncodeToString(b)
}

// spec returns a spec for a new instance; its StateDir is removed at the end of the test.
func (e *env) spec() runtime.Spec {
	id := newID()
	return runtime.Spec{
		ID:       id,
		RootFS:   e.rootfs,
		StateDir: filepath.Join(e.t.TempDir(), id),
		Hostname: "sbx-" + id[3:],
		Args:     initArgs,
		Env:      []string{"PATH=/bin:/usr/bin", "EMBER_TEST=1"},
		Cwd:      "/",
		MemoryMB: 256,
		CPUCount: 1,
	}
}

// track makes the test delete id at its end and check nothing of it is left.
func (e *env) track(id string) {
	e.t.Cleanup(func() {
		if err := e.d.Delete(context.Background(), id); err != nil {
			e.t.Errorf("cleanup: Delete(%s): %v", id, err)
		}
	})
}

func (e *env) start() runtime.Spec {
	e.t.Helper()
	sp := e.spec()
	if err := e.d.Start(ctx(e.t), sp); err != nil {
		e.t.Fatalf("Start(%s): %v", sp.ID, err)
	}
	e.track(sp.ID)
	return sp
}

func (e *env) restore(sp runtime.Spec, image string) {
	e.t.Helper()
	if err := e.d.Restore(ctx(e.t), sp, image); err != nil {
		e.t.Fatalf("Restore(%s): %v", sp.ID, err)
	}
	e.track(sp.ID)
}

// sh runs a shell command in id and returns its output; it fails the test on a driver error or
// an exit code other than want.
func (e *env) sh(id string, want int, script string) string {
	e.t.Helper()
	out, code, err := e.d.Exec(ctx(e.t), id, []string{"/bin/sh", "-c", script})
	if err != nil {
		e.t.Fatalf("Exec(%s, %q): %v", id, script, err)
	}
	if code != want {
		e.t.Fatalf("Exec(%s, %q): exit %d, want %d; output %q", id, script, code, want, out)
	}
	return string(out)
}

// spawn has id's init process start script in the background and returns its pid.
func (e *env) spawn(id, script string) string {
	e.t.Helper()
	e.sh(id, 0, "rm -f /run/spawn.pid; echo '"+script+"' > /run/spawn.new && mv /run/spawn.new /run/spawn.sh")
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		out, code, err := e.d.Exec(ctx(e.t), id, []string{"cat", "/run/spawn.pid"})
		if err != nil {
			e.t.Fatalf("spawn: %v", err)
		}
		if pid := strings.TrimSpace(string(out)); code == 0 && pid != "" {
			if _, err := strconv.Atoi(pid); err != nil {
				e.t.Fatalf("spawn: pid %q", pid)
			}
			return pid
		}
	}
	e.t.Fatalf("spawn: init did not start %q", script)
	return ""
}

func (e *env) state(id string) runtime.State {
	e.t.Helper()
	st, err := e.d.State(ctx(e.t), id)
	if err != nil {
		e.t.Fatalf("State(%s): %v", id, err)
	}
	return st.State
}

func (s *suite) testExec(t *testing.T) {
	e := s.env(t)
	sp := e.start()
	tests := []struct {
		name     string
		args     []string
		wantOut  string
		wantCode int
	}{
		{"echo", []string{"echo", "hi"}, "hi\n", 0},
		{"exit code", []string{"sh", "-c", "exit 3"}, "", 3},
		{"stderr", []string{"sh", "-c", "echo oops >&2; exit 1"}, "oops\n", 1},
		{"env from spec", []string{"sh", "-c", "echo $EMBER_TEST"}, "1\n", 0},
		{"hostname", []string{"hostname"}, sp.Hostname + "\n", 0},
		{"uid 0", []string{"id", "-u"}, "0\n", 0},
		{"missing binary", []string{"/bin/does-not-exist"}, "", -2},
		{"background child does not block", []string{"sh", "-c", "sleep 600 & echo started"}, "started\n", 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			out, code, err := e.d.Exec(ctx(t), sp.ID, tc.args)
			if tc.wantCode == -2 { // any failure: an error or a non-zero exit code
				if err == nil && code == 0 {
					t.Fatalf("Exec(%v) succeeded, want a failure", tc.args)
				}
				return
			}
			if err != nil {
				t.Fatalf("Exec(%v): %v", tc.args, err)
			}
			if code != tc.wantCode || string(out) != tc.wantOut {
				t.Errorf("Exec(%v) = %q, %d; want %q, %d", tc.args, out, code, tc.wantOut, tc.wantCode)
			}
		})
	}
}

func (s *suite) testStartConflict(t *testing.T) {
	e := s.env(t)
	sp := e.start()
	again := sp
	again.StateDir = filepath.Join(t.TempDir(), "again")
	if err := e.d.Start(ctx(t), again); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("second Start(%s) = %v, want ErrConflict", sp.ID, err)
	}
	if got := e.state(sp.ID); got != runtime.StateRunning {
		t.Fatalf("after the refused Start the first instance is %s, want running", got)
	}
	bad := e.spec()
	bad.ID = "Bad_ID"
	if err := e.d.Start(ctx(t), bad); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("Start(id %q) = %v, want ErrInvalid", bad.ID, err)
	}
}

func (s *suite) testUnknownID(t *testing.T) {
	e := s.env(t)
	id := newID()
	c := ctx(t)
	if _, err := e.d.State(c, id); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("State(unknown) = %v, want ErrNotFound", err)
	}
	if err := e.d.Kill(c, id); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Kill(unknown) = %v, want ErrNotFound", err)
	}
	if _, _, err := e.d.Exec(c, id, []string{"true"}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Exec(unknown) = %v, want ErrNotFound", err)
	}
	if _, err := e.d.Stats(c, id); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Stats(unknown) = %v, want ErrNotFound", err)
	}
	if err := e.d.Checkpoint(c, id, t.TempDir(), runtime.CheckpointOptions{}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Checkpoint(unknown) = %v, want ErrNotFound", err)
	}
	if err := e.d.Delete(c, id); err != nil {
		t.Errorf("Delete(unknown) = %v, want nil", err)
	}
}

func (s *suite) testIsolation(t *testing.T) {
	e := s.env(t)
	a, b := e.start(), e.start()
	e.sh(a.ID, 0, "echo from-a > /tmp/a-file; echo x > /etc/a-etc; sleep 4242 >/dev/null 2>&1 &")
	// Wait until A's background sleep shows up in A.
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(e.sh(a.ID, 0, "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"), "sleep 4242") {
		if time.Now().After(deadline) {
			t.Fatal("A's background process never appeared in A's /proc")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if got := e.sh(a.ID, 0, "cat /tmp/a-file"); got != "from-a\n" {
		t.Fatalf("A reads its own file as %q", got)
	}
	t.Run("files", func(t *testing.T) {
		e.sh(b.ID, 1, "test -e /tmp/a-file || test -e /etc/a-etc")
		for _, p := range []string{"tmp/a-file", "etc/a-etc"} {
			if _, err := os.Stat(filepath.Join(e.rootfs, p)); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("A's file %s appeared in the host rootfs (stat: %v)", p, err)
			}
		}
		ents, _ := os.ReadDir(e.rootfs)
		for _, de := range ents {
			if strings.HasPrefix(de.Name(), ".gvisor") {
				t.Errorf("the driver left %s in the shared rootfs", de.Name())
			}
		}
	})
	t.Run("processes", func(t *testing.T) {
		if out := e.sh(b.ID, 0, "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"); strings.Contains(out, "4242") {
			t.Errorf("B sees A's process: %q", out)
		}
	})
	t.Run("hostnames", func(t *testing.T) {
		if got := e.sh(b.ID, 0, "hostname"); got != b.Hostname+"\n" {
			t.Errorf("B's hostname = %q, want %q", got, b.Hostname)
		}
	})
}

func (s *suite) testHostFilesInvisible(t *testing.T) {
	e := s.env(t)
	dir := t.TempDir()
	secret := filepath.Join(dir, "secret.txt")
	if err := os.WriteFile(secret, []byte("host-secret\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	sp := e.start()
	tests := []struct{ name, script string }{
		{"cat", "cat " + secret},
		{"via proc root", "cat /proc/1/root" + secret},
		{"dotdot", "cat /../../.." + secret},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			out, code, err := e.d.Exec(ctx(t), sp.ID, []string{"/bin/sh", "-c", tc.script})
			if err != nil {
				t.Fatalf("Exec: %v", err)
			}
			if code == 0 || strings.Contains(string(out), "host-secret") {
				t.Errorf("the sandbox read a host file: exit %d, output %q", code, out)
			}
		})
	}
}

func (s *suite) testKillDelete(t *testing.T) {
	e := s.env(t)
	sp := e.start()
	c := ctx(t)
	st, err := e.d.State(c, sp.ID)
	if err != nil || st.State != runtime.StateRunning || st.Pid <= 0 {
		t.Fatalf("State after Start = %+v, %v; want running with a pid", st, err)
	}
	if ids, err := e.d.List(c); err != nil || !contains(ids, sp.ID) {
		t.Fatalf("List = %v, %v; want it to contain %s", ids, err, sp.ID)
	}
	if err := e.d.Kill(c, sp.ID); err != nil {
		t.Fatalf("Kill: %v", err)
	}
	if got := e.state(sp.ID); got != runtime.StateStopped {
		t.Fatalf("State after Kill = %s, want stopped", got)
	}
	if err := e.d.Kill(c, sp.ID); err != nil {
		t.Errorf("Kill of a stopped instance: %v, want nil", err)
	}
	if _, _, err := e.d.Exec(c, sp.ID, []string{"true"}); err == nil {
		t.Errorf("Exec in a stopped instance succeeded")
	}
	if err := e.d.Delete(c, sp.ID); err != nil {
		t.Fatalf("Delete: %v", err)
	}
	if ids, err := e.d.List(c); err != nil || contains(ids, sp.ID) {
		t.Errorf("List after Delete = %v, %v; want no %s", ids, err, sp.ID)
	}
	if _, err := e.d.State(c, sp.ID); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("State after Delete = %v, want ErrNotFound", err)
	}
	if err := e.d.Delete(c, sp.ID); err != nil {
		t.Errorf("second Delete: %v, want nil", err)
	}
	AssertNoLeftovers(t, sp.ID)

	t.Run("delete running", func(t *testing.T) {
		sp := e.start()
		if err := e.d.Delete(c, sp.ID); err != nil {
			t.Fatalf("Delete of a running instance: %v", err)
		}
		AssertNoLeftovers(t, sp.ID)
	})
}

func (s *suite) testStats(t *testing.T) {
	e := s.env(t)
	sp := e.start()
	e.sh(sp.ID, 0, "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done")
	st, err := e.d.Stats(ctx(t), sp.ID)
	if err != nil {
		t.Fatalf("Stats: %v", err)
	}
	if st.CPUUsage <= 0 || st.MemoryBytes == 0 || st.Timestamp.IsZero() {
		t.Errorf("Stats = %+v; want CPU time, memory and a timestamp", st)
	}
}

func (s *suite) testCheckpointLeaveRunning(t *testing.T) {
	e := s.env(t)
	sp := e.start()
	e.sh(sp.ID, 0, "echo kept > /root/f")
	img := t.TempDir()
	if err := e.d.Checkpoint(ctx(t), sp.ID, img, runtime.CheckpointOptions{LeaveRunning: true}); err != nil {
		t.Fatalf("Checkpoint: %v", err)
	}
	if ents, _ := os.ReadDir(img); len(ents) == 0 {
		t.Fatalf("Checkpoint wrote nothing into %s", img)
	}
	// Still running after the sandbox would have gone away without LeaveRunning.
	time.Sleep(1500 * time.Millisecond)
	if got := e.state(sp.ID); got != runtime.StateRunning {
		t.Fatalf("State after Checkpoint(LeaveRunning) = %s, want running", got)
	}
	if got := e.sh(sp.ID, 0, "cat /root/f"); got != "kept\n" {
		t.Errorf("file after checkpoint = %q", got)
	}
	if err := e.d.Checkpoint(ctx(t), sp.ID, img, runtime.CheckpointOptions{LeaveRunning: true}); err == nil {
		t.Errorf("Checkpoint into a non-empty directory succeeded")
	}
}

func (s *suite) testForkParallel(t *testing.T) {
	e := s.env(t)
	parent := e.start()
	e.sh(parent.ID, 0, "echo before > /root/mark")
	img := t.TempDir()
	if err := e.d.Checkpoint(ctx(t), parent.ID, img, runtime.CheckpointOptions{LeaveRunning: true}); err != nil {
		t.Fatalf("Checkpoint: %v", err)
	}
	children := []runtime.Spec{e.spec(), e.spec()}
	var wg sync.WaitGroup
	errs := make([]error, len(children))
	for i, c := range children {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = e.d.Restore(ctx(t), c, img)
		}()
	}
	wg.Wait()
	for i, c := range children {
		if errs[i] != nil {
			t.Fatalf("Restore(%s): %v", c.ID, errs[i])
		}
		e.track(c.ID)
	}
	for i, c := range children {
		if got := e.sh(c.ID, 0, "cat /root/mark"); got != "before\n" {
			t.Errorf("child %d reads %q, want the parent's file", i, got)
		}
		e.sh(c.ID, 0, fmt.Sprintf("echo child-%d > /root/mark", i))
	}
	e.sh(parent.ID, 0, "echo parent-after > /root/mark")
	for i, c := range children {
		if got, want := e.sh(c.ID, 0, "cat /root/mark"), fmt.Sprintf("child-%d\n", i); got != want {
			t.Errorf("child %d reads %q after the writes, want %q", i, got, want)
		}
		if got := e.state(c.ID); got != runtime.StateRunning {
			t.Errorf("child %d is %s", i, got)
		}
	}
	if got := e.sh(parent.ID, 0, "cat /root/mark"); got != "parent-after\n" {
		t.Errorf("parent reads %q", got)
	}
}

func (s *suite) testPauseResume(t *testing.T) {
	e := s.env(t)
	sp := e.start()
	pid := e.spawn(sp.ID, "exec sleep 1000")
	e.sh(sp.ID, 0, "echo paused-data > /root/state && mkdir -p /var/app && echo 2 > /var/app/x")
	img := t.TempDir()
	if err := e.d.Checkpoint(ctx(t), sp.ID, img, runtime.CheckpointOptions{}); err != nil {
		t.Fatalf("Checkpoint: %v", err)
	}
	// The instance is gone right away: nothing runs under its id.
	if st, err := e.d.State(ctx(t), sp.ID); err == nil && st.State == runtime.StateRunning {
		t.Fatalf("instance still running after Checkpoint without LeaveRunning")
	}
	AssertNoProcesses(t, sp.ID)

	// Resume under the same id, with a new state dir, as ember's resume does.
	resumed := sp
	resumed.StateDir = filepath.Join(t.TempDir(), "resumed")
	e.restore(resumed, img)
	if got := e.state(sp.ID); got != runtime.StateRunning {
		t.Fatalf("State after Restore = %s", got)
	}
	out := e.sh(sp.ID, 0, "cat /proc/"+pid+"/cmdline | tr '\\0' ' '")
	if !strings.Contains(out, "sleep 1000") {
		t.Errorf("background process %s after restore: cmdline %q", pid, out)
	}
	if got := e.sh(sp.ID, 0, "cat /root/state /var/app/x"); got != "paused-data\n2\n" {
		t.Errorf("files after restore = %q", got)
	}

	t.Run("under a new id", func(t *testing.T) {
		img2 := t.TempDir()
		if err := e.d.Checkpoint(ctx(t), sp.ID, img2, runtime.CheckpointOptions{}); err != nil {
			t.Fatalf("second Checkpoint: %v", err)
		}
		other := e.spec()
		e.restore(other, img2)
		if got := e.sh(other.ID, 0, "cat /root/state; kill -0 "+pid+" && echo alive"); got != "paused-data\nalive\n" {
			t.Errorf("restored under a new id: %q", got)
		}
	})
}

// testConsumedImageSurvivesAbortedResume: a resume (ConsumeImage) whose instance is deleted
// before the caller removed the image (the resume failed after the restore, or the daemon
// crashed and reconcile deleted the orphan) leaves the image whole: a later resume has the files.
func (s *suite) testConsumedImageSurvivesAbortedResume(t *testing.T) {
	e := s.env(t)
	sp := e.start()
	e.sh(sp.ID, 0, "mkdir -p /var/app && echo precious > /var/app/f")
	img := t.TempDir()
	if err := e.d.Checkpoint(ctx(t), sp.ID, img, runtime.CheckpointOptions{}); err != nil {
		t.Fatalf("Checkpoint: %v", err)
	}
	aborted := sp
	aborted.StateDir = filepath.Join(t.TempDir(), "aborted")
	aborted.ConsumeImage = true
	if err := e.d.Restore(ctx(t), aborted, img); err != nil {
		t.Fatalf("Restore: %v", err)
	}
	if err := e.d.Delete(ctx(t), aborted.ID); err != nil {
		t.Fatalf("Delete: %v", err)
	}
	again := sp
	again.StateDir = filepath.Join(t.TempDir(), "again")
	again.ConsumeImage = true
	e.restore(again, img)
	if got := e.sh(sp.ID, 0, "cat /var/app/f"); got != "precious\n" {
		t.Fatalf("after an aborted resume the image lost its files: %q", got)
	}
}

// testFilesOnlyPause: a filesystem-only checkpoint keeps the instance's files but not its
// processes; Start with LayerFrom boots a new instance on them, under the same id.
func (s *suite) testFilesOnlyPause(t *testing.T) {
	e := s.env(t)
	sp := e.start()
	e.spawn(sp.ID, "exec sleep 1000")
	// Written just before the checkpoint, with no sync by the test: the driver must flush it.
	e.sh(sp.ID, 0, "mkdir -p /var/app && echo kept > /var/app/f && rm /bin/true")
	img := t.TempDir()
	if err := e.d.Checkpoint(ctx(t), sp.ID, img, runtime.CheckpointOptions{FilesOnly: true}); err != nil {
		t.Fatalf("Checkpoint(FilesOnly): %v", err)
	}
	if st, err := e.d.State(ctx(t), sp.ID); err == nil && st.State == runtime.StateRunning {
		t.Fatalf("instance still running after a filesystem-only checkpoint")
	}
	AssertNoProcesses(t, sp.ID)
	if err := e.d.Restore(ctx(t), e.spec(), img); err == nil {
		t.Fatal("Restore of a filesystem-only image succeeded")
	}
	booted := sp
	booted.StateDir = filepath.Join(t.TempDir(), "booted")
	booted.LayerFrom = img
	booted.ConsumeImage = true
	if err := e.d.Start(ctx(t), booted); err != nil {
		t.Fatalf("Start(LayerFrom): %v", err)
	}
	if got := e.sh(sp.ID, 0, "cat /var/app/f; test -e /bin/true && echo true-back; ps -o args | grep -v grep | grep -c 'sleep 1000' || true"); got != "kept\n0\n" {
		t.Errorf("after a filesystem-only resume: %q (want the file, the deletion, and no old sleep beyond the grep itself)", got)
	}
}

// AssertNoLeftovers checks that nothing of instance id is left on the host: no process whose
// command line names it and no cgroup directory named after it.
func AssertNoLeftovers(t *testing.T, id string) {
	t.Helper()
	AssertNoProcesses(t, id)
	for _, d := range cgroupDirsNamed(id) {
		t.Errorf("cgroup directory %s left behind", d)
	}
}

// AssertNoProcesses checks that no host process has id in its command line (it waits briefly:
// gofers exit just after their sandbox).
func AssertNoProcesses(t *testing.T, id string) {
	t.Helper()
	var left []string
	for deadline := time.Now().Add(3 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		left = processesNaming(id)
		if len(left) == 0 || time.Now().After(deadline) {
			break
		}
	}
	for _, p := range left {
		t.Errorf("process left behind: %s", p)
	}
}

func processesNaming(id string) []string {
	ents, _ := os.ReadDir("/proc")
	var out []string
	for _, de := range ents {
		if _, err := strconv.Atoi(de.Name()); err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", de.Name(), "cmdline"))
		if err != nil || len(b) == 0 {
			continue
		}
		if cmd := strings.ReplaceAll(string(b), "\x00", " "); strings.Contains(cmd, id) {
			if len(cmd) > 200 {
				cmd = cmd[:200] + "..."
			}
			out = append(out, de.Name()+": "+cmd)
		}
	}
	return out
}

func cgroupDirsNamed(id string) []string {
	var out []string
	_ = filepath.WalkDir("/sys/fs/cgroup", func(p string, de os.DirEntry, err error) error {
		if err != nil {
			return filepath.SkipDir
		}
		if de.IsDir() && de.Name() == id {
			out = append(out, p)
			return filepath.SkipDir
		}
		return nil
	})
	return out
}

func contains(ids []string, id string) bool {
	for _, x := range ids {
		if x == id {
			return true
		}
	}
	return false
}
