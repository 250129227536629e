package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/overlayfs"
)

// MaxForkCount bounds the children of one fork.
const MaxForkCount = 64

// forkParallelism bounds concurrent restores of one fork.
const forkParallelism = 8

// Snapshot checkpoints a running sandbox (which keeps running) into a named snapshot that can
// be used as a template. It answers once the capture (checkpoint and layer clone) is on the
// node and recorded: with an image store configured the snapshot is then uploaded there as
// content-addressed chunks in the background (SnapshotState uploading, then stored or failed;
// snapupload.go), and creates on this node use the capture meanwhile.
func (m *Manager) Snapshot(ctx context.Context, id, name string) (*Template, error) {
	if name != "" && !nameRe.MatchString(name) {
		return nil, fmt.Errorf("snapshot name %q: must match %s: %w", name, nameRe, errdefs.ErrInvalid)
	}
	snapID := name
	if snapID == "" {
		snapID = "snap-" + randomHex(6)
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
	release, err := m.reserveName(snapID, false)
	if err != nil {
		return nil, err
	}
	defer release()
	e.mu.Lock()
	if err := runningLocked(e); err != nil {
		e.mu.Unlock()
		return nil, err
	}
	sb := m.snapshotOf(e)
	image := filepath.Join(m.cfg.DataDir, "images", snapID)
	if err := os.MkdirAll(image, 0o700); err != nil {
		e.mu.Unlock()
		return nil, err
	}
	tpl, err := m.templateOf(ctx, sb)
	if err != nil {
		e.mu.Unlock()
		os.RemoveAll(image)
		return nil, err
	}
	start := time.Now()
	var stopped time.Duration
	// The image holds a token of its own, not the live sandbox's (snaptoken.go).
	initToken, err := m.withSnapshotToken(ctx, sb, tpl, func() error {
		var cerr error
		_, stopped, cerr = m.captureRunningLocked(ctx, e, image, "")
		return cerr
	})
	e.mu.Unlock()
	if err != nil {
		os.RemoveAll(image)
		m.observe(StageSnapshot, start, err)
		return nil, fmt.Errorf("checkpoint: %w", err)
	}
	ckpt := time.Since(start)
	snap := &Template{
		ID:            snapID,
		Kind:          "snapshot",
		Team:          sb.Team,
		VolumeMounts:  sb.VolumeMounts, // volumemounts.go
		RootFS:        tpl.RootFS,
		Lowers:        tpl.Lowers,
		Image:         image,
		CreatedAt:     time.Now().UTC(),
		Ready:         true,
		CPUCount:      sb.CPUCount,
		MemoryMB:      sb.MemoryMB,
		InitToken:     initToken,
		SourceSandbox: sb.ID,
		Names:         []string{snapID},
		SnapshotState: SnapshotLocal,
	}
	if m.cfg.Images != nil {
		snap.SnapshotState = SnapshotUploading
	}
	// Recorded before the answer: a crash from here on finds the record and resumes the upload.
	if err := m.cfg.Store.PutTemplate(ctx, snap); err != nil {
		os.RemoveAll(image)
		return nil, err
	}
	m.observe(StageSnapshot, start, nil)
	if m.cfg.Images != nil {
		m.startUpload(snapID, image, false)
	}
	m.logger(id).Info("snapshot taken", "snapshot", snapID, "state", snap.SnapshotState, "checkpoint_ms", ckpt.Milliseconds(), "stopped_ms", stopped.Milliseconds(), "total_ms", time.Since(start).Milliseconds())
	return snap, nil
}

// ListSnapshots lists named snapshots, optionally of one source sandbox.
func (m *Manager) ListSnapshots(ctx context.Context, sandboxID string) ([]*Template, error) {
	all, err := m.cfg.Store.ListTemplates(ctx)
	if err != nil {
		return nil, err
	}
	var out []*Template
	for _, t := range all {
		if t.Kind == "snapshot" && (sandboxID == "" || t.SourceSandbox == sandboxID) {
			out = append(out, t)
		}
	}
	return out, nil
}

// Fork checkpoints a running sandbox once (it keeps running) and restores count children from
// that image in parallel, each with its own id, access token, network slot and writable layer
// (over the source's layer captured read-only, where the driver can: forklayers.go).
func (m *Manager) Fork(ctx context.Context, id string, count int, timeout time.Duration) ([]ForkResult, error) {
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
	e.mu.Lock()
	if err := runningLocked(e); err != nil {
		e.mu.Unlock()
		return nil, err
	}
	parent := m.snapshotOf(e)
	image := filepath.Join(m.cfg.DataDir, "images", "fork-"+randomHex(6))
	if err := os.MkdirAll(image, 0o700); err != nil {
		e.mu.Unlock()
		return nil, err
	}
	// The image is removed after the answer (lever 3): the children no longer read it once
	// restored, and a crash before its removal leaves an unfinished image reconcile removes.
	defer func() {
		m.wg.Add(1)
		go func() {
			defer m.wg.Done()
			overlayfs.RemoveTree(image)
		}()
	}()
	tpl, err := m.templateOf(ctx, parent)
	if err != nil {
		e.mu.Unlock()
		return nil, err
	}
	start := time.Now()
	// With a driver that captures layers, the source's layer is captured once as a read-only
	// layer the children stack (forklayers.go), instead of a copy per child.
	top, layerDir := "", ""
	if m.layerCapturer() != nil && !m.forkCopies.Load() {
		ended := m.buildStarted() // no layer collection until the children are recorded
		defer ended()
		forks := filepath.Join(m.cfg.DataDir, forkLayersDir)
		layerDir = filepath.Join(forks, filepath.Base(image))
		err = os.MkdirAll(forks, 0o700)
	}
	if err == nil {
		top, _, err = m.captureRunningLocked(ctx, e, image, layerDir)
	}
	e.mu.Unlock()
	if err != nil {
		m.observe(StageFork, start, err)
		return nil, fmt.Errorf("checkpoint: %w", err)
	}
	ckpt := time.Since(start)
	if top != "" {
		tpl = childTemplate(tpl, top)
	}
	results, ok := m.forkChildren(ctx, parent, tpl, image, count, timeout, nil)
	m.logger(id).Info("sandbox forked", "children", ok, "failed", count-ok,
		"checkpoint_ms", ckpt.Milliseconds(), "total_ms", time.Since(start).Milliseconds())
	if ok == 0 {
		if top != "" {
			m.gcMu.Lock()
			m.gcPending = true // the fork layer is unused: removed once the fork has ended
			m.gcMu.Unlock()
		}
		err := fmt.Errorf("fork: every child failed: %w", errors.Join(results[0].Err))
		m.observe(StageFork, start, err)
		return results, err
	}
	m.observe(StageFork, start, nil)
	return results, nil
}

// forkArgs checks the count and timeout of a fork, the same on every fork path (Fork,
// ForkCheckpoint, ForkFrom): a timeout of 0 is DefaultTimeout, a negative or too long one is
// refused.
func forkArgs(count int, timeout time.Duration) (time.Duration, error) {
	if count < 1 || count > MaxForkCount {
		return 0, fmt.Errorf("count must be between 1 and %d: %w", MaxForkCount, errdefs.ErrInvalid)
	}
	if timeout < 0 || timeout > MaxTimeout {
		return 0, fmt.Errorf("timeout must be between 0 and %s: %w", MaxTimeout, errdefs.ErrInvalid)
	}
	if timeout == 0 {
		timeout = DefaultTimeout
	}
	return timeout, nil
}

// forkChildren restores count children of parent from image, on tpl's stack, in parallel
// (every fork path's fan-out); child i consumes reservations[i], if given (EventStarted). ok
// counts the children that started.
func (m *Manager) forkChildren(ctx context.Context, parent *Sandbox, tpl *Template, image string, count int, timeout time.Duration, reservations []string) (results []ForkResult, ok int) {
	results = make([]ForkResult, count)
	sem := make(chan struct{}, forkParallelism)
	var wg sync.WaitGroup
	for i := range results {
		rid := ""
		if i < len(reservations) {
			rid = reservations[i]
		}
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			results[i] = m.forkChild(ctx, newForkChild(parent, tpl, timeout), tpl, image, parent.AccessToken, rid)
		}(i)
	}
	wg.Wait()
	for _, r := range results {
		if r.Err == nil {
			ok++
		}
	}
	return results, ok
}

