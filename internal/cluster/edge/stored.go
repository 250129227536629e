package edge

import (
	"errors"
	"net/http"
	"strings"

	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// Stored paused sandboxes of a gone node (cluster mode with an image store): no node holds
// them until a request that needs one moves them (relocate, move.go). Until then the edge
// lists them (Unheld) and answers a GET from their stored record, as paused, and a kill ends
// them without moving them (their route, record and pause image deleted).

// unheld reports whether loc is a stored paused sandbox whose node is gone.
func (e *Edge) unheld(loc cluster.Location) bool {
	return e.mover != nil && loc.Stored && loc.Lost == nil && !loc.Local && (loc.Dead || loc.URL == "")
}

// serveUnheld answers, without moving it, a GET or a kill of stored sandbox id of a gone node;
// false (with where it is now) leaves the request to the usual routing, which moves it.
func (e *Edge) serveUnheld(w http.ResponseWriter, r *http.Request, id string, loc cluster.Location) (cluster.Location, bool, error) {
	segs := strings.Split(strings.TrimPrefix(r.URL.Path, "/"), "/") // GET and DELETE /sandboxes/{id}
	if !e.unheld(loc) || len(segs) != 2 || segs[0] != "sandboxes" || (r.Method != http.MethodGet && r.Method != http.MethodDelete) {
		return loc, false, nil
	}
	ctx := r.Context()
	if r.Method == http.MethodDelete {
		err := e.mover.Forget(ctx, id)
		if err == nil {
			w.WriteHeader(http.StatusNoContent)
			return loc, true, nil
		}
		if !errors.Is(err, errdefs.ErrConflict) {
			return loc, false, err
		}
	} else {
		sbxs, err := e.mover.Unheld(ctx, id)
		if err != nil {
			return loc, false, err
		}
		if len(sbxs) == 1 {
			e.local.WriteStored(w, r, &sbxs[0])
			return loc, true, nil
		}
	}
	// Adopted meanwhile: served where it is now.
	loc, err := e.cl.Locate(ctx, id, true)
	return loc, false, err
}

// Unheld returns the stored paused sandboxes of gone nodes (the nodes list the others); none
// without a mover.
func (e *Edge) Unheld(r *http.Request) ([]sandbox.Sandbox, error) {
	if e.mover == nil {
		return nil, nil
	}
	return e.mover.Unheld(r.Context())
}

// Lost returns the sandboxes lost with their node.
func (e *Edge) Lost(r *http.Request) ([]cluster.LostSandbox, error) {
	return e.cl.LostSandboxes(r.Context())
}
