package sandbox

import (
	"context"
	"time"
)

// Record writes off the critical path (issue 11). A store write is a synced transaction
// (several ms on a loaded host); where what it records is known before the runtime work it
// follows, it runs alongside that work instead of after it.
//
// A resume into a pre-started instance records the sandbox running on that instance while the
// restore runs. A crash in between is safe either way: if the restore had finished, reconcile
// adopts the running instance (its envd already holds the sandbox's identity: a memory resume
// gives it nothing new); if not, the instance is not running, the pause image is still there
// and complete, and reconcile finds the sandbox paused on it, the layer given back to the image
// when the pre-started instance's directory is released. Creates do not do this: their instance
// gets the sandbox's identity (/init) only after the restore, so a record written before could
// adopt an instance that never got it.

// putAsync writes sb (a copy the caller no longer touches) and delivers the result.
func (m *Manager) putAsync(ctx context.Context, sb Sandbox) <-chan error {
	ch := make(chan error, 1)
	go func() { ch <- m.cfg.Store.PutSandbox(context.WithoutCancel(ctx), &sb) }()
	return ch
}

// putUnless writes sb unless it is already recorded.
func (m *Manager) putUnless(ctx context.Context, recorded bool, sb *Sandbox) error {
	if recorded {
		return nil
	}
	return m.cfg.Store.PutSandbox(ctx, sb)
}

// resumedRecord is sb's record once resumed on p until endAt.
func resumedRecord(sb *Sandbox, p Placement, endAt time.Time) Sandbox {
	c := *sb
	c.Runtime, c.State, c.PausedFilesOnly, c.EndAt, c.PausedIn = p, StateRunning, false, endAt, ""
	return c
}
