package api

import (
	"encoding/json"
	"net/http"
	"strings"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// listEverywhere merges this node's page of a list with every other live node's (the cluster
// edge gathers them; each filters and pages the same way), the lost sandboxes and the stored
// ones no node holds.
func (s *server) listEverywhere(w http.ResponseWriter, r *http.Request) {
	lost, r, ask, err := s.lostForList(r) // ember's state=lost (cluster_lost.go)
	if err != nil {
		writeError(w, s.log, r, err)
		return
	}
	v2 := strings.HasPrefix(r.URL.Path, "/v2/")
	var items []pageItem[listedSandboxJSON]
	for _, it := range lost {
		items = append(items, pageItem[listedSandboxJSON]{at: it.StartedAt, id: it.SandboxID, v: it})
	}
	more := false
	if ask {
		stored, err := s.unheldForList(r) // no node lists them (cluster_stored.go)
		if err != nil {
			writeError(w, s.log, r, err)
			return
		}
		others, live := s.edge.ListOthers(r, HeaderNextToken)
		var here []listedSandboxJSON
		var next string
		switch {
		case !live: // this node's lease lapsed: the cluster does not count its sandboxes
		case v2:
			here, next, err = s.listV2(r)
		default:
			here, err = s.listV1(r)
		}
		if err != nil {
			// A bad query is bad everywhere: this node's answer says why.
			writeError(w, s.log, r, err)
			return
		}
		more = next != ""
		for _, it := range append(stored, here...) {
			items = append(items, pageItem[listedSandboxJSON]{at: it.StartedAt, id: it.SandboxID, v: it})
		}
		for _, p := range others {
			var page []listedSandboxJSON
			switch {
			case p.Err != nil:
				writeError(w, s.log, r, p.Err)
				return
			case p.Body == nil:
				continue // the node did not answer: it lists nothing
			case json.Unmarshal(p.Body, &page) != nil:
				writeError(w, s.log, r, &errdefs.StatusError{Status: http.StatusBadGateway, Message: "bad list from node " + p.Node})
				return
			}
			more = more || p.Next != ""
			for _, it := range page {
				items = append(items, pageItem[listedSandboxJSON]{at: it.StartedAt, id: it.SandboxID, v: it})
			}
		}
	}
	limit, desc := 0, true
	if v2 {
		q := r.URL.Query()
		var err error
		if limit, err = limitParam(q.Get("limit")); err != nil {
			writeError(w, s.log, r, err)
			return
		}
		desc = !strings.EqualFold(q.Get("order"), "asc")
	}
	if limit <= 0 {
		limit = len(items) + 1
	}
	page, next := paginate(items, desc, nil, limit)
	if next == "" && more && len(page) > 0 {
		last := page[len(page)-1]
		next = encodeCursor(cursor{at: last.StartedAt, id: last.SandboxID})
	}
	if next != "" && v2 {
		w.Header().Set(HeaderNextToken, next)
	}
	if page == nil {
		page = []listedSandboxJSON{}
	}
	writeJSON(w, http.StatusOK, page)
}
