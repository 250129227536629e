package sandbox

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

func (m *Manager) resolveTemplate(ctx context.Context, id string) (*Template, error) {
	if id == "" {
		id = "base"
	}
	if name, tag, ok := strings.Cut(id, ":"); ok {
		// E2B's name:tag: every tag of a template names its current build.
		t, err := m.resolveTemplate(ctx, name)
		if errors.Is(err, errdefs.ErrNotFound) {
			return nil, fmt.Errorf("template %q not found: %w", id, errdefs.ErrNotFound)
		}
		if err != nil {
			return nil, err
		}
		if tag != "latest" && !t.HasTag(tag) {
			return nil, fmt.Errorf("template %q not found: %w", id, errdefs.ErrNotFound)
		}
		return t, nil
	}
	if !nameRe.MatchString(id) {
		return nil, fmt.Errorf("template %q: %w", id, errdefs.ErrNotFound)
	}
	t, err := m.cfg.Store.GetTemplate(ctx, id)
	if err == nil {
		return t, nil
	}
	if !errors.Is(err, errdefs.ErrNotFound) {
		return nil, err
	}
	all, lerr := m.cfg.Store.ListTemplates(ctx)
	if lerr != nil {
		return nil, lerr
	}
	for _, t := range all {
		for _, a := range append(t.Aliases, t.Names...) {
			if a == id {
				return t, nil
			}
		}
	}
	return nil, fmt.Errorf("template %q not found: %w", id, errdefs.ErrNotFound)
}

