package sandbox

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"sync/atomic"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/overlayfs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

// Hot pause (issue 18). A memory pause freezes the sandbox in place (Driver.Freeze: every task
// stopped, nothing runs, memory, processes, files and network slot kept), records it paused in
// memory and answers; a resume thaws it. In the background its state goes to disk (a
// checkpoint of the frozen instance, which stays frozen), so that it can be demoted: its
// instance ended and its slot released, the on-disk image kept — what a checkpoint pause leaves
// — when the memory of the sandboxes paused in memory would exceed Config.PausedMemoryMB (the
// least recently paused first) or after Config.HotPauseMax. A demoted sandbox resumes by a
// restore, as before.
//
// Every step is complete or absent on disk, so that a crash of the daemon loses nothing:
//   - freeze, then the record (paused, memory, the instance's placement kept, HotImage named):
//     a crash between leaves a running record whose instance is frozen, which reconcile adopts
//     as paused in memory;
//   - the background checkpoint writes HotImage and marks it complete (markComplete) before the
//     record names it as Image: reconcile uses HotImage only when it is marked complete, and
//     removes it otherwise;
//   - a demotion writes the record (paused on disk, Image, no instance) before it ends the
//     instance: a crash between leaves an orphan instance that reconcile removes;
//   - a resume thaws, then writes the record: a crash between leaves a paused record whose
//     instance runs, which reconcile freezes again (the resume never answered).

// Where a paused sandbox is (Sandbox.PausedIn).
const (
	// TierMemory: its instance is frozen on this node; a resume thaws it.
	TierMemory = "memory"
	// TierDisk: its state is in a pause image on this node's disk; a resume restores it.
	TierDisk = "disk"
	// TierStore: its state is in the cluster's image store only (as another node lists it).
	TierStore = "store"
)

// Pause modes (Config.PauseMode, PauseOptions.Mode).
const (
	PauseHot        = "hot"
	PauseCheckpoint = "checkpoint"
)

// Tier says where a paused sandbox is ("" unless it is paused).
func (sb *Sandbox) Tier() string {
	switch {
	case sb.State != StatePaused:
		return ""
	case sb.PausedIn != "":
		return sb.PausedIn
	}
	return TierDisk
}

// hotState is a sandbox paused in memory.
type hotState struct {
	inst  string
	since time.Time // when it was paused (the tier loop demotes the oldest first)
	// memMB is the instance's memory as measured after the freeze (0 until measured).
	memMB atomic.Int64
	// cancel stops the background checkpoint; done is closed once it ended, image (complete)
	// or err set then.
	cancel context.CancelFunc
	done   chan struct{}
	image  string
	err    error
	// reduced: the instance was asked to give back memory it no longer uses (reduceLater).
	reduced atomic.Bool
}

// DefaultPausedReduceAfter is how long a sandbox stays paused in memory, its state on disk, before its
// instance is asked to give back the memory it no longer uses (runtime.MemoryReducer; gVisor:
// the sentry's heap grown by the background checkpoint, kept by a frozen sentry until its Go
// runtime's forced collection minutes later, and cached file pages no mapping uses). Not at
// once: a sandbox resumed within seconds (an agent's step) would only pay for it.
const DefaultPausedReduceAfter = 10 * time.Second

