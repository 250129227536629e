package sandbox

import (
	"context"
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// A launch that gives the instance an identity does not poll envd's /health first (issue 11):
// /init itself is sent as soon as envd accepts a connection, and its answer is envd's health.
// Only a failure to connect is retried — the request was then never sent — so /init reaches
// envd at most once (a second /init with the template's token would be refused once the first
// set the sandbox's).

// dialError marks a failure to connect to envd: nothing was sent.
type dialError struct{ err error }

func (e dialError) Error() string { return e.err.Error() }
func (e dialError) Unwrap() error { return e.err }

// dialAttempt bounds one connection attempt: a lost first SYN on a fresh veth would otherwise
// cost the kernel's 1 s retransmit.
const dialAttempt = 250 * time.Millisecond

// markDials wraps dial so that its failures are dialErrors and each attempt is bounded.
func markDials(dial dialFunc) dialFunc {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		dctx, cancel := context.WithTimeout(ctx, dialAttempt)
		defer cancel()
		c, err := dial(dctx, network, addr)
		if err != nil {
			return nil, dialError{err}
		}
		return c, nil
	}
}

// launchDialKey marks the context of a launch's request to envd (sendWhenUp).
type launchDialKey struct{}

// launchDials wraps the guest transports' dial: a launch's requests (their context carries
// launchDialKey) get markDials' bound and marking; every other request dials as dial does.
func launchDials(dial dialFunc) dialFunc {
	marked := markDials(dial)
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		if ctx.Value(launchDialKey{}) != nil {
			return marked(ctx, network, addr)
		}
		return dial(ctx, network, addr)
	}
}

// sendWhenUp makes one request to envd with send (through initClient, or the guest transports,
// whose dial launchDials marks for it) once envd accepts a connection: attempts that could not
// connect are retried (backing off from 2 to 50 ms) for up to EnvdTimeout; any other outcome is
// returned.
func (m *Manager) sendWhenUp(ctx context.Context, send func(context.Context) error) error {
	wctx, cancel := context.WithTimeout(ctx, m.cfg.EnvdTimeout)
	defer cancel()
	delay := 2 * time.Millisecond
	for {
		err := send(context.WithValue(ctx, launchDialKey{}, true))
		var de dialError
		if err == nil || !errors.As(err, &de) || ctx.Err() != nil {
			return err
		}
		select {
		case <-wctx.Done():
			return fmt.Errorf("envd did not come up: %v: %w", err, errdefs.ErrUnavailable)
		case <-time.After(delay):
		}
		if delay < 50*time.Millisecond {
			delay *= 2
		}
	}
}
