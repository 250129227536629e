package sandbox

import (
	"context"
	"math"
	"time"
)

// Rollback standbys. After a checkpoint (or a rollback), the Manager restores the sandbox's
// head checkpoint ahead of need into an instance of the sandbox's own (its own network slot,
// under the sandbox's directory), waits for envd, and freezes it (Driver.Freeze): no CPU, its
// memory held. A rollback to that checkpoint then thaws the standby and swaps it in — no
// restore — and a new standby is built behind it. The standby's memory counts in the pools'
// budget (PoolMemoryMB): none is built when it does not fit. A standby is not durable (a
// restart sweeps it: it is not recorded), and it is dropped when its checkpoint is deleted, the
// head moves on, or the sandbox ends.
//
// Between its restore and its freeze the standby's processes run for as long as envd takes to
// answer (milliseconds): a rollback by swap continues from that point, a few milliseconds of
// the sandbox's own time after the checkpoint.

// standby is one frozen instance restored from checkpoint ckptID.
type standby struct {
	ckptID string
	p      Placement
	mb     int64 // what it counts in the budget (MiB)
}

// CheckpointStandby turns rollback standbys on (the default) or off (benchmarks: rollback by
// restore). Standbys that exist are kept.
func (m *Manager) CheckpointStandby(on bool) { m.noStandby.Store(!on) }

// dropStandbyLocked discards e's standby, if any, and cancels one being built. With wait, no
// instance of either is left when it returns; else they are torn down in the background.
func (m *Manager) dropStandbyLocked(e *entry, wait bool) {
	e.smu.Lock()
	e.standbyGen++
	s, stop, done := e.standby, e.standbyStop, e.standbyDone
	e.standby, e.standbyStop, e.standbyDone, e.standbyCkpt = nil, nil, nil, ""
	e.smu.Unlock()
	if stop != nil {
		stop()
	}
	end := func() {
		if s != nil {
			m.teardown(context.Background(), e.sb.ID, s.p)
			m.standbyMB.Add(-s.mb)
		}
		if done != nil {
			<-done
		}
	}
	if wait {
		end()
		return
	}
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		end()
	}()
}

// takeStandbyLocked hands over e's standby if it holds checkpoint cid (else nil): the caller
// thaws it or tears it down.
func (m *Manager) takeStandbyLocked(e *entry, cid string) *standby {
	e.smu.Lock()
	defer e.smu.Unlock()
	s := e.standby
	if s == nil || s.ckptID != cid {
		return nil
	}
	e.standby = nil
	e.standbyGen++
	m.standbyMB.Add(-s.mb)
	s.mb = 0
	return s
}

// awaitStandbyLocked waits (while ctx lasts) for a standby of checkpoint cid that is still being
// made, so that a rollback right after a checkpoint or another rollback swaps it in: its restore
// started before the rollback did, so it is ready before a restore started now would be, and
// two restores of one checkpoint at once only slow each other (the agent loop's tree search:
// under load most rollbacks came before their standby was ready and restored beside it).
func (m *Manager) awaitStandbyLocked(ctx context.Context, e *entry, cid string) {
	e.smu.Lock()
	ready, done, building := e.standby != nil, e.standbyDone, e.standbyCkpt
	e.smu.Unlock()
	if ready || done == nil || building != cid {
		return
	}
	select {
	case <-done:
	case <-ctx.Done():
	}
}

// standbyLocked replaces e's standby with one of ck, built in the background (budget
// permitting).
func (m *Manager) standbyLocked(e *entry, ck *Checkpoint) {
	m.dropStandbyLocked(e, false)
	if m.noStandby.Load() || m.bg.Err() != nil {
		return
	}
	sb := m.snapshotOf(e)
	ctx, stop := context.WithCancel(m.bg)
	done := make(chan struct{})
	e.smu.Lock()
	gen := e.standbyGen
	e.standbyStop, e.standbyDone, e.standbyCkpt = stop, done, ck.ID
	e.smu.Unlock()
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		defer close(done)
		defer stop()
		m.buildStandby(ctx, e, sb, ck, gen)
	}()
}

// buildStandby restores ck for sb (as it was when asked) and freezes it; it becomes e's
// standby unless something moved on meanwhile (gen). It never takes e.mu.
func (m *Manager) buildStandby(ctx context.Context, e *entry, sb *Sandbox, ck *Checkpoint, gen uint64) {
	mb := int64(math.Ceil(m.pool.instanceMB()))
	if !m.poolRoom(float64(mb)) {
		m.logger(sb.ID).Debug("no rollback standby: the pools' memory budget is full", "checkpoint", ck.ID)
		return
	}
	m.standbyMB.Add(mb) // reserved while it is made
	start := time.Now()
	tpl, err := m.templateOf(ctx, sb)
	if err != nil {
		m.standbyMB.Add(-mb)
		return
	}
	onto := *tpl
	onto.RootFS, onto.Lowers = ck.RootFS, ck.Lowers
	init, initToken := ck.reinit(sb) // envd takes the sandbox's token before the freeze
	p, err := m.launch(ctx, launchSpec{owner: sb.ID, tpl: &onto, image: ck.Image, busyDir: sb.Runtime.StateDir,
		init: init, initToken: initToken,
		cpu: sb.CPUCount, memMB: sb.MemoryMB, diskMB: sb.DiskSizeMB, egress: sb.Egress()})
	if err == nil {
		if err = m.cfg.Driver.Freeze(ctx, p.InstanceID); err != nil {
			m.teardown(context.Background(), sb.ID, p)
		}
	}
	if err != nil {
		m.standbyMB.Add(-mb)
		if ctx.Err() == nil {
			m.logger(sb.ID).Warn("rollback standby failed; a rollback restores", "checkpoint", ck.ID, "err", err)
		}
		return
	}
	// Counted at what it holds once frozen.
	if st, err := m.cfg.Driver.Stats(ctx, p.InstanceID); err == nil && st.MemoryBytes > 0 {
		real := int64(math.Ceil(float64(st.MemoryBytes) / (1 << 20)))
		m.standbyMB.Add(real - mb)
		mb = real
	}
	e.smu.Lock()
	if e.standbyGen != gen || e.standby != nil || ctx.Err() != nil {
		e.smu.Unlock()
		m.teardown(context.Background(), sb.ID, p)
		m.standbyMB.Add(-mb)
		return
	}
	e.standby = &standby{ckptID: ck.ID, p: p, mb: mb}
	e.smu.Unlock()
	m.logger(sb.ID).Debug("rollback standby ready", "checkpoint", ck.ID, "instance", p.InstanceID, "mib", mb,
		"ms", time.Since(start).Milliseconds())
}

// dropAllStandbys, at shutdown (background work stopped), ends every standby: they are not
// recorded, so the next start would only sweep them. It returns how many there were.
func (m *Manager) dropAllStandbys() int {
	m.mu.Lock()
	entries := make([]*entry, 0, len(m.live))
	for _, e := range m.live {
		entries = append(entries, e)
	}
	m.mu.Unlock()
	n := 0
	for _, e := range entries {
		e.mu.Lock()
		e.smu.Lock()
		had := e.standby != nil || e.standbyDone != nil
		e.smu.Unlock()
		if had {
			m.dropStandbyLocked(e, true)
			n++
		}
		e.mu.Unlock()
	}
	return n
}