// childTemplate is tpl with the captured layer top stacked over its stack.
func childTemplate(tpl *Template, top string) *Template {
	c := *tpl
	c.RootFS, c.Lowers = top, append([]string{tpl.RootFS}, tpl.Lowers...)
	return &c
}

// newForkChild is a child of parent on tpl's stack, not yet launched.
func newForkChild(parent *Sandbox, tpl *Template, timeout time.Duration) *Sandbox {
	now := time.Now().UTC()
	return &Sandbox{
		ID:               newID(),
		Team:             parent.Team,
		TemplateID:       parent.TemplateID,
		Alias:            parent.Alias,
		State:            StateRunning,
		Metadata:         copyMap(parent.Metadata),
		EnvVars:          copyMap(parent.EnvVars),
		AccessToken:      randomHex(16),
		StartedAt:        now,
		EndAt:            now.Add(timeout),
		CPUCount:         parent.CPUCount,
		MemoryMB:         parent.MemoryMB,
		DiskSizeMB:       parent.DiskSizeMB,
		AutoPause:        parent.AutoPause,
		PauseDropsMemory: parent.PauseDropsMemory,
		AutoResume:       parent.AutoResume,
		Timeout:          timeout,
		Network:          parent.Network.ForNew(),
		RootFS:           tpl.RootFS,
		Lowers:           tpl.Lowers,
		AllowInternet:    parent.AllowInternet,
		VolumeMounts:     parent.VolumeMounts, // children mount the same volumes
	}
}

// forkChild restores image as child, on tpl's stack, and records it.
func (m *Manager) forkChild(ctx context.Context, child *Sandbox, tpl *Template, image, initToken, reservation string) ForkResult {
	now := time.Now().UTC()
	child.StartedAt, child.EndAt = now, now.Add(child.Timeout)
	p, err := m.launch(ctx, launchSpec{owner: child.ID, tpl: tpl, image: image, init: child, initToken: initToken,
		cpu: child.CPUCount, memMB: child.MemoryMB, diskMB: child.DiskSizeMB, egress: child.Egress(), mounts: child.VolumeMounts})
	if err != nil {
		m.removeSandboxDir(child.ID)
		return ForkResult{Err: err}
	}
	child.Runtime = p
	e, err := m.register(ctx, child)
	if err != nil {
		return ForkResult{Err: err}
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if err := m.startedLocked(ctx, e, EventStarted, StartForked, reservation); err != nil {
		return ForkResult{Err: err}
	}
	return ForkResult{Sandbox: m.snapshotOf(e)}
}
