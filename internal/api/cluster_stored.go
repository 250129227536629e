package api

import (
	"errors"
	"net/http"
	"strings"
	"time"

	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// Stored paused sandboxes of a gone node (cluster mode with an image store): no node holds
// them until a request that needs one moves them (relocate, cluster_move.go). Until then the
// edge lists them and answers a GET from their stored record, as paused, and a kill ends them
// without moving them (their route, record and pause image deleted).

// unheld reports whether loc is a stored paused sandbox whose node is gone.
func (s *server) unheld(loc cluster.Location) bool {
	return s.cfg.Mover != nil && loc.Stored && loc.Lost == nil && !loc.Local && (loc.Dead || loc.URL == "")
}

// serveUnheld answers, without moving it, a GET or a kill of stored sandbox id of a gone node;
// false (with where it is now) leaves the request to the usual routing, which moves it.
func (s *server) serveUnheld(w http.ResponseWriter, r *http.Request, id string, loc cluster.Location) (cluster.Location, bool, error) {
	segs := splitPath(r.URL.Path) // GET and DELETE /sandboxes/{id}
	if !s.unheld(loc) || len(segs) != 2 || segs[0] != "sandboxes" || (r.Method != http.MethodGet && r.Method != http.MethodDelete) {
		return loc, false, nil
	}
	ctx := r.Context()
	if r.Method == http.MethodDelete {
		err := s.cfg.Mover.Forget(ctx, id)
		if err == nil {
			w.WriteHeader(http.StatusNoContent)
			return loc, true, nil
		}
		if !errors.Is(err, errdefs.ErrConflict) {
			return loc, false, err
		}
	} else {
		sbxs, err := s.cfg.Mover.Unheld(ctx, id)
		if err != nil {
			return loc, false, err
		}
		if len(sbxs) == 1 {
			writeJSON(w, http.StatusOK, s.toDetail(&sbxs[0]))
			return loc, true, nil
		}
	}
	// Adopted meanwhile: served where it is now.
	loc, err := s.cl.Locate(ctx, id, true)
	return loc, false, err
}

// unheldForList returns the stored paused sandboxes of gone nodes that list request r asks
// for (the nodes list the others), filtered and, in v2, past the page's cursor as the nodes'.
func (s *server) unheldForList(r *http.Request) ([]listedSandboxJSON, error) {
	if s.cfg.Mover == nil {
		return nil, nil
	}
	q := r.URL.Query()
	v2 := strings.HasPrefix(r.URL.Path, "/v2/")
	states, _, err := stateFilter(q)
	if err != nil {
		return nil, err
	}
	if _, ok := q["state"]; !ok {
		states = []sandbox.State{sandbox.StateRunning} // v1: running only (JS 1.x)
		if v2 {
			states = append(states, sandbox.StatePaused)
		}
	}
	md, err := metadataFilter(q)
	if err != nil {
		return nil, err
	}
	f := sandbox.ListFilter{Metadata: md, States: states, TemplateID: q.Get("template")}
	if v := q.Get("startedAfter"); v2 && v != "" {
		if f.StartedAfter, err = time.Parse(time.RFC3339Nano, v); err != nil {
			return nil, badRequest("startedAfter must be an RFC 3339 time")
		}
	}
	var cur *cursor
	if v2 {
		if cur, err = decodeCursor(q.Get("nextToken")); err != nil {
			return nil, err
		}
	}
	if !s.keepListed(&sandbox.Sandbox{State: sandbox.StatePaused}, sandbox.ListFilter{States: states}) {
		return nil, nil // paused ones not asked for
	}
	sbxs, err := s.cfg.Mover.Unheld(r.Context())
	if err != nil {
		return nil, err
	}
	var items []pageItem[listedSandboxJSON]
	for i := range sbxs {
		sb := &sbxs[i]
		if !s.keepListed(sb, f) || (f.TemplateID != "" && sb.TemplateID != f.TemplateID) {
			continue
		}
		items = append(items, pageItem[listedSandboxJSON]{at: sb.StartedAt, id: sb.ID, v: s.toListed(sb)})
	}
	out, _ := paginate(items, !strings.EqualFold(q.Get("order"), "asc"), cur, len(items)+1)
	return out, nil
}
