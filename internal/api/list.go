package api

import (
	"encoding/base64"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/ember-sandbox/ember/internal/sandbox"
)

// Listing limits for GET /v2/sandboxes and GET /snapshots.
const (
	DefaultListLimit = 100
	MaxListLimit     = 1000
)

func limitParam(v string) (int, error) {
	if v == "" {
		return DefaultListLimit, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 || n > MaxListLimit {
		return 0, badRequest("limit must be an integer between 1 and %d", MaxListLimit)
	}
	return n, nil
}

// cursor is the position after which the next page starts: the (time, id) sort key of the
// last item served. Keys, not offsets, so pages stay correct while sandboxes come and go.
type cursor struct {
	at time.Time
	id string
}

func encodeCursor(c cursor) string {
	return base64.RawURLEncoding.EncodeToString([]byte(strconv.FormatInt(c.at.UnixNano(), 10) + ":" + c.id))
}

func decodeCursor(tok string) (*cursor, error) {
	if tok == "" {
		return nil, nil
	}
	b, err := base64.RawURLEncoding.DecodeString(tok)
	if err != nil {
		return nil, badRequest("invalid nextToken")
	}
	ns, id, ok := strings.Cut(string(b), ":")
	n, err := strconv.ParseInt(ns, 10, 64)
	if !ok || err != nil || id == "" || len(id) > 128 {
		return nil, badRequest("invalid nextToken")
	}
	return &cursor{at: time.Unix(0, n), id: id}, nil
}

type pageItem[T any] struct {
	at time.Time
	id string
	v  T
}

// paginate sorts items by (time, id) (descending when desc), skips
// everything up to and including the cursor, and returns at most limit items plus the token
// of the next page ("" on the last page).
func paginate[T any](items []pageItem[T], desc bool, cur *cursor, limit int) ([]T, string) {
	less := func(a, b pageItem[T]) bool { // a before b in the requested order
		if !a.at.Equal(b.at) {
			if desc {
				return a.at.After(b.at)
			}
			return a.at.Before(b.at)
		}
		if desc {
			return a.id > b.id
		}
		return a.id < b.id
	}
	sort.Slice(items, func(i, j int) bool { return less(items[i], items[j]) })
	start := 0
	if cur != nil {
		c := pageItem[T]{at: cur.at, id: cur.id}
		start = sort.Search(len(items), func(i int) bool { return less(c, items[i]) })
	}
	items = items[start:]
	next := ""
	if len(items) > limit {
		items = items[:limit]
		last := items[len(items)-1]
		next = encodeCursor(cursor{at: last.at, id: last.id})
	}
	out := make([]T, len(items))
	for i, it := range items {
		out[i] = it.v
	}
	return out, next
}

// metadataFilter decodes the SDK's metadata query: the value is itself a query string
// (`k=v&k2=v2`, each part URL-encoded, then the whole URL-encoded again), so it is decoded a
// second time. Keys and values are ANDed.
func metadataFilter(q url.Values) (map[string]string, error) {
	vals := q["metadata"]
	if len(vals) == 0 {
		return nil, nil
	}
	out := map[string]string{}
	for _, v := range vals {
		if v == "" {
			continue
		}
		inner, err := url.ParseQuery(v)
		if err != nil {
			return nil, badRequest("invalid metadata filter: %v", err)
		}
		for k, vs := range inner {
			if k == "" {
				return nil, badRequest("invalid metadata filter: empty key")
			}
			out[k] = vs[len(vs)-1]
		}
	}
	if len(out) == 0 {
		return nil, nil
	}
	return out, nil
}

// stateLost is ember's extension of the state filter: sandboxes lost with their node (cluster
// mode; a single node never loses one).
const stateLost = "lost"

// stateFilter accepts `state=running,paused` (JS) and `state=running&state=paused` (Python),
// and ember's `lost` (reported apart: it is no state of a sandbox a node holds).
func stateFilter(q url.Values) (_ []sandbox.State, lost bool, _ error) {
	var out []sandbox.State
	seen := map[sandbox.State]bool{}
	for _, v := range q["state"] {
		for _, part := range strings.Split(v, ",") {
			part = strings.TrimSpace(part)
			if part == "" {
				continue
			}
			if part == stateLost {
				lost = true
				continue
			}
			st := sandbox.State(part)
			if st != sandbox.StateRunning && st != sandbox.StatePaused {
				return nil, false, badRequest("state must be running, paused or lost, got %s", quoteID(part))
			}
			if !seen[st] {
				seen[st] = true
				out = append(out, st)
			}
		}
	}
	return out, lost, nil
}

func matchesMetadata(sb *sandbox.Sandbox, md map[string]string) bool {
	for k, v := range md {
		if got, ok := sb.Metadata[k]; !ok || got != v {
			return false
		}
	}
	return true
}

func (s *server) listSandboxesV2(w http.ResponseWriter, r *http.Request, _ params) error {
	out, next, err := s.listV2(r)
	if err != nil {
		return err
	}
	if next != "" {
		w.Header().Set(HeaderNextToken, next)
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

// listV2 is this node's page of a v2 list, and the next page's token.
func (s *server) listV2(r *http.Request) (_ []listedSandboxJSON, next string, _ error) {
	q := r.URL.Query()
	md, err := metadataFilter(q)
	if err != nil {
		return nil, "", err
	}
	states, lost, err := stateFilter(q)
	if err != nil {
		return nil, "", err
	}
	if len(states) == 0 && !lost {
		states = []sandbox.State{sandbox.StateRunning, sandbox.StatePaused}
	}
	var after time.Time
	if v := q.Get("startedAfter"); v != "" {
		if after, err = time.Parse(time.RFC3339Nano, v); err != nil {
			return nil, "", badRequest("startedAfter must be an RFC 3339 time")
		}
	}
	desc := true
	switch strings.ToLower(q.Get("order")) {
	case "", "desc":
	case "asc":
		desc = false
	default:
		return nil, "", badRequest("order must be asc or desc")
	}
	limit, err := limitParam(q.Get("limit"))
	if err != nil {
		return nil, "", err
	}
	cur, err := decodeCursor(q.Get("nextToken"))
	if err != nil {
		return nil, "", err
	}
	f := sandbox.ListFilter{Metadata: md, States: states, TemplateID: q.Get("template"), StartedAfter: after}
	var sbxs []*sandbox.Sandbox
	if len(states) > 0 { // only lost ones asked: this node holds none (the edge adds the cluster's)
		if sbxs, err = s.svc.List(r.Context(), f); err != nil {
			return nil, "", err
		}
	}
	items := make([]pageItem[*sandbox.Sandbox], 0, len(sbxs))
	for _, sb := range sbxs {
		if !s.keepListed(sb, f) {
			continue
		}
		items = append(items, pageItem[*sandbox.Sandbox]{at: sb.StartedAt, id: sb.ID, v: sb})
	}
	page, next := paginate(items, desc, cur, limit)
	out := make([]listedSandboxJSON, 0, len(page))
	for _, sb := range page {
		out = append(out, s.toListed(sb))
	}
	return out, next, nil
}

// keepListed re-applies the filter at the edge, so a Service that filters loosely cannot leak
// killed or unrequested sandboxes to clients.
func (s *server) keepListed(sb *sandbox.Sandbox, f sandbox.ListFilter) bool {
	if sb == nil || sb.State == sandbox.StateKilled {
		return false
	}
	okState := false
	for _, st := range f.States {
		if sb.State == st {
			okState = true
		}
	}
	if !okState || !matchesMetadata(sb, f.Metadata) {
		return false
	}
	return f.StartedAfter.IsZero() || sb.StartedAt.After(f.StartedAfter)
}

// listSandboxesV1 is JS 1.x's list: running sandboxes only, no pagination. An explicit state
// filter (ember's extension, for `state=lost`) is honoured as in v2.
func (s *server) listSandboxesV1(w http.ResponseWriter, r *http.Request, _ params) error {
	out, err := s.listV1(r)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

// listV1 is this node's v1 list.
func (s *server) listV1(r *http.Request) ([]listedSandboxJSON, error) {
	q := r.URL.Query()
	md, err := metadataFilter(q)
	if err != nil {
		return nil, err
	}
	f := sandbox.ListFilter{Metadata: md, States: []sandbox.State{sandbox.StateRunning}}
	if _, ok := q["state"]; ok {
		if f.States, _, err = stateFilter(q); err != nil {
			return nil, err
		}
	}
	var sbxs []*sandbox.Sandbox
	if len(f.States) > 0 {
		if sbxs, err = s.svc.List(r.Context(), f); err != nil {
			return nil, err
		}
	}
	items := make([]pageItem[*sandbox.Sandbox], 0, len(sbxs))
	for _, sb := range sbxs {
		if s.keepListed(sb, f) {
			items = append(items, pageItem[*sandbox.Sandbox]{at: sb.StartedAt, id: sb.ID, v: sb})
		}
	}
	page, _ := paginate(items, true, nil, len(items)+1)
	out := make([]listedSandboxJSON, 0, len(page))
	for _, sb := range page {
		out = append(out, s.toListed(sb))
	}
	return out, nil
}

// writePage serves one page of items (sorted and cut by paginate), each answered as conv
// gives it, with the next page's token in X-Next-Token.
func writePage[T, J any](w http.ResponseWriter, items []pageItem[T], desc bool, cur *cursor, limit int, conv func(T) J) {
	page, next := paginate(items, desc, cur, limit)
	out := make([]J, 0, len(page))
	for _, v := range page {
		out = append(out, conv(v))
	}
	if next != "" {
		w.Header().Set(HeaderNextToken, next)
	}
	writeJSON(w, http.StatusOK, out)
}
