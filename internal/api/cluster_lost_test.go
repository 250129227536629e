package api

import (
	"github.com/ember-sandbox/ember/internal/testutil"
	"net/http"
	"strings"
	"testing"
	"time"
)

// Lost sandboxes are listed on request only (`state=lost`, v1 and v2), with their node and
// the time; default listings are unchanged; GET of a lost one is a 404 naming node and time.
func TestClusterListsLostOnRequest(t *testing.T) {
	nodes := newTestCluster(t, 3)
	var onC, elsewhere []string
	for i := 0; i < 12 && (len(onC) < 2 || len(elsewhere) < 1); i++ {
		r := nodes[0].env.ctl(http.MethodPost, "/sandboxes", `{"templateID":"base"}`)
		var sb struct {
			SandboxID string `json:"sandboxID"`
		}
		r.json(t, &sb)
		if nodes[2].holds(sb.SandboxID) {
			onC = append(onC, sb.SandboxID)
		} else {
			elsewhere = append(elsewhere, sb.SandboxID)
		}
	}
	if len(onC) == 0 || len(elsewhere) == 0 {
		t.Fatalf("placement: %d on c, %d elsewhere", len(onC), len(elsewhere))
	}
	stopped := time.Now()
	nodes[2].stop()
	testutil.Eventually(t, clusterTTL+5*time.Second, "c's sandboxes marked lost", func() bool {
		var l []listedSandboxJSON
		nodes[1].env.ctl(http.MethodGet, "/v2/sandboxes?state=lost", "").json(t, &l)
		return len(l) == len(onC)
	})
	r := nodes[0].env.ctl(http.MethodGet, "/sandboxes/"+onC[0], "")
	if r.status != http.StatusNotFound || !strings.Contains(string(r.body), "lost with node c: its node stopped answering at 20") {
		t.Fatalf("GET of a lost sandbox: %d %s", r.status, r.body)
	}
	ids := func(l []listedSandboxJSON) map[string]listedSandboxJSON {
		m := map[string]listedSandboxJSON{}
		for _, s := range l {
			m[s.SandboxID] = s
		}
		return m
	}
	for _, edge := range nodes[:2] {
		// Default listings: the live ones only, E2B's shape (no ember fields).
		for _, path := range []string{"/sandboxes", "/v2/sandboxes", "/v2/sandboxes?state=running,paused"} {
			r := edge.env.ctl(http.MethodGet, path, "")
			var l []listedSandboxJSON
			r.json(t, &l)
			if len(l) != len(elsewhere) || strings.Contains(string(r.body), "lostAt") {
				t.Fatalf("%s through %s: %s, want the %d live ones", path, edge.id, r.body, len(elsewhere))
			}
		}
		for _, path := range []string{"/sandboxes?state=lost", "/v2/sandboxes?state=lost"} {
			var l []listedSandboxJSON
			edge.env.ctl(http.MethodGet, path, "").json(t, &l)
			got := ids(l)
			if len(got) != len(onC) {
				t.Fatalf("%s through %s: %v, want %v", path, edge.id, l, onC)
			}
			for _, id := range onC {
				s := got[id]
				if s.State != "lost" || s.Node != "c" || s.LostAt == nil || s.LostAt.Before(stopped.Add(-time.Second)) ||
					s.TemplateID != "base" || !strings.Contains(s.LostReason, "stopped answering") {
					t.Fatalf("%s lists %s as %+v", path, id, s)
				}
			}
		}
		var both []listedSandboxJSON
		edge.env.ctl(http.MethodGet, "/v2/sandboxes?state=running&state=lost", "").json(t, &both)
		if len(both) != len(onC)+len(elsewhere) {
			t.Fatalf("state=running&state=lost through %s: %d items, want %d", edge.id, len(both), len(onC)+len(elsewhere))
		}
		// Pages over live and lost ones alike.
		seen := map[string]bool{}
		tok := ""
		for page := 0; page < 20; page++ {
			path := "/v2/sandboxes?state=running,lost&limit=1"
			if tok != "" {
				path += "&nextToken=" + tok
			}
			r := edge.env.ctl(http.MethodGet, path, "")
			var l []listedSandboxJSON
			r.json(t, &l)
			for _, s := range l {
				if seen[s.SandboxID] {
					t.Fatalf("%s listed twice", s.SandboxID)
				}
				seen[s.SandboxID] = true
			}
			if tok = r.header.Get(HeaderNextToken); tok == "" {
				break
			}
		}
		if len(seen) != len(onC)+len(elsewhere) {
			t.Fatalf("pages through %s listed %d, want %d", edge.id, len(seen), len(onC)+len(elsewhere))
		}
		if r := edge.env.ctl(http.MethodGet, "/v2/sandboxes?state=gone", ""); r.status != http.StatusBadRequest {
			t.Fatalf("state=gone: %d %s", r.status, r.body)
		}
	}
}

// One node: nothing is ever lost, so `state=lost` lists nothing; other filters are unchanged.
func TestListLostOnOneNode(t *testing.T) {
	e := newEnv(t)
	e.ctl(http.MethodPost, "/sandboxes", `{"templateID":"base"}`)
	for _, path := range []string{"/sandboxes?state=lost", "/v2/sandboxes?state=lost"} {
		r := e.ctl(http.MethodGet, path, "")
		if r.status != http.StatusOK || strings.TrimSpace(string(r.body)) != "[]" {
			t.Fatalf("%s: %d %s", path, r.status, r.body)
		}
	}
	var l []listedSandboxJSON
	e.ctl(http.MethodGet, "/sandboxes", "").json(t, &l)
	if len(l) != 1 {
		t.Fatalf("default list: %d", len(l))
	}
	e.ctl(http.MethodGet, "/sandboxes?state=running,lost", "").json(t, &l)
	if len(l) != 1 {
		t.Fatalf("running,lost: %d", len(l))
	}
}
