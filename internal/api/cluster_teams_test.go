package api

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/testutil"
)

// On a 3-node cluster (real etcd), every edge answers another team's sandbox as a missing
// one, wherever it runs, and lists only the caller's team's; the owner's calls work through
// every edge.
func TestClusterTeams(t *testing.T) {
	nodes := newTestCluster(t, 3)
	admin := nodes[0].env
	var tj teamJSON
	r := admin.ctl("POST", "/ember/teams", `{"name":"b"}`)
	if r.status != http.StatusCreated {
		t.Fatalf("create team: %d %s", r.status, r.body)
	}
	r.json(t, &tj)
	b := tj.Key.Key
	// Sandboxes of both teams, created through every edge (placed over the nodes).
	var aIDs, bIDs []string
	for _, nd := range nodes {
		for _, k := range []string{admin.key, b} {
			var sj sandboxJSON
			r := nd.env.as(k, "POST", "/sandboxes", `{"templateID":"base"}`)
			if r.status != http.StatusCreated {
				t.Fatalf("create: %d %s", r.status, r.body)
			}
			r.json(t, &sj)
			if k == b {
				bIDs = append(bIDs, sj.SandboxID)
			} else {
				aIDs = append(aIDs, sj.SandboxID)
			}
		}
	}
	const missing = "0000000000000000000a"
	for _, nd := range nodes {
		for _, id := range aIDs {
			for _, rt := range []struct{ method, path, body string }{
				{"GET", "/sandboxes/%s", ""}, {"DELETE", "/sandboxes/%s", ""}, {"POST", "/sandboxes/%s/pause", ""},
				{"POST", "/sandboxes/%s/connect", `{"timeout":60}`}, {"POST", "/sandboxes/%s/fork", `{"count":1}`},
				{"POST", "/sandboxes/%s/snapshots", `{}`},
			} {
				got := nd.env.as(b, rt.method, strings.ReplaceAll(rt.path, "%s", id), rt.body)
				want := nd.env.as(b, rt.method, strings.ReplaceAll(rt.path, "%s", missing), rt.body)
				got.wantError(t, http.StatusNotFound)
				if strings.ReplaceAll(string(got.body), id, missing) != string(want.body) {
					t.Errorf("node %s %s %s: another team's answers %s, a missing one %s", nd.id, rt.method, rt.path, got.body, want.body)
				}
			}
		}
		for _, tc := range []struct {
			key      string
			own, not []string
		}{{b, bIDs, aIDs}, {admin.key, aIDs, bIDs}} {
			r := nd.env.as(tc.key, "GET", "/v2/sandboxes", "")
			for _, id := range tc.own {
				if !strings.Contains(string(r.body), id) {
					t.Errorf("node %s: list misses own sandbox %s: %s", nd.id, id, r.body)
				}
			}
			for _, id := range tc.not {
				if strings.Contains(string(r.body), id) {
					t.Errorf("node %s: list shows another team's sandbox %s", nd.id, id)
				}
			}
		}
	}
	// The owner's calls through every edge.
	for i, nd := range nodes {
		if r := nd.env.as(b, "GET", "/sandboxes/"+bIDs[(i+1)%len(bIDs)], ""); r.status != http.StatusOK {
			t.Fatalf("owner's get through node %s: %d %s", nd.id, r.status, r.body)
		}
	}
	// Keys and teams are the cluster's: team b's key works on every node at once.
	testutil.Eventually(t, 5*time.Second, "team b's key everywhere", func() bool {
		for _, nd := range nodes {
			if nd.env.as(b, "GET", "/api-keys", "").status != http.StatusOK {
				return false
			}
		}
		return true
	})
}
