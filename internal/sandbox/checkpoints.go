package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/ember-sandbox/ember/internal/datadir"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/overlayfs"
)

// Step checkpoints (issue 18 item 6). A step checkpoint is the sandbox's memory, processes and
// files at one moment, kept on this node in the sandbox's own tree of checkpoints:
//
//   - Checkpoint captures a running sandbox the way fork does (captureRunningLocked): its memory
//     image goes to <sandbox dir>/checkpoints/<id>, its writable layer is captured read-only as
//     a fork layer (<data-dir>/forks/<id>, forklayers.go), and the image restores onto that
//     layer over the sandbox's stack. The sandbox runs on at once.
//   - Rollback restores a checkpoint into a new instance of the same sandbox (same id, token,
//     env; a new network slot, the guest transport moved to it), then ends the old instance.
//     The sandbox's stack becomes the checkpoint's: what it writes afterwards goes to a fresh
//     layer over the captured one, so the checkpoint stays as it was and can be rolled back to
//     again. Rolling back a paused sandbox resumes it at the checkpoint.
//   - The tree: each checkpoint's parent is the sandbox's CheckpointHead when it was taken
//     (the checkpoint it was last taken at or rolled back to).
//   - Fork and named snapshots start from any checkpoint of the tree.
//
// Durability: a checkpoint is complete or absent. Its image is written under a staging name
// (.<id>), renamed, then recorded in the store; reconcile removes staged and unrecorded
// directories and the records of sandboxes that are gone. A checkpoint's layer is a fork
// layer: kept while a record, a sandbox or a template stacks it, removed by layer collection
// once nothing does (so forks of a checkpoint outlive its sandbox). All checkpoints go with
// their sandbox.

// Checkpoint is one step checkpoint of a sandbox.
type Checkpoint struct {
	ID        string    `json:"checkpointID"`
	SandboxID string    `json:"sandboxID"`
	ParentID  string    `json:"parentID,omitempty"`
	CreatedAt time.Time `json:"createdAt"`
	// Image is the checkpoint's memory image (with the layer copied in when Layer is "").
	Image string `json:"image"`
	// Layer is the captured layer's directory (a fork layer), "" when the driver cannot
	// capture layers. RootFS and Lowers are the stack Image restores onto (top first).
	Layer  string   `json:"layer,omitempty"`
	RootFS string   `json:"rootfs"`
	Lowers []string `json:"lowers,omitempty"`
	// Stopped is how long the sandbox's processes were stopped for the checkpoint; Took how
	// long the checkpoint took in all.
	Stopped time.Duration `json:"stopped"`
	Took    time.Duration `json:"took"`
	// Token is the envd access token the image's envd holds: one of the checkpoint's own, as
	// a snapshot's (snaptoken.go), so that a snapshot promoted from it carries no live token.
	// "" (a checkpoint of an earlier version) = the sandbox's own.
	Token string `json:"token,omitempty"`
}

// initToken is the token that authenticates the first /init of an instance restored from ck
// (the sandbox's own for a checkpoint of an earlier version).
func (ck *Checkpoint) initToken(sb *Sandbox) string {
	if ck.Token != "" {
		return ck.Token
	}
	return sb.AccessToken
}

// reinit is what a launch restoring ck for sb sends envd: sb's identity, authenticated with
// the checkpoint's token (nil when envd holds sb's own token already).
func (ck *Checkpoint) reinit(sb *Sandbox) (*Sandbox, string) {
	if ck.Token == "" || ck.Token == sb.AccessToken {
		return nil, ""
	}
	return sb, ck.Token
}

// CheckpointTree is a sandbox's checkpoints (oldest first, each with its parent), its head,
// and the checkpoint its rollback standby holds ("" when none is ready: standby.go).
type CheckpointTree struct {
	Head        string
	Standby     string
	Checkpoints []*Checkpoint
}

// CheckpointNotFoundError: the sandbox has no checkpoint of that id (never had one, it was
// deleted, or it is another sandbox's). It is an errdefs.ErrNotFound.
type CheckpointNotFoundError struct{ SandboxID, ID string }

func (e *CheckpointNotFoundError) Error() string {
	return fmt.Sprintf("checkpoint %q of sandbox %q not found", e.ID, e.SandboxID)
}