// hotPauseLocked pauses e in memory. In StorePauses mode the image is written (from the frozen
// instance, which stays frozen) and stored before it answers.
func (m *Manager) hotPauseLocked(ctx context.Context, e *entry) error {
	sb := e.sb
	start := time.Now()
	tl := runtime.NewTimeline()
	inst := sb.Runtime.InstanceID
	// The marker tells reconcile that a freeze it finds under a running record is this pause's
	// (the sandbox is paused), not a snapshot's or fork's that a crash cut (it runs on).
	marker := filepath.Join(m.sandboxDir(sb.ID), pausingName)
	if err := os.WriteFile(marker, nil, 0o600); err != nil {
		return err
	}
	defer os.Remove(marker)
	if err := m.cfg.Driver.Freeze(ctx, inst); err != nil {
		m.observe(StagePause, start, err)
		return fmt.Errorf("freeze: %w", err)
	}
	tl.Mark("freeze")
	h := &hotState{inst: inst, since: time.Now(), done: make(chan struct{})}
	image := filepath.Join(m.sandboxDir(sb.ID), "image-"+randomHex(3))
	stored := m.cfg.StorePauses
	if stored {
		// Cluster mode: the pause answers once the state is in the store; the instance stays
		// frozen here for a resume on this node.
		if err := m.checkpointFrozen(ctx, inst, image); err != nil {
			m.thawBack(ctx, e)
			m.observe(StagePause, start, err)
			return fmt.Errorf("checkpoint: %w", err)
		}
		h.image = image
		close(h.done)
		tl.Mark("checkpoint")
	}
	sb.State, sb.PausedFilesOnly, sb.PausedIn = StatePaused, false, TierMemory
	sb.Runtime.HotImage = image
	if stored {
		sb.Runtime.Image = image
	}
	if err := m.cfg.Store.PutSandbox(ctx, sb); err != nil {
		// Frozen and unrecorded: a crash adopts it paused anyway (a frozen running instance).
		m.logger(sb.ID).Error("record pause", "err", err)
	}
	tl.Mark("record")
	e.hot = h
	m.guestT.close(sb.Runtime.GuestIP)
	m.emitLocked(ctx, e, EventPaused, "")
	if stored {
		m.pauseStored(ctx, e)
		tl.Mark("stored")
	} else {
		m.checkpointInBackground(e, h)
	}
	tl.Log(m.logger(sb.ID), "hot pause timeline")
	m.observe(StagePause, start, nil)
	m.logger(sb.ID).Info("sandbox paused in memory", "instance", inst, "ms", time.Since(start).Milliseconds())
	return nil
}

// pausingName marks a sandbox directory while a hot pause is between its freeze and its record.
const pausingName = ".ember-pausing"

// thawBack undoes a freeze whose pause failed.
func (m *Manager) thawBack(ctx context.Context, e *entry) {
	if err := m.cfg.Driver.Thaw(context.WithoutCancel(ctx), e.sb.Runtime.InstanceID); err != nil {
		m.logger(e.sb.ID).Warn("thaw after a failed pause", "err", err)
	}
}

// checkpointFrozen writes a complete image of frozen instance inst (which stays frozen) into
// image, marked complete; on error no image is left.
func (m *Manager) checkpointFrozen(ctx context.Context, inst, image string) error {
	if err := os.MkdirAll(image, 0o700); err != nil {
		return err
	}
	if err := m.cfg.Driver.Checkpoint(ctx, inst, image, runtime.CheckpointOptions{LeaveRunning: true}); err != nil {
		overlayfs.RemoveTree(image, overlayfs.DetachMounts)
		return err
	}
	return markComplete(image, false)
}

// checkpointInBackground measures h's instance and writes its state to disk (h.done closes
// then); the record names the image once it is complete.
func (m *Manager) checkpointInBackground(e *entry, h *hotState) {
	ctx, cancel := context.WithCancel(m.bg)
	h.cancel = cancel
	image, id := e.sb.Runtime.HotImage, e.sb.ID
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		defer cancel()
		if st, err := m.cfg.Driver.Stats(ctx, h.inst); err == nil {
			h.memMB.Store(int64(st.MemoryBytes >> 20))
		}
		m.kickTiers()
		start := time.Now()
		err := m.checkpointFrozen(ctx, h.inst, image)
		if err == nil {
			h.image = image
		} else {
			h.err = err
		}
		close(h.done)
		if err != nil {
			if ctx.Err() == nil {
				m.logger(id).Warn("background checkpoint of a sandbox paused in memory failed; a demotion checkpoints it anew", "err", err)
			}
			return
		}
		e.mu.Lock()
		defer e.mu.Unlock()
		if e.hot != h {
			return // resumed, demoted or ended meanwhile: whoever did it owns the image
		}
		e.sb.Runtime.Image = image
		if err := m.cfg.Store.PutSandbox(m.bg, e.sb); err != nil {
			m.logger(id).Warn("record the background checkpoint", "err", err)
		}
		m.logger(id).Debug("paused sandbox's state on disk", "ms", time.Since(start).Milliseconds())
	}()
}

