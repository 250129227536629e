package sandbox

import (
	"context"
	"sort"
)

// List returns the sandboxes matching f, newest first. Ended sandboxes are listed only when
// f.States asks for StateKilled.
func (m *Manager) List(ctx context.Context, f ListFilter) ([]*Sandbox, error) {
	m.mu.Lock()
	entries := make([]*entry, 0, len(m.live))
	for _, e := range m.live {
		entries = append(entries, e)
	}
	m.mu.Unlock()
	states := f.States
	if len(states) == 0 {
		states = []State{StateRunning, StatePaused}
	}
	var out []*Sandbox
	for _, e := range entries {
		e.mu.Lock()
		sb := m.snapshotOf(e)
		e.mu.Unlock()
		if !matches(sb, f, states) {
			continue
		}
		out = append(out, sb)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].StartedAt.Equal(out[j].StartedAt) {
			return out[i].ID > out[j].ID
		}
		return out[i].StartedAt.After(out[j].StartedAt)
	})
	return out, nil
}

func matches(sb *Sandbox, f ListFilter, states []State) bool {
	ok := false
	for _, s := range states {
		if sb.State == s {
			ok = true
		}
	}
	if !ok {
		return false
	}
	for k, v := range f.Metadata {
		if sb.Metadata[k] != v {
			return false
		}
	}
	if f.TemplateID != "" && sb.TemplateID != f.TemplateID && sb.Alias != f.TemplateID {
		return false
	}
	if !f.StartedAfter.IsZero() && !sb.StartedAt.After(f.StartedAfter) {
		return false
	}
	return true
}
