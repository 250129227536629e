package sandbox

import (
	"context"
	"time"
)

// reaper ends (or pauses) sandboxes whose timeout has passed, and forgets tombstones older
// than TombstoneTTL.
func (m *Manager) reaper() {
	defer m.wg.Done()
	t := time.NewTicker(500 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-m.stop:
			return
		case <-t.C:
		}
		now := time.Now()
		m.mu.Lock()
		due := make([]*entry, 0, len(m.live))
		for _, e := range m.live {
			due = append(due, e)
		}
		m.mu.Unlock()
		for _, e := range due {
			m.reap(e, now)
		}
	}
}

func (m *Manager) reap(e *entry, now time.Time) {
	ctx := context.Background()
	e.mu.Lock()
	defer e.mu.Unlock()
	sb := e.sb
	switch {
	case sb.State == StateRunning && now.After(sb.EndAt):
		if sb.AutoPause {
			if err := m.pauseOnTimeoutLocked(ctx, e); err == nil {
				return
			} else {
				m.logger(sb.ID).Error("auto-pause failed; killing", "err", err)
			}
		}
		m.endLocked(ctx, e, EndTimeout)
	case sb.State == StateKilled && now.Sub(sb.EndedAt) > m.cfg.TombstoneTTL:
		if err := m.cfg.Store.DeleteSandbox(ctx, sb.ID); err != nil {
			m.logger(sb.ID).Warn("forget ended sandbox", "err", err)
		}
		m.mu.Lock()
		if m.live[sb.ID] == e {
			delete(m.live, sb.ID)
		}
		m.mu.Unlock()
	}
}