// waitHot waits for h's background checkpoint; with stop it cancels it first.
func waitHot(h *hotState, stop bool) {
	if stop && h.cancel != nil {
		h.cancel()
	}
	<-h.done
}

// thawLocked resumes e, paused in memory, by thawing its instance. It returns false (and no
// error) when the instance is no longer there to thaw: e is then paused on disk if its state
// reached it (the caller restores), or ended.
func (m *Manager) thawLocked(ctx context.Context, e *entry, timeout time.Duration) (bool, error) {
	sb, h := e.sb, e.hot
	start := time.Now()
	tl := runtime.NewTimeline()
	// A thaw during the background checkpoint waits for it: it is short (the frozen instance's
	// memory and a layer clone), and the instance is its input.
	waitHot(h, false)
	tl.Mark("settle")
	if err := m.cfg.Driver.Thaw(ctx, h.inst); err != nil {
		if ctx.Err() != nil {
			return false, ctx.Err()
		}
		m.logger(sb.ID).Warn("thaw failed; the sandbox's instance is lost", "instance", h.inst, "err", err)
		return false, m.hotLostLocked(ctx, e)
	}
	tl.Mark("thaw")
	endAt := time.Now().UTC().Add(timeout)
	prev := *sb
	sb.State, sb.PausedIn, sb.EndAt = StateRunning, "", endAt
	sb.Runtime.Image, sb.Runtime.HotImage = "", ""
	if err := m.cfg.Store.PutSandbox(ctx, sb); err != nil {
		*sb = prev
		if ferr := m.cfg.Driver.Freeze(context.WithoutCancel(ctx), h.inst); ferr != nil {
			m.logger(sb.ID).Warn("freeze again after a failed resume", "err", ferr)
		}
		m.observe(StageResume, start, err)
		return true, err
	}
	tl.Mark("record")
	e.hot = nil
	if image := h.image; image != "" {
		// Stale now that the sandbox runs on; a crash first leaves it to reconcile.
		m.goBG(func() { overlayfs.RemoveTree(image, overlayfs.DetachMounts) })
	}
	m.guestT.open(sb.Runtime.GuestIP, h.inst, true)
	m.observe(StageResume, start, nil)
	if err := m.startedLocked(ctx, e, EventResumed, "", ""); err != nil {
		return true, err
	}
	tl.Log(m.logger(sb.ID), "thaw timeline")
	m.logger(sb.ID).Info("sandbox resumed from memory", "instance", h.inst, "ms", time.Since(start).Milliseconds())
	return true, nil
}

// hotLostLocked handles e, paused in memory, whose instance is gone (it died, or a thaw
// failed): paused on disk when its state reached the disk, else ended. The error says which.
func (m *Manager) hotLostLocked(ctx context.Context, e *entry) error {
	h := e.hot
	waitHot(h, true)
	if h.image != "" {
		if err := m.demoteLocked(ctx, e, "its instance is gone"); err == nil {
			return nil
		}
	}
	e.hot = nil
	m.endLocked(ctx, e, "lost: its instance stopped while paused")
	return goneErr(e.sb)
}

