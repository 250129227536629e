package sandbox_test

import (
	"context"
	"errors"
	"github.com/ember-sandbox/ember/internal/datadir"
	"github.com/ember-sandbox/ember/internal/envdclient"
	"github.com/ember-sandbox/ember/internal/testutil"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/sandbox/sandboxtest"
	"github.com/ember-sandbox/ember/internal/snapshot"
	"github.com/ember-sandbox/ember/internal/snapshot/local"
)

// The tier state machine of hot pauses (hotpause.go) over the fake driver.

func (n *node) get(id string) *sandbox.Sandbox {
	n.t.Helper()
	sb, err := n.m.Get(context.Background(), id)
	if err != nil {
		n.t.Fatalf("get %s: %v", id, err)
	}
	return sb
}

func (n *node) frozen(inst string) bool {
	st, err := n.rig.Driver.State(context.Background(), inst)
	return err == nil && st.State == runtime.StateRunning && st.Frozen
}

// onDisk waits until the background checkpoint of hot-paused id is recorded.
func (n *node) onDisk(id string) *sandbox.Sandbox {
	n.t.Helper()
	testutil.Eventually(n.t, 5*time.Second, "state on disk", func() bool { return n.get(id).Runtime.Image != "" })
	return n.get(id)
}

func (n *node) memOf(id, key string) (int, string) {
	return n.guest(id, http.MethodGet, "/fake/mem?path="+key, "")
}

