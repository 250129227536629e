package api

import (
	"net/http"
	"strings"
	"time"

	"github.com/ember-sandbox/ember/internal/sandbox"
)

// lostForList handles ember's `state=lost` in a cluster list: the sandboxes lost with their
// node, from etcd, as listed items (state "lost", with the node, the time and the reason),
// and the request to ask the nodes with what remains of the state filter (ask=false when it
// named only lost). Without `lost` the request goes to the nodes unchanged.
func (s *server) lostForList(r *http.Request) (items []listedSandboxJSON, out *http.Request, ask bool, err error) {
	q := r.URL.Query()
	states, lost, err := stateFilter(q)
	if err != nil || !lost {
		return nil, r, true, err
	}
	md, err := metadataFilter(q)
	if err != nil {
		return nil, r, true, err
	}
	var after time.Time
	if v := q.Get("startedAfter"); v != "" {
		if after, err = time.Parse(time.RFC3339Nano, v); err != nil {
			return nil, r, true, badRequest("startedAfter must be an RFC 3339 time")
		}
	}
	all, err := s.edge.Lost(r)
	if err != nil {
		return nil, r, true, err
	}
	tpl := q.Get("template")
	for _, l := range all {
		// Lost records keep no metadata: a metadata filter matches none of them.
		if !sees(r.Context(), l.Team) || len(md) > 0 || (tpl != "" && l.TemplateID != tpl) || (!after.IsZero() && !l.Since.After(after)) {
			continue
		}
		at := l.At.UTC()
		items = append(items, listedSandboxJSON{
			SandboxID: l.ID, TemplateID: l.TemplateID, ClientID: s.cfg.ClientID,
			CPUCount: l.CPU, MemoryMB: l.MemoryMB, StartedAt: l.Since.UTC(), EndAt: at,
			EnvdVersion: sandbox.EnvdVersion, State: stateLost, Metadata: map[string]string{},
			VolumeMounts: []volumeMountJSON{}, Node: l.Node, LostAt: &at, LostReason: l.Reason,
		})
	}
	if strings.HasPrefix(r.URL.Path, "/v2/") {
		// The page asked for: the nodes skip what the cursor passed, and so do these.
		cur, err := decodeCursor(q.Get("nextToken"))
		if err != nil {
			return nil, r, true, err
		}
		pi := make([]pageItem[listedSandboxJSON], len(items))
		for i, it := range items {
			pi[i] = pageItem[listedSandboxJSON]{at: it.StartedAt, id: it.SandboxID, v: it}
		}
		items, _ = paginate(pi, !strings.EqualFold(q.Get("order"), "asc"), cur, len(pi)+1)
	}
	if len(states) == 0 {
		return items, r, false, nil
	}
	names := make([]string, len(states))
	for i, st := range states {
		names[i] = string(st)
	}
	q.Del("state")
	q.Set("state", strings.Join(names, ","))
	out = r.Clone(r.Context())
	u := *r.URL
	u.RawQuery = q.Encode()
	out.URL = &u
	out.RequestURI = u.RequestURI()
	return items, out, true, nil
}