// Is makes a CheckpointNotFoundError an errdefs.ErrNotFound.
func (e *CheckpointNotFoundError) Is(target error) bool { return target == errdefs.ErrNotFound }

// CheckpointIDRe is the form of checkpoint ids.
var CheckpointIDRe = regexp.MustCompile(`^ckpt-[a-f0-9]{12}$`)

// checkpointsDir is where a sandbox's checkpoint images live.
func (m *Manager) checkpointsDir(id string) string {
	return filepath.Join(m.sandboxDir(id), "checkpoints")
}

// checkpointOf returns sandbox id's checkpoint cid.
func (m *Manager) checkpointOf(ctx context.Context, id, cid string) (*Checkpoint, error) {
	if !CheckpointIDRe.MatchString(cid) {
		return nil, &CheckpointNotFoundError{SandboxID: id, ID: cid}
	}
	cks, err := m.cfg.Store.ListCheckpoints(ctx, id)
	if err != nil {
		return nil, err
	}
	for _, c := range cks {
		if c.ID == cid {
			return c, nil
		}
	}
	return nil, &CheckpointNotFoundError{SandboxID: id, ID: cid}
}

// checkpointableLocked returns nil if e's sandbox can be checkpointed (it runs), else why not.
func checkpointableLocked(e *entry) error {
	switch {
	case e.sb.State == StatePaused && e.sb.PausedFilesOnly:
		return fmt.Errorf("sandbox %q is paused without its memory (keepMemory false): a checkpoint needs its memory and processes; resume it first: %w", e.sb.ID, errdefs.ErrConflict)
	case e.sb.State == StatePaused:
		return fmt.Errorf("sandbox %q is paused: resume it before taking a checkpoint: %w", e.sb.ID, errdefs.ErrConflict)
	}
	return runningLocked(e)
}

