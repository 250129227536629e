package drivertest

import (
	"errors"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

// counterScript counts in /dev/shm/count (tmpfs), one step every 50 ms: a process whose
// progress shows whether it ran.
const counterScript = `i=0; while :; do i=$((i+1)); echo $i > /dev/shm/count.new; mv /dev/shm/count.new /dev/shm/count; sleep 0.05; done`

const counterStep = 50 * time.Millisecond

// startCounting starts an instance running counterScript with a tmpfs file next to it, and waits
// until the counter moves.
func (e *env) startCounting() (sp runtime.Spec, pid string) {
	e.t.Helper()
	sp = e.start()
	e.sh(sp.ID, 0, "echo kept-in-memory > /dev/shm/f")
	pid = e.spawn(sp.ID, counterScript)
	if n := e.waitCount(sp.ID, 3); n < 3 {
		e.t.Fatalf("counter did not start: %d", n)
	}
	return sp, pid
}

// count reads the counter of instance id.
func (e *env) count(id string) int {
	e.t.Helper()
	out := strings.TrimSpace(e.sh(id, 0, "cat /dev/shm/count 2>/dev/null || echo 0"))
	n, err := strconv.Atoi(out)
	if err != nil {
		e.t.Fatalf("counter of %s: %q", id, out)
	}
	return n
}

// waitCount waits (10 s at most) until id's counter reaches at least n and returns it.
func (e *env) waitCount(id string, n int) int {
	e.t.Helper()
	var got int
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(counterStep) {
		if got = e.count(id); got >= n {
			break
		}
	}
	return got
}

// frozenFor checks that id is frozen, keeps it frozen for d and thaws it; it returns the
// counter read just before the freeze and just after the thaw, and the wall time between the
// two reads.
func (e *env) frozenFor(id string, d time.Duration) (before, after int, between time.Duration) {
	e.t.Helper()
	before = e.count(id)
	t0 := time.Now()
	if err := e.d.Freeze(ctx(e.t), id); err != nil {
		e.t.Fatalf("Freeze(%s): %v", id, err)
	}
	e.assertFrozen(id, true)
	time.Sleep(d)
	if err := e.d.Thaw(ctx(e.t), id); err != nil {
		e.t.Fatalf("Thaw(%s): %v", id, err)
	}
	after = e.count(id)
	return before, after, time.Since(t0)
}

func (e *env) assertFrozen(id string, want bool) {
	e.t.Helper()
	st, err := e.d.State(ctx(e.t), id)
	if err != nil || st.State != runtime.StateRunning || st.Frozen != want || st.Pid <= 0 {
		e.t.Fatalf("State(%s) = %+v, %v; want running with Frozen=%v and a pid", id, st, err, want)
	}
}

// assertStoodStill checks the counter advanced by no more than the time it ran allows: the
// reads bracket a freeze of frozen out of between, so at most (between-frozen)/step steps, plus
// two for the reads' own rounding. Without the freeze it would have made frozen/step more.
func assertStoodStill(t *testing.T, before, after int, between, frozen time.Duration) {
	t.Helper()
	ran := between - frozen
	allowed := int(ran/counterStep) + 2
	if after < before {
		t.Fatalf("counter went back across the freeze: %d -> %d", before, after)
	}
	if after-before > allowed {
		t.Errorf("counter advanced %d steps across a %v freeze (%v between the reads, so at most %d if nothing ran while frozen)",
			after-before, frozen, between, allowed)
	}
}

// testFreezeThaw: a frozen instance keeps its processes and memory and runs nothing; thawed, a
// process continues from where it stopped, and tmpfs (memory-only) files are there.
func (s *suite) testFreezeThaw(t *testing.T) {
	e := s.env(t)
	sp, pid := e.startCounting()
	c := ctx(t)

	const hold = 1500 * time.Millisecond
	before, after, between := e.frozenFor(sp.ID, hold)
	assertStoodStill(t, before, after, between, hold)
	e.assertFrozen(sp.ID, false)
	if later := e.waitCount(sp.ID, after+3); later < after+3 {
		t.Errorf("counter after thaw: %d, then %d: does not run on", after, later)
	}
	if got := e.sh(sp.ID, 0, "cat /dev/shm/f; kill -0 "+pid+" && echo same-process"); got != "kept-in-memory\nsame-process\n" {
		t.Errorf("after thaw: %q", got)
	}

	t.Run("idempotent and refused where it makes no sense", func(t *testing.T) {
		if err := e.d.Thaw(c, sp.ID); err != nil {
			t.Errorf("Thaw of a running instance: %v, want nil", err)
		}
		if err := e.d.Freeze(c, sp.ID); err != nil {
			t.Fatalf("Freeze: %v", err)
		}
		if err := e.d.Freeze(c, sp.ID); err != nil {
			t.Errorf("Freeze of a frozen instance: %v, want nil", err)
		}
		e.assertFrozen(sp.ID, true)
		if _, _, err := e.d.Exec(c, sp.ID, []string{"true"}); !errors.Is(err, errdefs.ErrConflict) {
			t.Errorf("Exec in a frozen instance: %v, want ErrConflict", err)
		}
		if st, err := e.d.Stats(c, sp.ID); err != nil || st.MemoryBytes == 0 {
			t.Errorf("Stats of a frozen instance: %+v, %v", st, err)
		}
		if err := e.d.Thaw(c, sp.ID); err != nil {
			t.Fatalf("Thaw: %v", err)
		}
		e.assertFrozen(sp.ID, false)
		if err := e.d.Freeze(c, "dt-nosuchthing"); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("Freeze of an unknown id: %v, want ErrNotFound", err)
		}
		if err := e.d.Thaw(c, "dt-nosuchthing"); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("Thaw of an unknown id: %v, want ErrNotFound", err)
		}
		stopped := e.start()
		if err := e.d.Kill(c, stopped.ID); err != nil {
			t.Fatal(err)
		}
		if err := e.d.Freeze(c, stopped.ID); !errors.Is(err, errdefs.ErrConflict) {
			t.Errorf("Freeze of a stopped instance: %v, want ErrConflict", err)
		}
	})
}