// Create starts a new sandbox from a template: an assignment from the warm pool when one is
// ready, else a restore of the template's checkpoint (into a pre-started instance when one is
// ready), else (no checkpoint, or req.Cold) a boot.
func (m *Manager) Create(ctx context.Context, req CreateRequest) (*Sandbox, error) {
	if err := ValidateVolumeMounts(req.VolumeMounts); err != nil {
		return nil, err
	}
	if req.Timeout < 0 || req.Timeout > MaxTimeout {
		return nil, fmt.Errorf("timeout must be between 0 and %s: %w", MaxTimeout, errdefs.ErrInvalid)
	}
	keepMemory := req.AutoPauseMemory == nil || *req.AutoPauseMemory
	autoResume := req.AutoResume != nil && *req.AutoResume
	switch {
	case req.AutoPauseMemory != nil && !req.AutoPause:
		return nil, fmt.Errorf("%s: %w", msgKeepMemoryNeedsPause, errdefs.ErrInvalid)
	case autoResume && !req.AutoPause:
		return nil, fmt.Errorf("%s: %w", msgAutoResumeNeedsPause, errdefs.ErrInvalid)
	case autoResume && !keepMemory:
		return nil, fmt.Errorf("%s: %w", msgAutoResumeNeedsMemory, errdefs.ErrInvalid)
	}
	ctx, done, err := m.op(ctx)
	if err != nil {
		return nil, err
	}
	defer done()
	tpl, err := m.resolveOrBuild(ctx, req.TemplateID)
	if err != nil {
		return nil, err
	}
	if !tpl.Ready {
		return nil, fmt.Errorf("template %q is still building: %w", tpl.ID, errdefs.ErrUnavailable)
	}
	if req.VolumeMounts, err = mountsFor(tpl, req.VolumeMounts); err != nil { // volumemounts.go
		return nil, err
	}
	timeout := req.Timeout
	if timeout == 0 {
		timeout = DefaultTimeout
	}
	allow := true
	if req.AllowInternet != nil {
		allow = *req.AllowInternet
	}
	now := time.Now().UTC()
	sb := &Sandbox{
		ID:               newID(),
		Team:             req.Team,
		TemplateID:       tpl.ID,
		State:            StateRunning,
		Metadata:         copyMap(req.Metadata),
		EnvVars:          copyMap(req.EnvVars),
		AccessToken:      randomHex(16),
		StartedAt:        now,
		EndAt:            now.Add(timeout),
		CPUCount:         orDefault(tpl.CPUCount, m.cfg.CPUCount),
		MemoryMB:         orDefault(tpl.MemoryMB, m.cfg.MemoryMB),
		DiskSizeMB:       orDefault(tpl.DiskMB, m.cfg.DiskMB),
		AutoPause:        req.AutoPause,
		PauseDropsMemory: req.AutoPause && !keepMemory,
		AutoResume:       autoResume,
		Timeout:          timeout,
		AllowInternet:    allow,
		Network:          req.Network.ForNew(),
		RootFS:           tpl.RootFS,
		Lowers:           tpl.Lowers,
		VolumeMounts:     append([]VolumeMount(nil), req.VolumeMounts...),
	}
	if len(tpl.Aliases) > 0 {
		sb.Alias = tpl.Aliases[0]
	}
	started := time.Now()
	tl := runtime.NewTimeline()
	how := ""
	pooling := !req.Cold && tpl.Image != "" && !req.NoPool && req.IsDefaultEgress() && len(req.VolumeMounts) == 0
	if pooling && !req.NoRestoredPool {
		if pe := m.pool.take(tpl, sb.CPUCount, sb.MemoryMB, sb.DiskSizeMB); pe != nil {
			// The pool instance already lives under the id it was made for: the sandbox takes it.
			sb.ID = pe.owner
			// Through its guest transport, opened with the pool's warm-up: /init and then the
			// sandbox's first request reuse the warm-up's connection.
			m.guestT.open(pe.place.GuestIP, pe.place.InstanceID, false)
			if err := m.initEnvd(ctx, m.guest, envdBase(pe.place.GuestIP), sb, tpl.InitToken, tpl); err == nil {
				sb.Runtime = pe.place
				how = "pool"
			} else {
				m.logger(pe.owner).Warn("pool instance did not take its identity; restoring instead", "err", err)
				m.teardownSandbox(context.WithoutCancel(ctx), pe.owner, pe.place)
				sb.ID = newID()
			}
		}
	}
	// A pre-started instance runs nothing yet: its slot can take other egress rules first.
	up, canUpdate := m.cfg.Network.(egressUpdater)
	if how == "" && !req.Cold && tpl.Image != "" && !req.NoPool && (pooling || canUpdate) && len(req.VolumeMounts) == 0 {
		if pe := m.prestarts.take(tpl, sb.CPUCount, sb.MemoryMB, sb.DiskSizeMB); pe != nil {
			// Like a pool instance it lives under the id it was made for.
			sb.ID = pe.owner
			spec := launchSpec{owner: sb.ID, tpl: tpl, image: pe.image, into: &pe.place, init: sb, initToken: tpl.InitToken, guest: true,
				cpu: sb.CPUCount, memMB: sb.MemoryMB, diskMB: sb.DiskSizeMB, egress: sb.Egress()}
			err = nil
			if !sb.Egress().IsDefault() {
				if err = up.Update(ctx, pe.place.SlotIndex, sb.Egress()); err != nil {
					m.teardown(context.WithoutCancel(ctx), pe.owner, pe.place)
				}
			}
			if err == nil {
				sb.Runtime, err = m.launch(ctx, spec)
			}
			if err == nil {
				how = "prestarted"
			} else {
				// launch tore the instance down; a plain restore follows.
				m.logger(pe.owner).Warn("restore into a pre-started instance failed; restoring anew", "err", err)
				m.removeSandboxDir(pe.owner)
				sb.ID = newID()
			}
		}
	}
	if how == "" {
		spec := launchSpec{owner: sb.ID, tpl: tpl, init: sb, initToken: tpl.InitToken, guest: true,
			cpu: sb.CPUCount, memMB: sb.MemoryMB, diskMB: sb.DiskSizeMB, egress: sb.Egress(), mounts: sb.VolumeMounts}
		how = "restore"
		// runsc refuses to restore a checkpoint under other mounts ("Mounts" does not match
		// across checkpoint restore): a sandbox with volumes boots (volumemounts.go).
		if req.Cold || tpl.Image == "" || (len(sb.VolumeMounts) > 0 && tpl.Kind != "snapshot") {
			how, spec.initToken = "boot", ""
		} else if spec.image, err = m.templateImage(ctx, tpl); err != nil {
			return nil, err
		}
		if sb.Runtime, err = m.launch(ctx, spec); err != nil {
			m.observe(createStage(how), started, err)
			m.removeSandboxDir(sb.ID)
			m.logger(sb.ID).Error("create failed", "template_id", tpl.ID, "how", how, "err", err)
			return nil, err
		}
	}
	tl.Mark("launch")
	sb.StartedAt = time.Now().UTC()
	sb.EndAt = sb.StartedAt.Add(timeout)
	e, err := m.register(ctx, sb)
	m.observe(createStage(how), started, err)
	if err != nil {
		return nil, err
	}
	tl.Mark("register")
	tl.Log(m.logger(sb.ID), "create timeline", "how", how)
	m.logger(sb.ID).Info("sandbox created", "template_id", tpl.ID, "how", how, "instance", sb.Runtime.InstanceID, "ms", time.Since(started).Milliseconds())
	e.mu.Lock()
	defer e.mu.Unlock()
	if err := m.startedLocked(ctx, e, EventStarted, StartCreated, req.Reservation); err != nil {
		return nil, err
	}
	// Refills hold back until the caller's first request (its first command) has finished.
	id := sb.ID
	m.firstReqs.add(id)
	m.guestT.watchFirst(sb.Runtime.GuestIP, func() { m.firstReqs.done(id) })
	return m.snapshotOf(e), nil
}

// register makes a launched sandbox known: persisted first (a crash after this point finds
// the record and re-adopts the instance), then live, then watched. On failure the sandbox is
// torn down.
func (m *Manager) register(ctx context.Context, sb *Sandbox) (*entry, error) {
	err := m.faults.hit("register")
	if err == nil {
		err = m.cfg.Store.PutSandbox(ctx, sb)
	}
	if err != nil {
		m.teardownSandbox(context.WithoutCancel(ctx), sb.ID, sb.Runtime)
		return nil, err
	}
	e := &entry{sb: sb}
	m.mu.Lock()
	m.live[sb.ID] = e
	m.mu.Unlock()
	m.guestT.open(sb.Runtime.GuestIP, sb.Runtime.InstanceID, true)
	m.watch(e, sb.Runtime.InstanceID)
	return e, nil
}

// createStage is the stage a create took ("pool", "restore" or "boot").
func createStage(how string) Stage {
	switch how {
	case "pool":
		return StageCreatePool
	case "boot":
		return StageCreateBoot
	}
	return StageCreateRestore
}

func orDefault(v, d int) int {
	if v > 0 {
		return v
	}
	return d
}