// demoteLocked moves e from memory to disk: its state is written (or was, in the background),
// the record says so, then its instance ends and its slot is released.
func (m *Manager) demoteLocked(ctx context.Context, e *entry, why string) error {
	sb, h := e.sb, e.hot
	waitHot(h, false)
	image := h.image
	if image == "" {
		// The background checkpoint failed (or was cut): a checkpoint that stops the instance.
		image = filepath.Join(m.sandboxDir(sb.ID), "image-"+randomHex(3))
		if err := os.MkdirAll(image, 0o700); err != nil {
			return err
		}
		if err := m.cfg.Driver.Checkpoint(ctx, h.inst, image, runtime.CheckpointOptions{}); err != nil {
			overlayfs.RemoveTree(image, overlayfs.DetachMounts)
			return fmt.Errorf("checkpoint for demotion: %w", err)
		}
		if err := markComplete(image, false); err != nil {
			m.logger(sb.ID).Warn("mark pause image complete", "err", err)
		}
	}
	old := sb.Runtime
	sb.Runtime = Placement{Image: image, SlotIndex: noSlot}
	sb.PausedIn = TierDisk
	if err := m.cfg.Store.PutSandbox(ctx, sb); err != nil {
		// The image is complete and marked: reconcile finds it after a crash. Stay in memory.
		sb.Runtime, sb.PausedIn = old, TierMemory
		if image != h.image {
			h.image = image // the instance stopped: its state is in this image now
		}
		return fmt.Errorf("record demotion: %w", err)
	}
	e.hot = nil
	m.logger(sb.ID).Info("paused sandbox demoted to disk", "why", why, "paused_for", time.Since(h.since).Round(time.Millisecond), "memory_mib", h.memMB.Load())
	m.emitLocked(ctx, e, EventPaused, "")
	released := make(chan struct{})
	e.released = released
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		m.teardown(context.Background(), sb.ID, old)
		close(released)
		m.prestartForResume(e, image)
	}()
	return nil
}

// kickTiers wakes the tier loop.
func (m *Manager) kickTiers() {
	select {
	case m.tierKick <- struct{}{}:
	default:
	}
}

// tierLoop demotes sandboxes paused in memory: those paused longer than HotPauseMax, and the
// least recently paused while their memory exceeds PausedMemoryMB.
func (m *Manager) tierLoop() {
	defer m.wg.Done()
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-m.stop:
			return
		case <-t.C:
		case <-m.tierKick:
		}
		m.demoteDue(time.Now())
	}
}

type hotEntry struct {
	e *entry
	h *hotState
}

// hotEntries are the sandboxes paused in memory, least recently paused first.
func (m *Manager) hotEntries() []hotEntry {
	m.mu.Lock()
	all := make([]*entry, 0, len(m.live))
	for _, e := range m.live {
		all = append(all, e)
	}
	m.mu.Unlock()
	var out []hotEntry
	for _, e := range all {
		e.mu.Lock()
		if e.hot != nil {
			out = append(out, hotEntry{e, e.hot})
		}
		e.mu.Unlock()
	}
	sort.Slice(out, func(i, j int) bool { return out[i].h.since.Before(out[j].h.since) })
	return out
}

// demoteDue demotes what is due at now (see tierLoop).
func (m *Manager) demoteDue(now time.Time) {
	hot := m.hotEntries()
	total := int64(0)
	for _, he := range hot {
		total += he.h.memMB.Load()
	}
	budget := int64(m.cfg.PausedMemoryMB)
	for _, he := range hot {
		why := ""
		switch {
		case now.Sub(he.h.since) >= m.cfg.HotPauseMax:
			why = "paused longer than " + m.cfg.HotPauseMax.String()
		case total > budget || budget < 0:
			why = fmt.Sprintf("paused memory %d MiB over its budget of %d MiB", total, budget)
		default:
			m.reduceLater(he, now)
			continue
		}
		if budget < 0 {
			// Nothing stays in memory once its state is on disk; wait for that.
			select {
			case <-he.h.done:
			default:
				continue
			}
		}
		if m.demote(he, why) {
			total -= he.h.memMB.Load()
		}
	}
}

