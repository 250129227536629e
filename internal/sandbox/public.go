package sandbox

import (
	"context"
	"fmt"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// SetTemplatePublic makes a template (or snapshot) readable and usable by every team, or its
// team's alone again (E2B's PATCH /templates/{id} {public}). The caller checked that the
// caller's team owns it.
func (m *Manager) SetTemplatePublic(ctx context.Context, id string, public bool) (*Template, error) {
	m.mu.Lock()
	busy := m.names[id]
	m.mu.Unlock()
	if busy {
		return nil, fmt.Errorf("%q is being built or snapshotted right now: %w", id, errdefs.ErrConflict)
	}
	t, err := m.GetTemplate(ctx, id)
	if err != nil {
		return nil, err
	}
	t.Public = public
	if err := m.cfg.Store.PutTemplate(ctx, t); err != nil {
		return nil, err
	}
	return t, nil
}