// Checkpoint takes a step checkpoint of a running sandbox (which keeps running) and makes it
// the sandbox's head. It answers once the sandbox runs again and the checkpoint is recorded:
// it can be rolled back to, forked and promoted at once.
func (m *Manager) Checkpoint(ctx context.Context, id string) (*Checkpoint, error) {
	ctx, done, err := m.op(ctx)
	if err != nil {
		return nil, err
	}
	defer done()
	e, err := m.entry(id)
	if err != nil {
		return nil, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if err := checkpointableLocked(e); err != nil {
		return nil, err
	}
	sb := e.sb
	tpl, err := m.templateOf(ctx, sb)
	if err != nil {
		return nil, err
	}
	cid := "ckpt-" + randomHex(6)
	dir := m.checkpointsDir(id)
	stage := filepath.Join(dir, "."+cid)
	if err := os.MkdirAll(stage, 0o700); err != nil {
		return nil, err
	}
	layerDir := ""
	if m.layerCapturer() != nil {
		ended := m.buildStarted() // no layer collection until the checkpoint is recorded
		defer ended()
		forks := datadir.ForkLayers(m.cfg.DataDir)
		if err := os.MkdirAll(forks, 0o700); err != nil {
			overlayfs.RemoveTree(stage, overlayfs.DetachMounts)
			return nil, err
		}
		layerDir = filepath.Join(forks, cid)
	}
	start := time.Now()
	var top string
	var stopped time.Duration
	// The image holds a token of its own, not the sandbox's (snaptoken.go); the checkpoint is
	// recorded while envd gets the sandbox's token back.
	var ck *Checkpoint
	captured := false
	_, err = m.withSnapshotTokenThen(ctx, sb, tpl, func() error {
		var cerr error
		top, stopped, cerr = m.captureRunningLocked(ctx, e, stage, layerDir)
		return cerr
	}, func(token string) error {
		captured = true
		image := filepath.Join(dir, cid)
		ck = &Checkpoint{ID: cid, SandboxID: id, ParentID: sb.CheckpointHead, CreatedAt: time.Now().UTC(),
			Image: image, RootFS: tpl.RootFS, Lowers: tpl.Lowers, Stopped: stopped, Token: token}
		if top != "" {
			c := childTemplate(tpl, top)
			ck.Layer, ck.RootFS, ck.Lowers = layerDir, c.RootFS, c.Lowers
		}
		return m.recordCheckpointLocked(ctx, sb, ck, stage, start)
	})
	if err != nil {
		if !captured {
			overlayfs.RemoveTree(stage, overlayfs.DetachMounts)
			err = fmt.Errorf("checkpoint: %w", err)
		}
		m.observe(StageCheckpoint, start, err)
		return nil, err
	}
	m.observe(StageCheckpoint, start, nil)
	m.standbyLocked(e, ck) // a rollback to it swaps (standby.go)
	m.logger(id).Info("checkpoint taken", "checkpoint", cid, "parent", ck.ParentID,
		"stopped_ms", ms(stopped), "ms", ms(ck.Took))
	return ck, nil
}

// recordCheckpointLocked moves ck's image, staged in stage, to its place and records ck as
// sb's head (ck.Took from start). On failure nothing of ck is left.
func (m *Manager) recordCheckpointLocked(ctx context.Context, sb *Sandbox, ck *Checkpoint, stage string, start time.Time) error {
	undo := func() {
		overlayfs.RemoveTree(ck.Image, overlayfs.DetachMounts)
		overlayfs.RemoveTree(stage, overlayfs.DetachMounts)
		if ck.Layer != "" {
			if lc := m.layerCapturer(); lc != nil {
				lc.RemoveCapturedLayer(context.WithoutCancel(ctx), ck.Layer)
			}
		}
	}
	if err := os.Rename(stage, ck.Image); err != nil {
		undo()
		return fmt.Errorf("checkpoint: %w", err)
	}
	ck.Took = time.Since(start)
	// Recorded last: the record is what makes the checkpoint exist.
	if hr, ok := m.cfg.Store.(checkpointHeadRecorder); ok {
		head := *sb
		head.CheckpointHead = ck.ID
		if err := hr.PutCheckpointHead(ctx, ck, &head); err != nil {
			undo()
			return err
		}
		sb.CheckpointHead = ck.ID
		return nil
	}
	if err := m.cfg.Store.PutCheckpoint(ctx, ck); err != nil {
		undo()
		return err
	}
	sb.CheckpointHead = ck.ID
	if err := m.cfg.Store.PutSandbox(ctx, sb); err != nil {
		m.logger(sb.ID).Warn("record checkpoint head", "checkpoint", ck.ID, "err", err)
	}
	return nil
}

// checkpointHeadRecorder is a Store that records a checkpoint and its sandbox, whose head it
// now is, in one transaction (internal/store's: one synced write instead of two).
type checkpointHeadRecorder interface {
	PutCheckpointHead(ctx context.Context, c *Checkpoint, sb *Sandbox) error
}

// ListCheckpoints returns a sandbox's checkpoints, oldest first, and its head.
func (m *Manager) ListCheckpoints(ctx context.Context, id string) (*CheckpointTree, error) {
	e, err := m.entry(id)
	if err != nil {
		return nil, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.sb.State == StateKilled {
		return nil, goneErr(e.sb)
	}
	cks, err := m.cfg.Store.ListCheckpoints(ctx, id)
	if err != nil {
		return nil, err
	}
	tree := &CheckpointTree{Head: e.sb.CheckpointHead, Checkpoints: cks}
	e.smu.Lock()
	if e.standby != nil {
		tree.Standby = e.standby.ckptID
	}
	e.smu.Unlock()
	return tree, nil
}

// DeleteCheckpoint removes one checkpoint of a sandbox. Its children in the tree take its
// parent; a sandbox whose head it was has its parent as head. Its layer stays while a sandbox
// (the sandbox itself after a rollback to it, a fork child) or a snapshot stacks it.
func (m *Manager) DeleteCheckpoint(ctx context.Context, id, cid string) error {
	ctx, done, err := m.op(ctx)
	if err != nil {
		return err
	}
	defer done()
	e, err := m.entry(id)
	if err != nil {
		return err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.sb.State == StateKilled {
		return goneErr(e.sb)
	}
	ck, err := m.checkpointOf(ctx, id, cid)
	if err != nil {
		return err
	}
	cks, err := m.cfg.Store.ListCheckpoints(ctx, id)
	if err != nil {
		return err
	}
	for _, c := range cks {
		if c.ParentID == cid {
			c.ParentID = ck.ParentID
			if err := m.cfg.Store.PutCheckpoint(ctx, c); err != nil {
				return err
			}
		}
	}
	e.smu.Lock()
	s := e.standby
	e.smu.Unlock()
	if (s != nil && s.ckptID == cid) || e.sb.CheckpointHead == cid {
		m.dropStandbyLocked(e, false)
	}
	if e.sb.CheckpointHead == cid {
		e.sb.CheckpointHead = ck.ParentID
		if err := m.cfg.Store.PutSandbox(ctx, e.sb); err != nil {
			return err
		}
	}
	if err := m.cfg.Store.DeleteCheckpoint(ctx, id, cid); err != nil {
		return err
	}
	overlayfs.RemoveTree(ck.Image, overlayfs.DetachMounts)
	if ck.Layer != "" {
		m.collectForkLayersLater("a checkpoint was deleted")
	}
	m.logger(id).Info("checkpoint deleted", "checkpoint", cid)
	return nil
}

// collectForkLayersLater runs a collection of fork layers in the background.
func (m *Manager) collectForkLayersLater(why string) {
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		m.collectForkLayers(context.WithoutCancel(m.bg), why)
	}()
}

// dropCheckpointsLocked forgets every checkpoint of e's sandbox, which is ending: its standby
// ends, their images go with its directory (removed next by the caller), their layers with a
// collection once nothing stacks them.
func (m *Manager) dropCheckpointsLocked(ctx context.Context, e *entry) {
	sb := e.sb
	m.dropStandbyLocked(e, true)
	cks, err := m.cfg.Store.ListCheckpoints(ctx, sb.ID)
	if err != nil {
		m.logger(sb.ID).Warn("checkpoints of an ended sandbox", "err", err)
		return
	}
	layered := false
	for _, c := range cks {
		if err := m.cfg.Store.DeleteCheckpoint(ctx, sb.ID, c.ID); err != nil {
			m.logger(sb.ID).Warn("forget checkpoint", "checkpoint", c.ID, "err", err)
		}
		layered = layered || c.Layer != ""
	}
	sb.CheckpointHead = ""
	if layered {
		m.collectForkLayersLater("a sandbox with checkpoints ended")
	}
}

// Rollback makes a sandbox continue from one of its checkpoints: same id, token and env, the
// checkpoint's memory, processes and files. The checkpoint is restored into a new instance,
// which the sandbox's record and guest transport then point at, and the old instance ends. A
// paused sandbox is resumed at the checkpoint (its pause image is dropped).
func (m *Manager) Rollback(ctx context.Context, id, cid string) (*Sandbox, error) {
	ctx, done, err := m.op(ctx)
	if err != nil {
		return nil, err
	}
	defer done()
	e, err := m.entry(id)
	if err != nil {
		return nil, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	sb := e.sb
	if sb.State == StateKilled {
		return nil, goneErr(sb)
	}
	ck, err := m.checkpointOf(ctx, id, cid)
	if err != nil {
		return nil, err
	}
	paused := sb.State == StatePaused
	hot := e.hot
	if paused {
		e.settleLocked()
		m.dropPreLocked(ctx, e)
		if hot != nil {
			// Paused in memory (hotpause.go): its background checkpoint stops (the checkpoint
			// replaces its state); its frozen instance ends below like a paused one kept in
			// place. Should the rollback fail, it stays paused in memory.
			waitHot(hot, true)
		}
	}
	tpl, err := m.templateOf(ctx, sb)
	if err != nil {
		return nil, err
	}
	onto := *tpl
	onto.RootFS, onto.Lowers = ck.RootFS, ck.Lowers
	start := time.Now()
	var p Placement
	swapped := false
	m.awaitStandbyLocked(ctx, e, cid)
	if s := m.takeStandbyLocked(e, cid); s != nil {
		// The standby restored ahead: thawed, it is the sandbox from now on.
		if err := m.cfg.Driver.Thaw(ctx, s.p.InstanceID); err != nil {
			m.logger(id).Warn("rollback standby would not thaw; restoring", "instance", s.p.InstanceID, "err", err)
			m.teardown(context.WithoutCancel(ctx), sb.ID, s.p)
		} else {
			p, swapped = s.p, true
		}
	}
	var spec launchSpec // what the restored instance is told (recordRollback), if restored
	if !swapped {
		init, initToken := ck.reinit(sb)
		spec = launchSpec{owner: sb.ID, tpl: &onto, image: ck.Image, busyDir: sb.Runtime.StateDir,
			init: init, initToken: initToken, deferInit: true,
			cpu: sb.CPUCount, memMB: sb.MemoryMB, diskMB: sb.DiskSizeMB, egress: sb.Egress()}
		p, err = m.launch(ctx, spec)
		if err != nil {
			m.observe(StageRollback, start, err)
			return nil, fmt.Errorf("rollback: %w", err)
		}
	}
	prev := *sb
	old := sb.Runtime
	sb.Runtime, sb.RootFS, sb.Lowers, sb.CheckpointHead = p, ck.RootFS, ck.Lowers, ck.ID
	if paused {
		timeout := sb.Timeout
		if timeout <= 0 {
			timeout = DefaultTimeout
		}
		sb.State, sb.PausedFilesOnly, sb.PausedIn, sb.EndAt = StateRunning, false, "", time.Now().UTC().Add(timeout)
	}
	if err := m.recordRollback(ctx, sb, &prev, spec); err != nil {
		m.teardown(context.WithoutCancel(ctx), sb.ID, p)
		*sb = prev
		m.observe(StageRollback, start, err)
		return nil, fmt.Errorf("rollback: %w", err)
	}
	if hot != nil {
		e.hot = nil
		if image := hot.image; image != "" {
			m.goBG(func() { overlayfs.RemoveTree(image, overlayfs.DetachMounts) })
		}
	}
	m.guestT.open(p.GuestIP, p.InstanceID, true)
	m.watch(e, p.InstanceID)
	if paused && old.Image != "" {
		m.wg.Add(1)
		go func() {
			defer m.wg.Done()
			overlayfs.RemoveTree(old.Image, overlayfs.DetachMounts) // the pause is replaced by the checkpoint
		}()
	}
	if old.InstanceID != "" {
		// The old instance (running, or a paused one kept in place) ends after the answer; a
		// kill or pause of the sandbox waits for it (settleLocked), and a crash first leaves
		// an orphan reconcile removes.
		released := make(chan struct{})
		e.released = released
		m.wg.Add(1)
		go func() {
			defer m.wg.Done()
			defer close(released)
			m.teardown(context.Background(), sb.ID, old)
		}()
	}
	if paused {
		if err := m.startedLocked(ctx, e, EventResumed, "", ""); err != nil {
			return nil, err
		}
	}
	m.observe(StageRollback, start, nil)
	m.standbyLocked(e, ck) // for the next rollback to it
	m.logger(id).Info("sandbox rolled back", "checkpoint", cid, "instance", p.InstanceID, "was_paused", paused,
		"standby", swapped, "ms", time.Since(start).Milliseconds())
	return m.snapshotOf(e), nil
}

// ForkCheckpoint restores count new sandboxes from a checkpoint of sandbox id (running or
// paused), each with its own id, token, slot and writable layer over the checkpoint's stack.
func (m *Manager) ForkCheckpoint(ctx context.Context, id, cid string, count int, timeout time.Duration) ([]ForkResult, error) {
	timeout, err := forkArgs(count, timeout)
	if err != nil {
		return nil, err
	}
	ctx, done, err := m.op(ctx)
	if err != nil {
		return nil, err
	}
	defer done()
	e, err := m.entry(id)
	if err != nil {
		return nil, err
	}
	// Held throughout: the checkpoint cannot be deleted while its children restore from it.
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.sb.State == StateKilled {
		return nil, goneErr(e.sb)
	}
	ck, err := m.checkpointOf(ctx, id, cid)
	if err != nil {
		return nil, err
	}
	parent := m.snapshotOf(e)
	tpl, err := m.templateOf(ctx, parent)
	if err != nil {
		return nil, err
	}
	onto := *tpl
	onto.RootFS, onto.Lowers = ck.RootFS, ck.Lowers
	start := time.Now()
	parent.AccessToken = ck.initToken(parent) // what the children's /init authenticates with
	results, ok := m.forkChildren(ctx, parent, &onto, ck.Image, count, timeout, nil)
	m.logger(id).Info("sandbox forked from a checkpoint", "checkpoint", cid, "children", ok, "failed", count-ok,
		"total_ms", time.Since(start).Milliseconds())
	if ok == 0 {
		err := fmt.Errorf("fork: every child failed: %w", errors.Join(results[0].Err))
		m.observe(StageFork, start, err)
		return results, err
	}
	m.observe(StageFork, start, nil)
	return results, nil
}

// SnapshotCheckpoint promotes a checkpoint of sandbox id to a named snapshot (a template): its
// image is linked (not copied) into the snapshot's, and the snapshot stacks the checkpoint's
// layer, which then outlives the checkpoint and the sandbox.
func (m *Manager) SnapshotCheckpoint(ctx context.Context, id, cid, name string) (*Template, error) {
	return m.newSnapshot(ctx, id, name, "checkpoint promoted to a snapshot", func(ctx context.Context, e *entry, image string) (*Template, []any, error) {
		sb := e.sb
		if sb.State == StateKilled {
			return nil, nil, goneErr(sb)
		}
		ck, err := m.checkpointOf(ctx, id, cid)
		if err != nil {
			return nil, nil, err
		}
		if ck.Token == "" && sb.AccessToken != "" {
			// Its image holds the sandbox's live token, which a snapshot must not carry.
			return nil, nil, fmt.Errorf("checkpoint %q was taken by an earlier version of ember and holds the sandbox's own token: take a new checkpoint to make a snapshot of: %w", cid, errdefs.ErrConflict)
		}
		tpl, err := m.templateOf(ctx, sb)
		if err != nil {
			return nil, nil, err
		}
		if err := linkTree(ck.Image, image); err != nil {
			return nil, nil, err
		}
		snap := &Template{
			RootFS:    ck.RootFS,
			Lowers:    ck.Lowers,
			InitToken: ck.Token, // not the sandbox's (Checkpoint.Token)
			Env:       tpl.Env,
			User:      tpl.User,
			Workdir:   tpl.Workdir,
		}
		return snap, []any{"checkpoint", cid}, nil
	})
}

// linkTree makes dst (absent) a copy of the tree src whose files are hard links to src's (the
// image files are never written again), or copies where links cannot be made.
func linkTree(src, dst string) error {
	if err := exec.Command("cp", "-a", "-l", "--", src, dst).Run(); err == nil {
		return nil
	}
	os.RemoveAll(dst)
	if out, err := exec.Command("cp", "-a", "--reflink=auto", "--", src, dst).CombinedOutput(); err != nil {
		return fmt.Errorf("copy checkpoint image: %v: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}

// reconcileCheckpoints, at start after reconcile, keeps the checkpoints of live sandboxes
// whose image is there and forgets the others; directories under a sandbox's checkpoints
// that no record names (a checkpoint a crash cut before its record) are removed. Their layers
// are left to the layer collection that follows.
func (m *Manager) reconcileCheckpoints(ctx context.Context) error {
	cks, err := m.cfg.Store.ListCheckpoints(ctx, "")
	if err != nil {
		return err
	}
	recorded := map[string]bool{}
	for _, c := range cks {
		e := m.live[c.SandboxID]
		_, serr := os.Stat(c.Image)
		switch {
		case e == nil || e.sb.State == StateKilled:
			m.log.Info("reconcile: forgot the checkpoint of a sandbox that is gone", "sandbox_id", c.SandboxID, "checkpoint", c.ID)
		case serr != nil:
			m.log.Warn("reconcile: checkpoint lost its image; forgotten", "sandbox_id", c.SandboxID, "checkpoint", c.ID, "err", serr)
		default:
			recorded[c.Image] = true
			continue
		}
		if err := m.cfg.Store.DeleteCheckpoint(ctx, c.SandboxID, c.ID); err != nil {
			return err
		}
		overlayfs.RemoveTree(c.Image, overlayfs.DetachMounts)
	}
	dirs, _ := filepath.Glob(filepath.Join(datadir.Sandboxes(m.cfg.DataDir), "*", "checkpoints", "*"))
	dots, _ := filepath.Glob(filepath.Join(datadir.Sandboxes(m.cfg.DataDir), "*", "checkpoints", ".*"))
	for _, d := range append(dirs, dots...) {
		if !recorded[d] {
			m.log.Info("reconcile: removed unfinished checkpoint", "dir", d)
			overlayfs.RemoveTree(d, overlayfs.DetachMounts)
		}
	}
	return nil
}