// reduceLater asks he's instance, once it has been paused Config.PausedReduceAfter with its state on
// disk, to give back what it no longer uses, and measures it again for the budget; once a pause.
// In the background, with the manager's context: a resume meanwhile only thaws a sentry that
// finishes its collection running.
func (m *Manager) reduceLater(he hotEntry, now time.Time) {
	r, ok := m.cfg.Driver.(runtime.MemoryReducer)
	if !ok || now.Sub(he.h.since) < m.cfg.PausedReduceAfter {
		return
	}
	select {
	case <-he.h.done:
	default:
		return
	}
	if he.h.err != nil || he.h.reduced.Swap(true) {
		return
	}
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		ctx, cancel := context.WithTimeout(m.bg, time.Minute)
		defer cancel()
		if err := r.ReduceMemory(ctx, he.h.inst); err != nil {
			m.logger(he.e.sb.ID).Debug("reduce the memory of a paused sandbox", "err", err)
			return
		}
		if st, err := m.cfg.Driver.Stats(ctx, he.h.inst); err == nil {
			he.h.memMB.Store(int64(st.MemoryBytes >> 20))
		}
	}()
}

// demote demotes he if it is still paused in memory.
func (m *Manager) demote(he hotEntry, why string) bool {
	if m.bg.Err() != nil {
		return false
	}
	he.e.mu.Lock()
	defer he.e.mu.Unlock()
	if he.e.hot != he.h {
		return false
	}
	if err := m.demoteLocked(m.bg, he.e, why); err != nil {
		m.logger(he.e.sb.ID).Warn("demotion failed; the sandbox stays in memory", "err", err)
		return false
	}
	return true
}

// PausedMemory reports the sandboxes paused in memory and the memory they hold (MiB, as
// measured after their freeze).
func (m *Manager) PausedMemory() (n int, mib int64) {
	for _, he := range m.hotEntries() {
		n++
		mib += he.h.memMB.Load()
	}
	return n, mib
}

// adoptHot makes sb (its instance adoptable: running, frozen or not) a sandbox paused in
// memory at start-up (reconcile): frozen again if a resume the crash cut had thawed it; its
// image is the recorded one, or HotImage if marked complete; else its state goes to disk anew.
// It returns the entry; checkpointInBackground is the caller's once reconcile has swept.
func (m *Manager) adoptHot(ctx context.Context, sb *Sandbox, frozen bool) (*entry, error) {
	if !frozen {
		if err := m.cfg.Driver.Freeze(ctx, sb.Runtime.InstanceID); err != nil {
			return nil, err
		}
	}
	h := &hotState{inst: sb.Runtime.InstanceID, since: time.Now(), done: make(chan struct{})}
	image := ""
	for _, img := range []string{sb.Runtime.Image, sb.Runtime.HotImage} {
		if img != "" && imageComplete(img) {
			image = img
			break
		}
	}
	if sb.Runtime.HotImage == "" || (image != "" && image != sb.Runtime.HotImage) {
		sb.Runtime.HotImage = filepath.Join(m.sandboxDir(sb.ID), "image-"+randomHex(3))
	}
	sb.State, sb.PausedIn, sb.PausedFilesOnly = StatePaused, TierMemory, false
	sb.Runtime.Image = image
	if image != "" {
		h.image = image
		close(h.done)
	}
	if err := m.cfg.Store.PutSandbox(ctx, sb); err != nil {
		return nil, err
	}
	e := &entry{sb: sb, hot: h}
	return e, nil
}

// imageComplete reports whether image was marked complete.
func imageComplete(image string) bool {
	_, err := os.Stat(filepath.Join(image, completeName))
	return err == nil
}

// Demote moves a sandbox paused in memory to disk now (benchmarks, operators): its instance
// ends once its state is on disk. A sandbox paused on disk already is left as it is; a running
// one is ErrConflict.
func (m *Manager) Demote(ctx context.Context, id string) error {
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
	switch {
	case e.sb.State == StateKilled:
		return goneErr(e.sb)
	case e.sb.State != StatePaused:
		return fmt.Errorf("sandbox %q is %s: %w", id, e.sb.State, errdefs.ErrConflict)
	case e.hot == nil:
		return nil
	}
	return m.demoteLocked(ctx, e, "asked for")
}
