package api

import (
	"context"
	"github.com/ember-sandbox/ember/internal/testutil"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/cluster/clustertest"
	"github.com/ember-sandbox/ember/internal/cluster/edge"
)

// A node's URL comes from etcd, so whatever listens at it must never receive a client's API
// key: lists, creates, control calls, adoptions and forks forwarded between nodes carry the
// node proof instead, and the receiving node serves them on it.
func TestClusterForwardsCarryNoClientKey(t *testing.T) {
	e := clustertest.Start(t, 1)
	var mu sync.Mutex
	var seen []http.Header
	record := func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Header.Get(edge.HeaderForwarded) != "" {
				mu.Lock()
				seen = append(seen, r.Header.Clone())
				mu.Unlock()
			}
			h.ServeHTTP(w, r)
		})
	}
	// a takes no sandboxes: every create is placed on b, through a.
	a := newClusterNodeWith(t, e, "a", nil, func(c *cluster.Config) { c.Capacity.Slots = 0 }, nil)
	b := newClusterNodeWith(t, e, "b", nil, nil, record)
	key, _, err := a.env.keys.Create(context.Background(), "test")
	if err != nil {
		t.Fatal(err)
	}
	a.env.key = key
	testutil.Eventually(t, 5*time.Second, "a sees b with its template", func() bool {
		for _, n := range a.cl.Live() {
			if _, ok := n.Templates["base"]; ok && n.ID == "b" {
				return true
			}
		}
		return false
	})
	for _, hdr := range [][]string{{"X-API-Key", key}, {"Authorization", "Bearer " + key}} {
		r := a.env.do(http.MethodPost, "/sandboxes", `{"templateID":"base","timeout":300}`, hdr...)
		if r.status != http.StatusCreated {
			t.Fatalf("create through a with %s: %d %s", hdr[0], r.status, r.body)
		}
		var sb struct {
			SandboxID string `json:"sandboxID"`
		}
		r.json(t, &sb)
		if !b.holds(sb.SandboxID) {
			t.Fatalf("sandbox %s is not on b", sb.SandboxID)
		}
		if r := a.env.do(http.MethodGet, "/sandboxes/"+sb.SandboxID, "", hdr...); r.status != http.StatusOK {
			t.Fatalf("get through a: %d %s", r.status, r.body)
		}
		var list []listedSandboxJSON
		r = a.env.do(http.MethodGet, "/v2/sandboxes", "", hdr...)
		r.json(t, &list)
		if r.status != http.StatusOK || len(list) == 0 {
			t.Fatalf("list through a: %d %s", r.status, r.body)
		}
	}
	// A wrong key stays outside: the edge refuses it before anything is forwarded.
	if r := a.env.do(http.MethodGet, "/v2/sandboxes", "", "X-API-Key", "e2b_0000000000000000000000000000000000000000"); r.status != http.StatusUnauthorized {
		t.Fatalf("list with a wrong key: %d %s", r.status, r.body)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(seen) < 6 {
		t.Fatalf("b saw %d forwarded requests, want 6 or more", len(seen))
	}
	for _, h := range seen {
		if h.Get("X-API-Key") != "" || h.Get("Authorization") != "" {
			t.Fatalf("a forwarded the client's key: %v", h)
		}
		if h.Get(edge.HeaderNodeProof) == "" {
			t.Fatalf("a forwarded a request without its node proof: %v", h)
		}
	}
}
