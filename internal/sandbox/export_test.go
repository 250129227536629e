package sandbox

import "context"

// TeardownSandbox runs the teardown of an ending sandbox (teardownSandbox) on id and its
// placement p, for tests that check it can run again.
func (m *Manager) TeardownSandbox(ctx context.Context, id string, p Placement) {
	m.teardownSandbox(ctx, id, p)
}
