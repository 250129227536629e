package sandbox

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"
)

// A rollback without a standby restores the checkpoint into a new instance whose envd holds
// the checkpoint's own token (snaptoken.go), not the sandbox's: /init gives it the sandbox's
// identity back. That /init and the sandbox's record (a synced store write) do not depend on
// each other, so they run side by side instead of one after the other (issue 18: the cost of
// a rollback over a raw restore).
//
// A record written before envd holds the sandbox's token is safe against a crash of the daemon
// the way a snapshot's token swap is: the token swap marker (tokenSwapName) is written first,
// holding the checkpoint's token, and reconcile gives whichever instance it adopts — the new
// one if the record got written, else the old one, whose envd holds the sandbox's token
// already (giveTokenBack then sends /init with it: harmless) — the sandbox's own token.

// recordRollback records sb (already on the restored instance sb.Runtime) and, when spec says
// so, gives that instance sb's identity, both at once; it returns once both are done. On
// failure sb's record is prev's again (the caller ends the new instance).
func (m *Manager) recordRollback(ctx context.Context, sb, prev *Sandbox, spec launchSpec) error {
	if spec.init == nil {
		// A standby (it got the identity when it was restored) or a checkpoint whose envd
		// holds the sandbox's own token.
		return m.cfg.Store.PutSandbox(ctx, sb)
	}
	marker := filepath.Join(m.sandboxDir(sb.ID), tokenSwapName)
	if err := os.WriteFile(marker, []byte(spec.initToken), 0o600); err != nil {
		return fmt.Errorf("record the token swap: %w", err)
	}
	identified := make(chan error, 1)
	t0 := time.Now()
	var initTook time.Duration
	go func() {
		err := m.faults.hit("rollback.init")
		if err == nil {
			err = m.identify(ctx, m.initClient, envdBase(sb.Runtime.GuestIP), spec)
		}
		initTook = time.Since(t0)
		identified <- err
	}()
	err := m.cfg.Store.PutSandbox(ctx, sb)
	recordTook := time.Since(t0)
	crashPoint("rollback-recorded")
	ierr := <-identified
	// Side by side they took both_ms; one after the other, init_ms + record_ms.
	m.logger(sb.ID).Debug("rollback init and record", "init_ms", ms(initTook), "record_ms", ms(recordTook), "both_ms", ms(time.Since(t0)))
	if ierr != nil && err == nil {
		// Recorded on an instance that is about to end: back to the old one.
		if perr := m.cfg.Store.PutSandbox(context.WithoutCancel(ctx), prev); perr != nil {
			// The marker stays: the next start finds the record's instance gone.
			m.logger(sb.ID).Error("rollback: record the sandbox back on its old instance", "err", perr)
			return ierr
		}
	}
	// The old instance's envd holds the sandbox's token, and so does the new one's if ierr is
	// nil.
	os.Remove(marker)
	if ierr != nil {
		return ierr
	}
	return err
}
