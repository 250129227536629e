package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

// Reasons a sandbox ended (Sandbox.EndReason), besides the driver's runtime.ExitReason values.
const (
	EndKilled  = "killed"
	EndTimeout = "timeout"
	EndLost    = "lost: its instance no longer ran when ember restarted"
)

// Kill stops a sandbox and releases everything it holds.
func (m *Manager) Kill(ctx context.Context, id string) error {
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
	m.endLocked(ctx, e, EndKilled)
	return nil
}

// endLocked ends a sandbox for reason: everything it holds is released (its instance, slot,
// directory and pause image) and it stays known as a tombstone for TombstoneTTL, so calls to
// it say why it is gone.
func (m *Manager) endLocked(ctx context.Context, e *entry, reason string) {
	sb := e.sb
	ctx = context.WithoutCancel(ctx)
	e.settleLocked()
	if h := e.hot; h != nil {
		waitHot(h, true) // its checkpoint writes into the directory removed below
		e.hot = nil
	}
	m.dropPreLocked(ctx, e)
	m.dropCheckpointsLocked(ctx, e) // step checkpoints go with it (checkpoints.go)
	m.teardownSandbox(ctx, sb.ID, sb.Runtime)
	sb.State = StateKilled
	sb.EndReason = reason
	sb.EndedAt = time.Now().UTC()
	sb.Runtime = Placement{SlotIndex: noSlot}
	if err := m.cfg.Store.PutSandbox(ctx, sb); err != nil {
		m.logger(sb.ID).Warn("record end", "err", err)
	}
	m.logger(sb.ID).Info("sandbox ended", "reason", reason)
	m.forkLayerUserEnded(sb)
	m.emitLocked(ctx, e, EventEnded, reason)
}

// SetTimeout sets a running sandbox's end to now + d. Paused sandboxes answer not found, as
// E2B does (old SDKs rely on it to fall back to resume).
func (m *Manager) SetTimeout(ctx context.Context, id string, d time.Duration) error {
	if d < 0 || d > MaxTimeout {
		return fmt.Errorf("timeout must be between 0 and %s: %w", MaxTimeout, errdefs.ErrInvalid)
	}
	e, err := m.entry(id)
	if err != nil {
		return err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	switch e.sb.State {
	case StateKilled:
		return goneErr(e.sb)
	case StatePaused:
		return fmt.Errorf("sandbox %q is not running: %w", id, errdefs.ErrNotFound)
	}
	e.sb.EndAt = time.Now().UTC().Add(d)
	return m.cfg.Store.PutSandbox(ctx, e.sb)
}

// ---- pause, resume ----

// settleLocked waits until the teardown that followed e's last pause is done: the paused
// instance is gone and its layer is in the pause image (its resume restores it, a kill removes
// it). The teardown does not take e.mu, so e.mu may be held.
func (e *entry) settleLocked() {
	if e.released != nil {
		<-e.released
		e.released = nil
	}
}

// Pause checkpoints a running sandbox and releases its processes, memory and network slot.
func (m *Manager) Pause(ctx context.Context, id string) error {
	return m.PauseWith(ctx, id, PauseOptions{KeepMemory: true})
}

// PauseWith pauses a sandbox; with opts.KeepMemory false only its filesystem is kept and a
// resume boots it again on its files.
func (m *Manager) PauseWith(ctx context.Context, id string, opts PauseOptions) error {
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
	switch e.sb.State {
	case StatePaused:
		return fmt.Errorf("sandbox %q is already paused: %w", id, errdefs.ErrConflict)
	case StateKilled:
		return goneErr(e.sb)
	}
	mode := opts.Mode
	if mode == "" {
		mode = m.cfg.PauseMode
	}
	if opts.KeepMemory && mode == PauseHot {
		return m.hotPauseLocked(ctx, e)
	}
	return m.pauseLocked(ctx, e, opts.KeepMemory, !opts.NoPrestart, opts.LayerFirst)
}

// pauseOnTimeoutLocked is the reaper's pause of a sandbox created with onTimeout pause.
func (m *Manager) pauseOnTimeoutLocked(ctx context.Context, e *entry) error {
	if !e.sb.PauseDropsMemory && m.cfg.PauseMode == PauseHot {
		return m.hotPauseLocked(ctx, e)
	}
	// Only a sandbox that traffic wakes gets an instance pre-started for its resume.
	return m.pauseLocked(ctx, e, !e.sb.PauseDropsMemory, e.sb.AutoResume, false)
}

// pauseLocked pauses e by a checkpoint that ends its instance (a filesystem-only pause, or
// PauseCheckpoint); with prestart (and memory kept) an instance is pre-started for its resume
// afterwards, budget permitting.
func (m *Manager) pauseLocked(ctx context.Context, e *entry, keepMemory, prestart, layerFirst bool) error {
	sb := e.sb
	start := time.Now()
	tl := runtime.NewTimeline()
	image := filepath.Join(m.sandboxDir(sb.ID), "image-"+randomHex(3))
	if err := os.MkdirAll(image, 0o700); err != nil {
		return err
	}
	tl.Mark("mkdir")
	// A memory pause answers once the memory image is written: the instance's layer reaches the
	// image in the teardown after the answer (DeferLayer), which a resume or kill waits for.
	// In cluster mode the image goes to the store before the answer (pauseStored), layer and
	// all, so there the layer moves in first.
	stored := keepMemory && m.cfg.StorePauses && len(m.listeners()) > 0
	opts := runtime.CheckpointOptions{FilesOnly: !keepMemory, DeferLayer: keepMemory && !layerFirst && !stored}
	if err := m.cfg.Driver.Checkpoint(ctx, sb.Runtime.InstanceID, image, opts); err != nil {
		os.RemoveAll(image)
		m.observe(StagePause, start, err)
		return fmt.Errorf("checkpoint: %w", err)
	}
	tl.Mark("checkpoint")
	// The image is complete: say so on disk before the record does, so that a crash in
	// between finds a paused sandbox (reconcile), not a lost one.
	if err := markComplete(image, !keepMemory); err != nil {
		m.logger(sb.ID).Warn("mark pause image complete", "err", err)
	}
	old := sb.Runtime
	sb.State = StatePaused
	sb.PausedFilesOnly = !keepMemory
	sb.PausedIn = TierDisk
	sb.Runtime = Placement{Image: image, SlotIndex: noSlot}
	if err := m.cfg.Store.PutSandbox(ctx, sb); err != nil {
		// The instance is stopped and its image complete; keep the sandbox paused in memory.
		m.logger(sb.ID).Error("record pause", "err", err)
	}
	tl.Mark("record")
	m.guestT.close(old.GuestIP)
	tl.Mark("transport")
	m.emitLocked(ctx, e, EventPaused, "")
	if stored {
		m.pauseStored(ctx, e) // cluster mode: resumable on any node (portable.go)
		tl.Mark("stored")
	}
	tl.Log(m.logger(sb.ID), "pause timeline", "memory", keepMemory)
	m.observe(StagePause, start, nil)
	m.logger(sb.ID).Info("sandbox paused", "memory", keepMemory, "ms", time.Since(start).Milliseconds())
	// The checkpoint stopped every process of the instance and the record says paused: what is
	// left (runsc's state, the network slot, the run directory) is released after answering.
	// A crash before it finishes leaves orphans that reconcile removes at the next start.
	released := make(chan struct{})
	e.released = released
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		m.teardown(context.Background(), sb.ID, old)
		close(released)
		if keepMemory && prestart {
			m.prestartForResume(e, image)
		}
	}()
	return nil
}