// A memory pause freezes the sandbox in place: same instance and slot, nothing restored; a
// resume thaws it with its memory and files, and restarts its timeout clock.
func TestHotPauseKeepsTheInstanceAndThaws(t *testing.T) {
	n := newNode(t, nil)
	n.build("base")
	ctx := context.Background()
	sb := n.create(sandbox.CreateRequest{})
	n.write(sb.ID, "/f", "file")
	n.putMem(sb.ID, "proc", "running")
	restores := n.rig.Driver.Calls("Restore") + n.rig.Driver.Calls("RestoreInto")
	if err := n.m.Pause(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	got := n.get(sb.ID)
	if got.State != sandbox.StatePaused || got.Tier() != sandbox.TierMemory || got.Runtime.InstanceID != sb.Runtime.InstanceID {
		t.Fatalf("after a hot pause: state %s tier %s instance %s", got.State, got.Tier(), got.Runtime.InstanceID)
	}
	if !n.frozen(sb.Runtime.InstanceID) {
		t.Fatal("the paused sandbox's instance is not frozen")
	}
	if !slices.Contains(n.rig.Network.InUse(), sb.Runtime.SlotIndex) {
		t.Fatal("the paused sandbox's slot was released")
	}
	if _, err := n.m.GuestURL(ctx, sb.ID, envdclient.Port); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("guest url of a paused sandbox: %v", err)
	}
	if err := n.m.Pause(ctx, sb.ID); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("second pause: %v", err)
	}
	n.onDisk(sb.ID) // the background checkpoint; the instance stays frozen
	if !n.frozen(sb.Runtime.InstanceID) || n.get(sb.ID).Tier() != sandbox.TierMemory {
		t.Fatal("the background checkpoint thawed or demoted the sandbox")
	}
	before := time.Now()
	res, resumed, err := n.m.Connect(ctx, sb.ID, time.Minute)
	if err != nil || !resumed {
		t.Fatalf("resume: %v %v", resumed, err)
	}
	if res.Runtime.InstanceID != sb.Runtime.InstanceID || res.Runtime.SlotIndex != sb.Runtime.SlotIndex || res.AccessToken != sb.AccessToken {
		t.Fatalf("resume moved the sandbox: %+v", res.Runtime)
	}
	if res.Tier() != "" || res.Runtime.Image != "" || res.EndAt.Before(before.Add(time.Minute-time.Second)) {
		t.Fatalf("resumed record: tier %q image %q endAt %v", res.Tier(), res.Runtime.Image, res.EndAt)
	}
	if n.frozen(sb.Runtime.InstanceID) {
		t.Fatal("still frozen after the resume")
	}
	if r := n.rig.Driver.Calls("Restore") + n.rig.Driver.Calls("RestoreInto"); r != restores {
		t.Fatalf("the resume restored (%d restores, was %d)", r, restores)
	}
	if code, v := n.memOf(sb.ID, "proc"); code != http.StatusOK || v != "running" {
		t.Fatalf("memory after the thaw: %d %q", code, v)
	}
	if v, _ := n.read(sb.ID, "/f"); v != "file" {
		t.Fatalf("file after the thaw: %q", v)
	}
	testutil.Eventually(t, 2*time.Second, "the stale image removed", func() bool {
		imgs, _ := filepath.Glob(filepath.Join(datadir.Sandbox(n.cfg.DataDir, sb.ID), "image-*"))
		return len(imgs) == 0
	})
	// A running sandbox's timeout still works, and a kill leaves nothing.
	if err := n.m.Pause(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	if err := n.m.Kill(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	n.assertHolds(0)
	if dirs := n.sandboxDirs(); len(dirs) != 0 {
		t.Fatalf("dirs left: %v", dirs)
	}
}

// The checkpoint pause stays available (per call and per node); a filesystem-only pause is
// unchanged: both end the instance.
func TestCheckpointAndFilesOnlyPausesEndTheInstance(t *testing.T) {
	n := newNode(t, nil)
	n.build("base")
	ctx := context.Background()
	for _, opts := range []sandbox.PauseOptions{{KeepMemory: true, Mode: sandbox.PauseCheckpoint}, {KeepMemory: false}} {
		sb := n.create(sandbox.CreateRequest{})
		n.write(sb.ID, "/f", "file")
		if err := n.m.PauseWith(ctx, sb.ID, opts); err != nil {
			t.Fatal(err)
		}
		if got := n.get(sb.ID); got.Tier() != sandbox.TierDisk || got.Runtime.InstanceID != "" {
			t.Fatalf("%+v: tier %s instance %q", opts, got.Tier(), got.Runtime.InstanceID)
		}
		testutil.Eventually(t, 2*time.Second, "instance gone", func() bool { return !slices.Contains(n.rig.Driver.Running(), sb.Runtime.InstanceID) })
		if _, _, err := n.m.Connect(ctx, sb.ID, time.Minute); err != nil {
			t.Fatal(err)
		}
		if v, _ := n.read(sb.ID, "/f"); v != "file" {
			t.Fatalf("file: %q", v)
		}
		n.m.Kill(ctx, sb.ID)
	}
}

// A sandbox that stays paused in memory (PausedReduceAfter, its state on disk) has its instance
// give back what the save took (gVisor's sentry keeps the save's garbage until its forced
// collection, minutes later: 2.6 MiB more paused than running), once, and the paused-memory
// budget counts what is left. One resumed before that is not asked.
func TestPausedSandboxGivesBackWhatItsCheckpointTook(t *testing.T) {
	n := newNode(t, func(c *sandbox.Config) { c.PausedReduceAfter = 300 * time.Millisecond })
	d := n.rig.Driver
	d.Memory = func(string) uint64 {
		if d.Calls("ReduceMemory") > 0 {
			return 20 << 20
		}
		return 30 << 20
	}
	n.build("base")
	ctx := context.Background()
	quick := n.create(sandbox.CreateRequest{}) // an agent's step: resumed well before
	if err := n.m.Pause(ctx, quick.ID); err != nil {
		t.Fatal(err)
	}
	n.onDisk(quick.ID)
	if _, _, err := n.m.Connect(ctx, quick.ID, time.Minute); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond) // past PausedReduceAfter and a tier round
	if c := d.Calls("ReduceMemory"); c != 0 {
		t.Fatalf("a sandbox resumed within PausedReduceAfter was reduced (%d calls)", c)
	}
	sb := n.create(sandbox.CreateRequest{})
	n.putMem(sb.ID, "k", "v")
	if err := n.m.Pause(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	n.onDisk(sb.ID)
	testutil.Eventually(t, 5*time.Second, "the budget counts the reduced memory", func() bool {
		_, mib := n.m.PausedMemory()
		return mib == 20
	})
	if !n.frozen(sb.Runtime.InstanceID) {
		t.Fatal("the instance is no longer frozen after its memory was reduced")
	}
	time.Sleep(1500 * time.Millisecond)
	if c := d.Calls("ReduceMemory"); c != 1 {
		t.Fatalf("%d reduce calls for one pause, want 1", c)
	}
	if _, _, err := n.m.Connect(ctx, sb.ID, time.Minute); err != nil {
		t.Fatal(err)
	}
	if code, v := n.memOf(sb.ID, "k"); code != http.StatusOK || v != "v" {
		t.Fatalf("memory after resume: %d %q", code, v)
	}
}

// Over the paused-memory budget the least recently paused sandboxes go to disk first: their
// instance and slot are released, and their resume restores with memory and files.
func TestDemotionUnderBudgetIsLRU(t *testing.T) {
	n := newNode(t, func(c *sandbox.Config) { c.PausedMemoryMB = 25; c.PrestartMax = 0 })
	n.rig.Driver.Memory = func(string) uint64 { return 10 << 20 }
	n.build("base")
	ctx := context.Background()
	var sbs []*sandbox.Sandbox
	for i := 0; i < 3; i++ {
		sb := n.create(sandbox.CreateRequest{})
		n.putMem(sb.ID, "i", string(rune('a'+i)))
		sbs = append(sbs, sb)
	}
	for _, sb := range sbs {
		if err := n.m.Pause(ctx, sb.ID); err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond) // distinct pause times
	}
	testutil.Eventually(t, 5*time.Second, "the oldest demoted", func() bool { return n.get(sbs[0].ID).Tier() == sandbox.TierDisk })
	time.Sleep(1500 * time.Millisecond) // a tier round more: nothing else goes
	for i, want := range []string{sandbox.TierDisk, sandbox.TierMemory, sandbox.TierMemory} {
		if got := n.get(sbs[i].ID).Tier(); got != want {
			t.Fatalf("sandbox %d: tier %s, want %s", i, got, want)
		}
	}
	if slices.Contains(n.rig.Driver.Running(), sbs[0].Runtime.InstanceID) || slices.Contains(n.rig.Network.InUse(), sbs[0].Runtime.SlotIndex) {
		t.Fatal("the demoted sandbox still holds its instance or slot")
	}
	if c, mib := n.m.PausedMemory(); c != 2 || mib != 20 {
		t.Fatalf("paused memory: %d sandboxes, %d MiB", c, mib)
	}
	for i, sb := range sbs {
		res, _, err := n.m.Connect(ctx, sb.ID, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if thawed := res.Runtime.InstanceID == sb.Runtime.InstanceID; thawed != (i > 0) {
			t.Fatalf("sandbox %d: thawed %v", i, thawed)
		}
		if code, v := n.memOf(sb.ID, "i"); code != http.StatusOK || v != string(rune('a'+i)) {
			t.Fatalf("sandbox %d memory after resume: %d %q", i, code, v)
		}
	}
}

// A sandbox paused in memory longer than HotPauseMax goes to disk.
func TestDemotionAfterHotPauseMax(t *testing.T) {
	n := newNode(t, func(c *sandbox.Config) { c.HotPauseMax = 300 * time.Millisecond })
	n.build("base")
	sb := n.create(sandbox.CreateRequest{})
	n.putMem(sb.ID, "k", "v")
	if err := n.m.Pause(context.Background(), sb.ID); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 5*time.Second, "demoted", func() bool { return n.get(sb.ID).Tier() == sandbox.TierDisk })
	if _, _, err := n.m.Connect(context.Background(), sb.ID, time.Minute); err != nil {
		t.Fatal(err)
	}
	if code, v := n.memOf(sb.ID, "k"); code != http.StatusOK || v != "v" {
		t.Fatalf("memory: %d %q", code, v)
	}
}