// testFrozenCheckpoint: a frozen instance can be checkpointed; with LeaveRunning it stays frozen
// (and nothing runs during or after the checkpoint until Thaw); the image restores into an
// instance that runs the processes with their memory; without LeaveRunning it stops.
func (s *suite) testFrozenCheckpoint(t *testing.T) {
	e := s.env(t)
	sp, pid := e.startCounting()
	c := ctx(t)

	before := e.count(sp.ID)
	t0 := time.Now()
	if err := e.d.Freeze(c, sp.ID); err != nil {
		t.Fatalf("Freeze: %v", err)
	}
	img := t.TempDir()
	if err := e.d.Checkpoint(c, sp.ID, img, runtime.CheckpointOptions{LeaveRunning: true}); err != nil {
		t.Fatalf("Checkpoint(LeaveRunning) of a frozen instance: %v", err)
	}
	e.assertFrozen(sp.ID, true)
	const hold = time.Second
	time.Sleep(hold)
	frozenFor := time.Since(t0)
	if err := e.d.Thaw(c, sp.ID); err != nil {
		t.Fatalf("Thaw after the checkpoint: %v", err)
	}
	after := e.count(sp.ID)
	assertStoodStill(t, before, after, time.Since(t0), frozenFor)
	if later := e.waitCount(sp.ID, after+3); later < after+3 {
		t.Errorf("counter after thaw: %d, then %d: does not run on", after, later)
	}

	restored := e.spec()
	e.restore(restored, img)
	e.assertFrozen(restored.ID, false)
	n := e.count(restored.ID)
	if n < before {
		t.Errorf("restored counter %d, want %d or more (it was %d at the freeze)", n, before, before)
	}
	if later := e.waitCount(restored.ID, n+3); later < n+3 {
		t.Errorf("restored counter: %d, then %d: does not run", n, later)
	}
	if got := e.sh(restored.ID, 0, "cat /dev/shm/f; kill -0 "+pid+" && echo same-process"); got != "kept-in-memory\nsame-process\n" {
		t.Errorf("restored from a frozen instance's checkpoint: %q", got)
	}

	t.Run("without LeaveRunning", func(t *testing.T) {
		if err := e.d.Freeze(c, sp.ID); err != nil {
			t.Fatalf("Freeze: %v", err)
		}
		img := t.TempDir()
		if err := e.d.Checkpoint(c, sp.ID, img, runtime.CheckpointOptions{}); err != nil {
			t.Fatalf("Checkpoint of a frozen instance: %v", err)
		}
		if st, err := e.d.State(c, sp.ID); err == nil && st.State == runtime.StateRunning {
			t.Fatalf("State after Checkpoint without LeaveRunning = %+v", st)
		}
		AssertNoProcesses(t, sp.ID)
		resumed := sp
		resumed.StateDir = filepath.Join(e.t.TempDir(), "resumed") // outlives the subtest (track)
		e.restore(resumed, img)
		if got := e.sh(sp.ID, 0, "cat /dev/shm/f; kill -0 "+pid+" && echo same-process"); got != "kept-in-memory\nsame-process\n" {
			t.Errorf("resumed from a frozen instance's checkpoint: %q", got)
		}
		if n := e.count(sp.ID); e.waitCount(sp.ID, n+2) < n+2 {
			t.Errorf("resumed counter does not run")
		}
	})
}

// testKillFrozen: Kill and Delete of a frozen instance stop it and leave nothing behind.
func (s *suite) testKillFrozen(t *testing.T) {
	e := s.env(t)
	c := ctx(t)
	sp, _ := e.startCounting()
	if err := e.d.Freeze(c, sp.ID); err != nil {
		t.Fatalf("Freeze: %v", err)
	}
	if err := e.d.Kill(c, sp.ID); err != nil {
		t.Fatalf("Kill of a frozen instance: %v", err)
	}
	if got := e.state(sp.ID); got != runtime.StateStopped {
		t.Fatalf("State after Kill = %s, want stopped", got)
	}
	if err := e.d.Thaw(c, sp.ID); !errors.Is(err, errdefs.ErrConflict) {
		t.Errorf("Thaw of a killed instance: %v, want ErrConflict", err)
	}
	if err := e.d.Delete(c, sp.ID); err != nil {
		t.Fatalf("Delete: %v", err)
	}
	AssertNoLeftovers(t, sp.ID)

	t.Run("delete frozen", func(t *testing.T) {
		sp, _ := e.startCounting()
		if err := e.d.Freeze(c, sp.ID); err != nil {
			t.Fatalf("Freeze: %v", err)
		}
		if err := e.d.Delete(c, sp.ID); err != nil {
			t.Fatalf("Delete of a frozen instance: %v", err)
		}
		if _, err := e.d.State(c, sp.ID); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("State after Delete = %v, want ErrNotFound", err)
		}
		AssertNoLeftovers(t, sp.ID)
	})
}