// Connect resumes a paused sandbox, or extends a running one's timeout.
func (m *Manager) Connect(ctx context.Context, id string, timeout time.Duration) (*Sandbox, bool, error) {
	return m.ConnectWith(ctx, id, ConnectOptions{Timeout: timeout})
}

// ConnectWith resumes a paused sandbox (resumed=true) or extends a running one's timeout.
func (m *Manager) ConnectWith(ctx context.Context, id string, opts ConnectOptions) (*Sandbox, bool, error) {
	timeout := opts.Timeout
	if timeout < 0 || timeout > MaxTimeout {
		return nil, false, fmt.Errorf("timeout must be between 0 and %s: %w", MaxTimeout, errdefs.ErrInvalid)
	}
	if timeout == 0 {
		timeout = DefaultTimeout
	}
	ctx, done, err := m.op(ctx)
	if err != nil {
		return nil, false, err
	}
	defer done()
	e, err := m.entry(id)
	if err != nil {
		return nil, false, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	sb := e.sb
	switch sb.State {
	case StateRunning:
		if end := time.Now().UTC().Add(timeout); end.After(sb.EndAt) {
			sb.EndAt = end
			if err := m.cfg.Store.PutSandbox(ctx, sb); err != nil {
				return nil, false, err
			}
		}
		return m.snapshotOf(e), false, nil
	case StateKilled:
		return nil, false, goneErr(sb)
	}
	if err := m.resumeLocked(ctx, e, timeout, opts.Reboot); err != nil {
		return nil, false, err
	}
	return m.snapshotOf(e), true, nil
}

// resumeLocked brings a paused sandbox back: a restore of its pause image, or (a filesystem-only
// pause, or reboot) a new boot on its files with the same identity.
func (m *Manager) resumeLocked(ctx context.Context, e *entry, timeout time.Duration, reboot bool) error {
	sb := e.sb
	if e.hot != nil {
		if !reboot {
			if thawed, err := m.thawLocked(ctx, e, timeout); thawed || err != nil {
				return err
			}
		} else if err := m.demoteLocked(ctx, e, "resume with a reboot"); err != nil {
			return err
		}
	}
	start := time.Now()
	tl := runtime.NewTimeline()
	e.settleLocked()
	tl.Mark("settle")
	tpl, err := m.templateOf(ctx, sb)
	if err != nil {
		return err
	}
	tl.Mark("template")
	image := sb.Runtime.Image
	spec := launchSpec{owner: sb.ID, tpl: tpl, image: image, consume: true,
		cpu: sb.CPUCount, memMB: sb.MemoryMB, diskMB: sb.DiskSizeMB, egress: sb.Egress(), mounts: sb.VolumeMounts}
	boot := sb.PausedFilesOnly || reboot
	var p Placement
	prestarted, recorded := false, false
	endAt := time.Now().UTC().Add(timeout)
	if pre := m.takePreLocked(e); pre != nil && !boot {
		// Restore into the instance pre-started with the image's layer; if that fails, the
		// teardown gives the layer back and a plain resume follows. Its instance is known
		// before the restore, so the record saying so is written meanwhile (pipeline.go).
		into := spec
		into.into = pre
		rec := m.putAsync(ctx, resumedRecord(sb, *pre, endAt))
		p, err = m.launch(ctx, into)
		recErr := <-rec
		switch {
		case err != nil:
			m.logger(sb.ID).Warn("resume into a pre-started instance failed; restoring anew", "err", err)
			if recErr == nil {
				// Back to paused on its image (the teardown gave the layer back to it).
				if perr := m.cfg.Store.PutSandbox(ctx, sb); perr != nil {
					m.logger(sb.ID).Warn("record the failed resume", "err", perr)
				}
			}
		case recErr != nil:
			m.teardown(context.WithoutCancel(ctx), sb.ID, p)
			m.cfg.Store.PutSandbox(ctx, sb)
			m.observe(StageResume, start, recErr)
			return recErr
		default:
			prestarted, recorded = true, true
		}
	} else if pre != nil {
		m.teardown(context.WithoutCancel(ctx), sb.ID, *pre) // the boot takes the layer from the image
	}
	if boot {
		// A fresh envd: it learns the sandbox's identity (the same id, token and env vars) again.
		spec.image, spec.layerFrom, spec.init = "", image, sb
	}
	if p.InstanceID == "" {
		if p, err = m.launch(ctx, spec); err != nil {
			m.observe(StageResume, start, err)
			return fmt.Errorf("resume: %w", err)
		}
	}
	tl.Mark("launch")
	tier := sb.PausedIn
	if recorded {
		sb.Runtime, sb.State, sb.PausedFilesOnly, sb.EndAt, sb.PausedIn = p, StateRunning, false, endAt, ""
	} else {
		sb.Runtime = p
		sb.State = StateRunning
		sb.PausedFilesOnly = false
		sb.PausedIn = ""
		sb.EndAt = time.Now().UTC().Add(timeout)
	}
	if err := m.putUnless(ctx, recorded, sb); err != nil {
		m.teardown(context.WithoutCancel(ctx), sb.ID, p)
		sb.State, sb.PausedFilesOnly, sb.Runtime, sb.PausedIn = StatePaused, boot, Placement{Image: image, SlotIndex: noSlot}, tier
		m.observe(StageResume, start, err)
		return err
	}
	tl.Mark("record")
	m.observe(StageResume, start, nil)
	// The image is spent (its layer is the instance's now); removing it need not hold the
	// answer: a crash first leaves a stale image, which reconcile removes.
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		os.RemoveAll(image)
	}()
	m.guestT.open(p.GuestIP, p.InstanceID, true)
	m.watch(e, p.InstanceID)
	tl.Mark("watch")
	if err := m.startedLocked(ctx, e, EventResumed, "", ""); err != nil {
		return err
	}
	tl.Mark("listeners")
	tl.Log(m.logger(sb.ID), "resume timeline", "prestarted", prestarted, "boot", boot)
	m.logger(sb.ID).Info("sandbox resumed", "instance", p.InstanceID, "boot", boot, "prestarted", prestarted, "ms", time.Since(start).Milliseconds())
	return nil
}

// templateOf returns the template sb runs on. A deleted template (or snapshot) leaves its
// rootfs in place for the sandboxes that run on it: they keep working from the rootfs they
// recorded.
func (m *Manager) templateOf(ctx context.Context, sb *Sandbox) (*Template, error) {
	tpl, err := m.cfg.Store.GetTemplate(ctx, sb.TemplateID)
	switch {
	case err == nil:
		if sb.RootFS == "" || tpl.RootFS == sb.RootFS {
			return tpl, nil
		}
		// Rebuilt since: the sandbox stays on the rootfs (stack) it started on.
		c := *tpl
		c.RootFS, c.Lowers = sb.RootFS, sb.Lowers
		return &c, nil
	case errors.Is(err, errdefs.ErrNotFound) && sb.RootFS != "":
		return &Template{ID: sb.TemplateID, Kind: "template", RootFS: sb.RootFS, Lowers: sb.Lowers, Ready: true}, nil
	}
	return nil, fmt.Errorf("template %q of sandbox %q: %w", sb.TemplateID, sb.ID, err)
}
