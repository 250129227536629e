package sandbox_test

import (
	"context"
	"errors"
	"github.com/ember-sandbox/ember/internal/testutil"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

func (n *node) writeMem(id, key, v string) {
	n.t.Helper()
	if code, msg := n.guest(id, http.MethodPut, "/fake/mem?path="+key, v); code != http.StatusNoContent {
		n.t.Fatalf("write mem %s in %s: %d %s", key, id, code, msg)
	}
}

func (n *node) readMem(id, key string) string {
	n.t.Helper()
	_, body := n.guest(id, http.MethodGet, "/fake/mem?path="+key, "")
	return body
}

// settleHolds waits (bounded) until n holds want instances and slots: a rollback ends the old
// instance after its answer.
func (n *node) settleHolds(want int) {
	n.t.Helper()
	testutil.Eventually(n.t, 5*time.Second, "the old instance ended", func() bool {
		return len(n.rig.Driver.Running()) == want && len(n.rig.Network.InUse()) == want
	})
}

func (n *node) checkpoint(id string) *sandbox.Checkpoint {
	n.t.Helper()
	ck, err := n.m.Checkpoint(context.Background(), id)
	if err != nil {
		n.t.Fatalf("checkpoint %s: %v", id, err)
	}
	return ck
}

// expectState checks that sandbox id reads file /f and memory m as want.
func (n *node) expectState(id, want string) {
	n.t.Helper()
	if v, err := n.read(id, "/f"); v != want {
		n.t.Fatalf("file /f of %s: %q %v, want %q", id, v, err, want)
	}
	if v := n.readMem(id, "m"); v != want {
		n.t.Fatalf("memory m of %s: %q, want %q", id, v, want)
	}
}

// Checkpoints and rollback over the fake driver, with and without captured layers: files and
// memory return, the tree's parents follow the head, forks and snapshots start from any
// checkpoint, errors are the right kind, and everything goes with the sandbox.
func TestCheckpointRollbackTree(t *testing.T) {
	for _, capture := range []bool{true, false} {
		name := "copied-layer"
		if capture {
			name = "captured-layer"
		}
		t.Run(name, func(t *testing.T) { testCheckpointRollbackTree(t, capture) })
	}
}

func testCheckpointRollbackTree(t *testing.T, capture bool) {
	n := newNode(t, nil)
	n.rig.Driver.SetCapturesLayers(capture)
	n.m.CheckpointStandby(false) // every rollback restores (TestRollbackStandby swaps)
	n.build("base")
	ctx := context.Background()
	sb := n.create(sandbox.CreateRequest{})
	other := n.create(sandbox.CreateRequest{})

	n.write(sb.ID, "/f", "1")
	n.writeMem(sb.ID, "m", "1")
	a := n.checkpoint(sb.ID)
	if a.ParentID != "" || a.SandboxID != sb.ID || !sandbox.CheckpointIDRe.MatchString(a.ID) {
		t.Fatalf("first checkpoint %+v", a)
	}
	n.write(sb.ID, "/f", "2")
	n.writeMem(sb.ID, "m", "2")
	b := n.checkpoint(sb.ID)
	if b.ParentID != a.ID {
		t.Fatalf("B's parent %q, want A %q", b.ParentID, a.ID)
	}
	n.write(sb.ID, "/f", "3")
	n.writeMem(sb.ID, "m", "3")

	// Rollback to A: same sandbox, A's files and memory, on a new instance.
	got, err := n.m.Rollback(ctx, sb.ID, a.ID)
	if err != nil {
		t.Fatal(err)
	}
	if got.ID != sb.ID || got.AccessToken != sb.AccessToken || got.Runtime.InstanceID == sb.Runtime.InstanceID || got.CheckpointHead != a.ID {
		t.Fatalf("after rollback: %+v (was %+v)", got, sb)
	}
	n.expectState(sb.ID, "1")
	n.settleHolds(2) // the old instance ended
	// Branch: C's parent is A.
	n.write(sb.ID, "/f", "4")
	n.writeMem(sb.ID, "m", "4")
	c := n.checkpoint(sb.ID)
	if c.ParentID != a.ID {
		t.Fatalf("C's parent %q, want A %q", c.ParentID, a.ID)
	}
	tree, err := n.m.ListCheckpoints(ctx, sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	if len(tree.Checkpoints) != 3 || tree.Head != c.ID {
		t.Fatalf("tree %+v", tree)
	}
	// Rolling back twice to one checkpoint gives it as it was (the rollback wrote over it).
	if _, err := n.m.Rollback(ctx, sb.ID, b.ID); err != nil {
		t.Fatal(err)
	}
	n.expectState(sb.ID, "2")
	if _, err := n.m.Rollback(ctx, sb.ID, a.ID); err != nil {
		t.Fatal(err)
	}
	n.expectState(sb.ID, "1")

	// Hostile and wrong ids: not found, as not found.
	oc := n.checkpoint(other.ID)
	for _, cid := range []string{"ckpt-000000000000", oc.ID, "../" + a.ID, ""} {
		_, err := n.m.Rollback(ctx, sb.ID, cid)
		var nf *sandbox.CheckpointNotFoundError
		if !errors.As(err, &nf) || !errors.Is(err, errdefs.ErrNotFound) {
			t.Fatalf("rollback to %q: %v", cid, err)
		}
		if _, err := n.m.ForkCheckpoint(ctx, sb.ID, cid, 1, 0); !errors.As(err, &nf) {
			t.Fatalf("fork from %q: %v", cid, err)
		}
		if err := n.m.DeleteCheckpoint(ctx, sb.ID, cid); !errors.As(err, &nf) {
			t.Fatalf("delete %q: %v", cid, err)
		}
	}
	// Delete B: gone for good; its image is removed.
	if err := n.m.DeleteCheckpoint(ctx, sb.ID, b.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(b.Image); !os.IsNotExist(err) {
		t.Fatalf("deleted checkpoint's image: %v", err)
	}
	if _, err := n.m.Rollback(ctx, sb.ID, b.ID); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("rollback to a deleted checkpoint: %v", err)
	}

	// Fork from A (not the head) and promote C to a snapshot.
	kids, err := n.m.ForkCheckpoint(ctx, sb.ID, a.ID, 2, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range kids {
		if k.Err != nil {
			t.Fatal(k.Err)
		}
		if k.Sandbox.ID == sb.ID || k.Sandbox.AccessToken == sb.AccessToken {
			t.Fatalf("fork child shares the identity of its source")
		}
		n.expectState(k.Sandbox.ID, "1")
	}
	snap, err := n.m.SnapshotCheckpoint(ctx, sb.ID, c.ID, "from-c")
	if err != nil {
		t.Fatal(err)
	}
	fromSnap := n.create(sandbox.CreateRequest{TemplateID: snap.ID})
	if v, _ := n.read(fromSnap.ID, "/f"); v != "4" {
		t.Fatalf("sandbox from the promoted checkpoint reads %q", v)
	}

	// A paused sandbox: no checkpoint (409 with the reason), a rollback resumes it at one.
	if err := n.m.PauseWith(ctx, sb.ID, sandbox.PauseOptions{KeepMemory: false}); err != nil {
		t.Fatal(err)
	}
	if _, err := n.m.Checkpoint(ctx, sb.ID); !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "without its memory") {
		t.Fatalf("checkpoint of a files-only paused sandbox: %v", err)
	}
	got, err = n.m.Rollback(ctx, sb.ID, c.ID)
	if err != nil {
		t.Fatal(err)
	}
	if got.State != sandbox.StateRunning {
		t.Fatalf("rolled back paused sandbox is %s", got.State)
	}
	n.expectState(sb.ID, "4")
	if err := n.m.Pause(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := n.m.Rollback(ctx, sb.ID, a.ID); err != nil {
		t.Fatal(err)
	}
	n.expectState(sb.ID, "1")

	// Kill: the checkpoints go (404), their images with the sandbox's directory; their layers
	// once nothing stacks them.
	if err := n.m.Kill(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := n.m.ListCheckpoints(ctx, sb.ID); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("checkpoints of a killed sandbox: %v", err)
	}
	if _, err := n.m.Rollback(ctx, sb.ID, a.ID); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("rollback of a killed sandbox: %v", err)
	}
	for _, ck := range []*sandbox.Checkpoint{a, c} {
		if _, err := os.Stat(ck.Image); !os.IsNotExist(err) {
			t.Fatalf("image of checkpoint %s after kill: %v", ck.ID, err)
		}
	}
	if left, _ := n.store.ListCheckpoints(ctx, sb.ID); len(left) != 0 {
		t.Fatalf("checkpoint records after kill: %v", left)
	}
	if capture {
		// A's layer: the fork children stack it; C's: the snapshot; other's checkpoint: other.
		n.waitForkLayers(3)
		for _, k := range kids {
			if err := n.m.Kill(ctx, k.Sandbox.ID); err != nil {
				t.Fatal(err)
			}
		}
		if err := n.m.Kill(ctx, fromSnap.ID); err != nil {
			t.Fatal(err)
		}
		if err := n.m.DeleteTemplate(ctx, snap.ID); err != nil {
			t.Fatal(err)
		}
		if err := n.m.Kill(ctx, other.ID); err != nil {
			t.Fatal(err)
		}
		n.waitForkLayers(0)
	}
}

// Checkpoints survive a restart; what a crash left half done (a staged image, an image with
// no record) is removed, and the checkpoints of a sandbox that is gone are forgotten.
func TestCheckpointsSurviveRestart(t *testing.T) {
	n := newNode(t, nil)
	n.rig.Driver.SetCapturesLayers(true)
	n.m.CheckpointStandby(false)
	n.build("base")
	ctx := context.Background()
	sb := n.create(sandbox.CreateRequest{})
	n.write(sb.ID, "/f", "1")
	n.writeMem(sb.ID, "m", "1")
	a := n.checkpoint(sb.ID)
	n.write(sb.ID, "/f", "2")
	n.writeMem(sb.ID, "m", "2")
	dir := filepath.Dir(a.Image)
	staged := filepath.Join(dir, ".ckpt-0123456789ab")
	unrecorded := filepath.Join(dir, "ckpt-0123456789ab")
	for _, d := range []string{staged, unrecorded} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	n.restart()
	n.m.CheckpointStandby(false)
	for _, d := range []string{staged, unrecorded} {
		if _, err := os.Stat(d); !os.IsNotExist(err) {
			t.Fatalf("%s after restart: %v", d, err)
		}
	}
	tree, err := n.m.ListCheckpoints(ctx, sb.ID)
	if err != nil || len(tree.Checkpoints) != 1 || tree.Head != a.ID {
		t.Fatalf("checkpoints after restart: %+v %v", tree, err)
	}
	n.waitForkLayers(1)
	if _, err := n.m.Rollback(ctx, sb.ID, a.ID); err != nil {
		t.Fatal(err)
	}
	n.expectState(sb.ID, "1")
	n.settleHolds(1)
	if err := n.m.Kill(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond)
	n.waitForkLayers(0)
}

// A checkpoint gets a standby (restored ahead, frozen): a rollback to it swaps it in (the
// sandbox continues on the instance that was there before the call), and a new standby is
// built behind it; a checkpoint of another head, a delete and a kill drop it.
func TestRollbackStandby(t *testing.T) {
	n := newNode(t, nil)
	n.rig.Driver.SetCapturesLayers(true)
	n.build("base")
	ctx := context.Background()
	sb := n.create(sandbox.CreateRequest{})
	running := func() map[string]bool {
		out := map[string]bool{}
		for _, id := range n.rig.Driver.Running() {
			out[id] = true
		}
		return out
	}
	n.write(sb.ID, "/f", "1")
	n.writeMem(sb.ID, "m", "1")
	a := n.checkpoint(sb.ID)
	hasStandby := func(cid string) func() bool {
		return func() bool {
			tree, err := n.m.ListCheckpoints(ctx, sb.ID)
			return err == nil && tree.Standby == cid
		}
	}
	testutil.Eventually(t, 5*time.Second, "a standby next to the sandbox", hasStandby(a.ID))
	before := running()
	n.write(sb.ID, "/f", "2")
	n.writeMem(sb.ID, "m", "2")
	got, err := n.m.Rollback(ctx, sb.ID, a.ID)
	if err != nil {
		t.Fatal(err)
	}
	if !before[got.Runtime.InstanceID] {
		t.Fatalf("rollback restored %s instead of swapping in the standby (instances before: %v)", got.Runtime.InstanceID, before)
	}
	n.expectState(sb.ID, "1")
	// A new standby of A, next to the sandbox (the old instance ended).
	testutil.Eventually(t, 5*time.Second, "a new standby after the swap", hasStandby(a.ID))
	testutil.Eventually(t, 5*time.Second, "the old instance ended", func() bool {
		r := running()
		return len(r) == 2 && r[got.Runtime.InstanceID]
	})
	// Deleting the head's checkpoint drops its standby.
	if err := n.m.DeleteCheckpoint(ctx, sb.ID, a.ID); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 5*time.Second, "the standby dropped with its checkpoint", func() bool { return len(running()) == 1 })
	// Off: no standby.
	n.m.CheckpointStandby(false)
	n.checkpoint(sb.ID)
	time.Sleep(100 * time.Millisecond)
	if r := running(); len(r) != 1 {
		t.Fatalf("instances with standbys off: %v", r)
	}
	n.m.CheckpointStandby(true)
	c := n.checkpoint(sb.ID)
	testutil.Eventually(t, 5*time.Second, "a standby", hasStandby(c.ID))
	if err := n.m.Kill(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	n.assertHolds(0)
}

// A rollback that comes while the standby of its checkpoint is still being restored waits for
// it and swaps it in, rather than restoring the same checkpoint a second time beside it (the
// tree search under load: most rollbacks came before their standby was ready).
func TestRollbackWaitsForTheStandbyBeingMade(t *testing.T) {
	n := newNode(t, nil)
	n.rig.Driver.SetCapturesLayers(true)
	n.build("base")
	ctx := context.Background()
	sb := n.create(sandbox.CreateRequest{})
	n.write(sb.ID, "/f", "1")
	n.writeMem(sb.ID, "m", "1")
	// From here every restore waits at the gate: the standby's first.
	gate, entered := make(chan struct{}), make(chan struct{}, 8)
	var once sync.Once
	release := func() { once.Do(func() { close(gate) }) }
	defer release() // a failure below must not leave restores waiting (the node's clean-up)
	n.rig.Driver.Image = func(op, imageDir string) error {
		if op == "Restore" {
			select {
			case entered <- struct{}{}:
			default:
			}
			<-gate
		}
		return nil
	}
	restores := n.rig.Driver.Calls("Restore")
	a := n.checkpoint(sb.ID)
	<-entered // the standby of a is being restored
	n.write(sb.ID, "/f", "2")
	n.writeMem(sb.ID, "m", "2")
	type result struct {
		sb  *sandbox.Sandbox
		err error
	}
	done := make(chan result, 1)
	go func() {
		got, err := n.m.Rollback(ctx, sb.ID, a.ID)
		done <- result{got, err}
	}()
	time.Sleep(300 * time.Millisecond)
	if got := n.rig.Driver.Calls("Restore") - restores; got != 1 {
		t.Fatalf("%d restores while the standby was being made, want 1 (the standby's): the rollback restored beside it", got)
	}
	release()
	var r result
	select {
	case r = <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the rollback did not end once the standby was made")
	}
	if r.err != nil {
		t.Fatal(r.err)
	}
	n.expectState(sb.ID, "1")
	// The rollback swapped the standby in: one restore for both (the next standby's aside).
	if got := n.rig.Driver.Calls("Restore") - restores; got > 2 {
		t.Fatalf("%d restores: the rollback did not take the standby", got)
	}
	if err := n.m.Kill(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	n.assertHolds(0)
}
