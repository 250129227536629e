package api

import (
	"net/http"
	"strings"
	"time"

	"github.com/ember-sandbox/ember/internal/sandbox"
)

// Stored paused sandboxes of a gone node (cluster mode with an image store): no node holds
// them until a request that needs one moves them (the cluster edge). Until then the edge lists
// them.

// unheldForList returns the stored paused sandboxes of gone nodes that list request r asks
// for (the nodes list the others), filtered and, in v2, past the page's cursor as the nodes'.
func (s *server) unheldForList(r *http.Request) ([]listedSandboxJSON, error) {
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
	sbxs, err := s.edge.Unheld(r)
	if err != nil {
		return nil, err
	}
	var items []pageItem[listedSandboxJSON]
	for i := range sbxs {
		sb := &sbxs[i]
		if !sees(r.Context(), sb.Team) || !s.keepListed(sb, f) || (f.TemplateID != "" && sb.TemplateID != f.TemplateID) {
			continue
		}
		items = append(items, pageItem[listedSandboxJSON]{at: sb.StartedAt, id: sb.ID, v: s.toListed(sb)})
	}
	out, _ := paginate(items, !strings.EqualFold(q.Get("order"), "asc"), cur, len(items)+1)
	return out, nil
}
