package api

import (
	"context"
	"crypto/subtle"
	"errors"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// A signed files URL names no sandbox, and needs no API key: anyone can send one, and the
// node must find which of its sandboxes' access tokens made the signature. That lookup must
// not queue behind a sandbox's lock (held across its checkpoints: one slow pause would stall
// every signed URL), and in a cluster one unauthenticated request must not turn into a burst of
// requests to every node without bound.

// signer finds the sandbox whose access token satisfies made, without taking sandbox locks
// (*sandbox.Manager.SignedBy).
type signer interface {
	SignedBy(made func(token string) bool) string
}

// signedSandbox returns the local sandbox (running or paused) whose access token made q's
// signature, nil when none did.
func (s *server) signedSandbox(ctx context.Context, q signedQuery) (*sandbox.Sandbox, error) {
	made := func(token string) bool {
		want := auth.FileSignature(q.Path, q.Operation, q.User, token, q.Exp)
		return subtle.ConstantTimeCompare([]byte(want), []byte(q.Signature)) == 1
	}
	if s.signer != nil {
		id := s.signer.SignedBy(made)
		if id == "" {
			return nil, nil
		}
		sbx, err := s.svc.Get(ctx, id)
		if errors.Is(err, errdefs.ErrNotFound) {
			return nil, nil
		}
		if err != nil {
			return nil, err
		}
		if sbx.State != sandbox.StateRunning && sbx.State != sandbox.StatePaused {
			return nil, nil
		}
		return sbx, nil
	}
	sbxs, err := s.svc.List(ctx, sandbox.ListFilter{States: []sandbox.State{sandbox.StateRunning, sandbox.StatePaused}})
	if err != nil {
		return nil, err
	}
	for _, sbx := range sbxs {
		if sbx.AccessToken != "" && made(sbx.AccessToken) {
			return sbx, nil
		}
	}
	return nil, nil
}
