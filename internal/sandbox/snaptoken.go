package sandbox

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// A snapshot's image holds envd as it was at the checkpoint, access token included, and a
// create from the snapshot authenticates its /init with that token (Template.InitToken). Had
// the checkpoint kept the running sandbox's token, anyone who may use the snapshot (the
// record, shared through etcd and the image store) would hold the token of a live sandbox. So
// for the time of its checkpoint the sandbox's envd holds a token of the snapshot's own, and
// gets its own back right after: requests the sandbox receives in that window (a few
// milliseconds besides the checkpoint itself, during which it is paused anyway) answer 401.
//
// The swap is crash-safe: before the first /init the token in flight is written to a marker in
// the sandbox's directory (tokenSwapName), removed once envd holds the sandbox's own token
// again. A daemon killed in between finds the marker at its next start, and reconcile gives
// the adopted sandbox its own token back (giveTokenBack) before it serves anything.

// tokenSwapName marks a sandbox directory while its envd may hold a snapshot's token; it
// holds that token. Like pausingName it is written, not synced: it guards against a crash of
// the daemon, and envd's token does not outlive a host crash either.
const tokenSwapName = ".ember-token-swap"

// rotateAttempts bounds the tries to give a sandbox its own token back.
const rotateAttempts = 3

// withSnapshotToken runs checkpoint while sb's envd holds a new token, and returns that token.
// The caller holds sb's lock.
func (m *Manager) withSnapshotToken(ctx context.Context, sb *Sandbox, tpl *Template, checkpoint func() error) (string, error) {
	return m.withSnapshotTokenThen(ctx, sb, tpl, checkpoint, nil)
}

// withSnapshotTokenThen is withSnapshotToken followed, once checkpoint succeeded, by then
// (given the snapshot's token), which runs while envd gets sb's own token back instead of
// after it (a step checkpoint records itself meanwhile: issue 18). It returns once both are
// done: checkpoint's error, else then's. then must not change sb's fields /init sends.
func (m *Manager) withSnapshotTokenThen(ctx context.Context, sb *Sandbox, tpl *Template, checkpoint func() error, then func(token string) error) (string, error) {
	if then == nil {
		then = func(string) error { return nil }
	}
	if sb.AccessToken == "" {
		if err := checkpoint(); err != nil {
			return "", err
		}
		return "", then("")
	}
	snapToken := randomHex(16)
	marker := filepath.Join(m.sandboxDir(sb.ID), tokenSwapName)
	if err := os.WriteFile(marker, []byte(snapToken), 0o600); err != nil {
		return "", fmt.Errorf("snapshot: record the token swap: %w", err)
	}
	tIn := time.Now()
	if err := m.setEnvdToken(ctx, sb, tpl, sb.AccessToken, snapToken); err != nil {
		// envd may have taken it all the same (an answer lost): make sure it holds its own.
		m.giveTokenBack(context.WithoutCancel(ctx), sb, tpl, snapToken)
		return "", fmt.Errorf("snapshot: give envd the snapshot's token: %w", err)
	}
	tokenIn := time.Since(tIn)
	crashPoint("snapshot-token")
	tCk := time.Now()
	err := checkpoint()
	checkpointTook := time.Since(tCk)
	crashPoint("snapshot-token-checkpointed")
	if err != nil {
		m.giveTokenBack(context.WithoutCancel(ctx), sb, tpl, snapToken)
		return snapToken, err
	}
	back := make(chan struct{})
	id := *sb // then may change sb (its checkpoint head) meanwhile
	t0 := time.Now()
	var backTook time.Duration
	go func() {
		defer close(back)
		m.giveTokenBack(context.WithoutCancel(ctx), &id, tpl, snapToken)
		backTook = time.Since(t0)
	}()
	err = then(snapToken)
	thenTook := time.Since(t0)
	<-back
	// Side by side they took both_ms; one after the other, token_back_ms + then_ms.
	m.logger(sb.ID).Debug("token back and record", "token_in_ms", ms(tokenIn), "checkpoint_ms", ms(checkpointTook), "token_back_ms", ms(backTook), "then_ms", ms(thenTook), "both_ms", ms(time.Since(t0)))
	return snapToken, err
}

// giveTokenBack makes sb's envd hold sb's own token again, whichever of snapToken or its own
// it holds now, and removes the swap marker once it does. When envd cannot be reached the
// marker stays (the next start tries again) and the failure is logged: its clients get 401
// until then.
func (m *Manager) giveTokenBack(ctx context.Context, sb *Sandbox, tpl *Template, snapToken string) {
	var err error
	for i := 0; i < rotateAttempts; i++ {
		if i > 0 {
			time.Sleep(50 * time.Millisecond)
		}
		// From the snapshot's token (the usual case), or from its own (the first /init never
		// reached envd): /init with the token envd already holds is harmless.
		if err = m.setEnvdToken(ctx, sb, tpl, snapToken, sb.AccessToken); err == nil {
			break
		}
		if err = m.setEnvdToken(ctx, sb, tpl, sb.AccessToken, sb.AccessToken); err == nil {
			break
		}
	}
	if err != nil {
		m.logger(sb.ID).Error("snapshot: envd did not take the sandbox's own token back: its clients get 401 until the next start of the daemon", "err", err)
		return
	}
	os.Remove(filepath.Join(m.sandboxDir(sb.ID), tokenSwapName))
}

// reconcileTokenSwap, at start for an adopted running sandbox, gives its envd the sandbox's
// own token back if a snapshot's token swap was in flight when the daemon died.
func (m *Manager) reconcileTokenSwap(ctx context.Context, sb *Sandbox) {
	b, err := os.ReadFile(filepath.Join(m.sandboxDir(sb.ID), tokenSwapName))
	if err != nil {
		return
	}
	tpl, err := m.templateOf(ctx, sb)
	if err != nil {
		// Its env and user come from the template; without it /init would reset them.
		m.logger(sb.ID).Error("reconcile: a snapshot's token swap was cut, and the sandbox's template is gone", "err", err)
		return
	}
	m.giveTokenBack(ctx, sb, tpl, strings.TrimSpace(string(b)))
	m.logger(sb.ID).Info("reconcile: a snapshot's token swap was cut by the crash; envd has the sandbox's own token again")
}

// setEnvdToken re-sends envd's /init with sb's identity and token to (authenticated with from).
func (m *Manager) setEnvdToken(ctx context.Context, sb *Sandbox, tpl *Template, from, to string) error {
	id := *sb
	id.AccessToken = to
	return m.initEnvd(ctx, m.guest, envdBase(sb.Runtime.GuestIP), &id, from, tpl)
}

// crashAt names the point where the daemon kills itself (kill -9), for crash tests:
// $EMBER_CRASH_AT. Empty (always, outside tests) = none.
var crashAt = os.Getenv("EMBER_CRASH_AT")

// crashPoint kills the daemon with SIGKILL if it is the point $EMBER_CRASH_AT names.
func crashPoint(name string) {
	if crashAt != "" && crashAt == name {
		syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {} // the signal is on its way
	}
}
