package sandbox

import (
	"context"
	"sort"
	"time"
)

// Pre-started instances for resumes. A memory pause answers once its image is durable; then,
// after the paused instance is torn down, the sandbox gets an instance pre-started with its
// pause image's layer (moved in: the runtime fixes the root at create) and a network slot of its
// egress rules, so that its resume restores into a ready instance. It costs what a pre-started
// instance holds (the runtime's processes before any restore, about 11 MiB private, counted at
// the pre-started pool's measured cost within Config.PoolMemoryMB, and a slot), so it is made only while
// the pools' budget has room. The layer goes back into the image when the instance is discarded
// (kill, filesystem-only resume, graceful stop) or, after a crash, when reconcile releases the
// run directory the record does not name: the paused sandbox keeps its files either way.

// prestartForResume pre-starts e's resume instance if e is still paused on image and the budget
// allows. It runs in the background after a pause.
func (m *Manager) prestartForResume(e *entry, image string) {
	if !m.prestarts.enabled() || m.bg.Err() != nil {
		return
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	sb := e.sb
	if sb.State != StatePaused || sb.PausedFilesOnly || sb.Runtime.Image != image || e.pre != nil {
		return
	}
	if !m.poolRoom(m.prestarts.instanceMB()) {
		return
	}
	tpl, err := m.templateOf(m.bg, sb)
	if err != nil {
		return
	}
	start := time.Now()
	p, err := m.launch(m.bg, launchSpec{owner: sb.ID, tpl: tpl, image: image, consume: true, prestart: true,
		cpu: sb.CPUCount, memMB: sb.MemoryMB, diskMB: sb.DiskSizeMB, egress: sb.Egress(), mounts: sb.VolumeMounts})
	if err != nil {
		if m.bg.Err() == nil {
			m.logger(sb.ID).Warn("pre-start for resume failed; the resume restores anew", "err", err)
		}
		return
	}
	e.pre = &p
	m.resumePre.Add(1)
	m.mu.Lock()
	m.preOf[sb.ID] = sb.TemplateID
	m.mu.Unlock()
	m.logger(sb.ID).Debug("pre-started for resume", "instance", p.InstanceID, "ms", time.Since(start).Milliseconds())
}

// takePreLocked hands over e's resume instance (nil if none); the caller restores into it or
// tears it down.
func (m *Manager) takePreLocked(e *entry) *Placement {
	p := e.pre
	if p != nil {
		e.pre = nil
		m.resumePre.Add(-1)
		m.mu.Lock()
		delete(m.preOf, e.sb.ID)
		m.mu.Unlock()
	}
	return p
}

// dropPreLocked discards e's resume instance, if any: its layer goes back to the pause image.
func (m *Manager) dropPreLocked(ctx context.Context, e *entry) {
	if p := m.takePreLocked(e); p != nil {
		m.teardown(context.WithoutCancel(ctx), e.sb.ID, *p)
	}
}

// resumeStates are the instances pre-started for resumes, as pool states of kind "resume"
// (one per template; Ready counts them, SandboxIDs are the paused sandboxes they are for).
func (m *Manager) resumeStates() []PoolState {
	m.mu.Lock()
	defer m.mu.Unlock()
	by := map[string]*PoolState{}
	var out []PoolState
	for id, tpl := range m.preOf {
		st := by[tpl]
		if st == nil {
			st = &PoolState{TemplateID: tpl, Kind: kindResume, SandboxIDs: []string{}}
			by[tpl] = st
		}
		st.Ready++
		st.SandboxIDs = append(st.SandboxIDs, id)
	}
	for _, st := range by {
		sort.Strings(st.SandboxIDs)
		out = append(out, *st)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].TemplateID < out[j].TemplateID })
	return out
}

// dropAllPre discards every resume instance (graceful stop).
func (m *Manager) dropAllPre() int {
	m.mu.Lock()
	entries := make([]*entry, 0, len(m.live))
	for _, e := range m.live {
		entries = append(entries, e)
	}
	m.mu.Unlock()
	n := 0
	for _, e := range entries {
		e.mu.Lock()
		if e.pre != nil {
			m.dropPreLocked(context.Background(), e)
			n++
		}
		e.mu.Unlock()
	}
	return n
}