// blockCheckpoints makes the driver's checkpoints of LeaveRunning kind (the background one)
// wait until release is closed; started receives each.
func blockCheckpoints(n *node) (started chan string, release chan struct{}) {
	started, release = make(chan string, 8), make(chan struct{})
	n.rig.Driver.Fail = func(op, id string) error {
		if op == "Checkpoint" {
			started <- id
			<-release
		}
		return nil
	}
	return started, release
}

// A resume during the background checkpoint waits for it and thaws; a kill during it waits too
// and leaves nothing.
func TestResumeAndKillDuringTheBackgroundCheckpoint(t *testing.T) {
	n := newNode(t, nil)
	n.build("base")
	ctx := context.Background()
	started, release := blockCheckpoints(n)
	sb := n.create(sandbox.CreateRequest{})
	n.putMem(sb.ID, "k", "v")
	if err := n.m.Pause(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	<-started
	var done atomic.Bool
	go func() {
		n.m.Connect(ctx, sb.ID, time.Minute)
		done.Store(true)
	}()
	time.Sleep(200 * time.Millisecond)
	if done.Load() {
		t.Fatal("the resume did not wait for the background checkpoint")
	}
	close(release)
	testutil.Eventually(t, 5*time.Second, "resumed", func() bool { return done.Load() })
	if got := n.get(sb.ID); got.State != sandbox.StateRunning || got.Runtime.InstanceID != sb.Runtime.InstanceID {
		t.Fatalf("after the resume: %s %s", got.State, got.Runtime.InstanceID)
	}
	if code, v := n.memOf(sb.ID, "k"); code != http.StatusOK || v != "v" {
		t.Fatalf("memory: %d %q", code, v)
	}
	testutil.Eventually(t, 2*time.Second, "the checkpoint's image removed", func() bool {
		imgs, _ := filepath.Glob(filepath.Join(datadir.Sandbox(n.cfg.DataDir, sb.ID), "image-*"))
		return len(imgs) == 0
	})

	started, release = blockCheckpoints(n)
	if err := n.m.Pause(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	<-started
	done.Store(false)
	go func() {
		n.m.Kill(ctx, sb.ID)
		done.Store(true)
	}()
	time.Sleep(100 * time.Millisecond)
	close(release)
	testutil.Eventually(t, 5*time.Second, "killed", func() bool { return done.Load() })
	n.assertHolds(0)
	if dirs := n.sandboxDirs(); len(dirs) != 0 {
		t.Fatalf("dirs left: %v", dirs)
	}
}

// An instance that dies while paused in memory: the sandbox is paused on disk if its state got
// there, else it ended as lost.
func TestHotInstanceDeathFallsBackToDisk(t *testing.T) {
	n := newNode(t, func(c *sandbox.Config) { c.PrestartMax = 0 })
	n.build("base")
	ctx := context.Background()
	sb := n.create(sandbox.CreateRequest{})
	n.putMem(sb.ID, "k", "v")
	n.m.Pause(ctx, sb.ID)
	n.onDisk(sb.ID)
	n.rig.Driver.Crash(sb.Runtime.InstanceID, runtime.ExitKilled)
	testutil.Eventually(t, 2*time.Second, "on disk", func() bool { return n.get(sb.ID).Tier() == sandbox.TierDisk })
	if _, _, err := n.m.Connect(ctx, sb.ID, time.Minute); err != nil {
		t.Fatal(err)
	}
	if code, v := n.memOf(sb.ID, "k"); code != http.StatusOK || v != "v" {
		t.Fatalf("memory: %d %q", code, v)
	}

	n.rig.Driver.Fail = func(op, id string) error {
		if op == "Checkpoint" {
			return errors.New("disk full")
		}
		return nil
	}
	other := n.create(sandbox.CreateRequest{})
	n.m.Pause(ctx, other.ID)
	time.Sleep(100 * time.Millisecond)
	n.rig.Driver.Crash(other.Runtime.InstanceID, runtime.ExitKilled)
	testutil.Eventually(t, 2*time.Second, "ended", func() bool {
		_, err := n.m.Get(ctx, other.ID)
		return errors.Is(err, errdefs.ErrNotFound)
	})
}

// kill9 stops the Manager as a crash would leave the node: instances and files as they are (the
// fake's instances outlive the Manager); Close is graceful, but its effects on what this test
// looks at (instances, records) are none for paused and running sandboxes.
func (n *node) kill9() {
	n.m.Close()
	n.m = nil
}

// kill -9 at every step of a hot pause's life loses nothing: after the freeze (unrecorded), with
// a half-written background checkpoint, during a demotion (recorded on disk, instance alive),
// and after a thaw (unrecorded).
func TestHotPauseSurvivesCrashAtEveryStep(t *testing.T) {
	ctx := context.Background()
	check := func(t *testing.T, n *node, sb *sandbox.Sandbox, wantTier string, wantThaw bool) {
		t.Helper()
		got := n.get(sb.ID)
		if got.State != sandbox.StatePaused || got.Tier() != wantTier {
			t.Fatalf("after restart: %s in %q, want paused in %s", got.State, got.Tier(), wantTier)
		}
		res, _, err := n.m.Connect(ctx, sb.ID, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if thawed := res.Runtime.InstanceID == sb.Runtime.InstanceID; thawed != wantThaw {
			t.Fatalf("thawed %v, want %v", thawed, wantThaw)
		}
		if code, v := n.memOf(sb.ID, "k"); code != http.StatusOK || v != "v" {
			t.Fatalf("memory: %d %q", code, v)
		}
		if v, _ := n.read(sb.ID, "/f"); v != "file" {
			t.Fatalf("file: %q", v)
		}
		if got := n.rig.Driver.Running(); len(got) != 1 {
			t.Fatalf("instances: %v", got)
		}
	}
	setup := func(t *testing.T) (*node, *sandbox.Sandbox) {
		n := newNode(t, func(c *sandbox.Config) { c.PrestartMax = 0 })
		n.build("base")
		sb := n.create(sandbox.CreateRequest{})
		n.write(sb.ID, "/f", "file")
		n.putMem(sb.ID, "k", "v")
		return n, sb
	}
	t.Run("after the freeze", func(t *testing.T) {
		n, sb := setup(t)
		n.kill9()
		// What hotPauseLocked had done: its marker, the freeze.
		os.WriteFile(filepath.Join(datadir.Sandbox(n.cfg.DataDir, sb.ID), ".ember-pausing"), nil, 0o600)
		n.rig.Driver.Freeze(ctx, sb.Runtime.InstanceID)
		n.start()
		check(t, n, sb, sandbox.TierMemory, true)
	})
	t.Run("frozen by a cut snapshot", func(t *testing.T) {
		// A snapshot's or fork's checkpoint freezes the instance for its length: cut by the
		// crash, the sandbox runs on.
		n, sb := setup(t)
		n.kill9()
		n.rig.Driver.Freeze(ctx, sb.Runtime.InstanceID)
		n.start()
		if got := n.get(sb.ID); got.State != sandbox.StateRunning || n.frozen(sb.Runtime.InstanceID) {
			t.Fatalf("after restart: %s, frozen %v; want running, thawed", got.State, n.frozen(sb.Runtime.InstanceID))
		}
		if code, v := n.memOf(sb.ID, "k"); code != http.StatusOK || v != "v" {
			t.Fatalf("memory: %d %q", code, v)
		}
	})
	t.Run("during the background checkpoint", func(t *testing.T) {
		n, sb := setup(t)
		n.m.Pause(ctx, sb.ID)
		rec := n.onDisk(sb.ID)
		n.kill9()
		// What a checkpoint the crash cut leaves: a half-written image, no mark, a record that
		// does not name it.
		hot := rec.Runtime.HotImage
		os.Remove(filepath.Join(hot, ".ember-complete"))
		os.WriteFile(filepath.Join(hot, "checkpoint.img"), []byte("{half"), 0o600)
		rec.Runtime.Image = ""
		if err := n.store.PutSandbox(ctx, rec); err != nil {
			t.Fatal(err)
		}
		// Demoted once its state is on disk again: the resume restores from the image the
		// restarted node wrote, not the half one.
		n.cfg.HotPauseMax = 200 * time.Millisecond
		n.start()
		testutil.Eventually(t, 5*time.Second, "demoted", func() bool { return n.get(sb.ID).Tier() == sandbox.TierDisk })
		check(t, n, sb, sandbox.TierDisk, false)
	})
	t.Run("during a demotion", func(t *testing.T) {
		n, sb := setup(t)
		n.m.Pause(ctx, sb.ID)
		rec := n.onDisk(sb.ID)
		n.kill9()
		// The record says disk; the instance was not ended yet.
		rec.Runtime = sandbox.Placement{Image: rec.Runtime.Image, SlotIndex: -1}
		rec.PausedIn = sandbox.TierDisk
		if err := n.store.PutSandbox(ctx, rec); err != nil {
			t.Fatal(err)
		}
		n.start()
		if slices.Contains(n.rig.Driver.Running(), sb.Runtime.InstanceID) {
			t.Fatal("the demoted sandbox's instance was kept")
		}
		check(t, n, sb, sandbox.TierDisk, false)
	})
	t.Run("after a thaw", func(t *testing.T) {
		n, sb := setup(t)
		n.m.Pause(ctx, sb.ID)
		n.onDisk(sb.ID)
		n.kill9()
		n.rig.Driver.Thaw(ctx, sb.Runtime.InstanceID)
		n.start()
		if !n.frozen(sb.Runtime.InstanceID) {
			t.Fatal("a paused record's thawed instance was not frozen again")
		}
		check(t, n, sb, sandbox.TierMemory, true)
	})
	t.Run("instance gone, state on disk", func(t *testing.T) {
		n, sb := setup(t)
		n.m.Pause(ctx, sb.ID)
		n.onDisk(sb.ID)
		n.kill9()
		n.rig.Driver.Delete(ctx, sb.Runtime.InstanceID)
		n.start()
		check(t, n, sb, sandbox.TierDisk, false)
	})
}

// In StorePauses mode (cluster) the pause answers once the state is in the store, and the
// sandbox stays in memory: a resume here is a thaw, reported resumed (the cluster then drops
// the stored image, which is stale).
func TestStoredHotPauseThawsHere(t *testing.T) {
	dir := t.TempDir()
	backend, err := local.New(filepath.Join(dir, "snapshots"))
	if err != nil {
		t.Fatal(err)
	}
	rec := &recorder{}
	n := newNode(t, func(c *sandbox.Config) {
		c.Images = imageStore{snapshot.New(backend)}
		c.StorePauses = true
		c.Listeners = []sandbox.Listener{rec}
		c.Driver = porter{c.Driver.(*sandboxtest.Driver)}
	})
	ctx := context.Background()
	n.build("base")
	sb := n.create(sandbox.CreateRequest{})
	n.putMem(sb.ID, "k", "v")
	if err := n.m.Pause(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	rec.want(t, sb.ID, "started:created", "paused", "stored")
	if got := n.get(sb.ID); got.Tier() != sandbox.TierMemory || got.Runtime.Image == "" || !n.frozen(sb.Runtime.InstanceID) {
		t.Fatalf("after a stored pause: tier %s image %q", got.Tier(), got.Runtime.Image)
	}
	res, _, err := n.m.Connect(ctx, sb.ID, time.Minute)
	if err != nil || res.Runtime.InstanceID != sb.Runtime.InstanceID {
		t.Fatalf("resume: %v, instance %s", err, res.Runtime.InstanceID)
	}
	rec.want(t, sb.ID, "started:created", "paused", "stored", "resumed")
	if code, v := n.memOf(sb.ID, "k"); code != http.StatusOK || v != "v" {
		t.Fatalf("memory: %d %q", code, v)
	}
}
