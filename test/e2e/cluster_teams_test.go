package e2e

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/cluster/clustertest"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// asJSON is as that decodes a 2xx body into out and fails unless the status is want.
func (d *daemon) asJSON(t *testing.T, key, method, path string, in any, want int, out any) {
	t.Helper()
	code, body, _ := d.as(t, key, method, path, in)
	if code != want {
		t.Fatalf("%s %s through %s: %d %s, want %d", method, path, d.nodeID, code, body, want)
	}
	if out != nil {
		if err := json.Unmarshal([]byte(body), out); err != nil {
			t.Fatalf("%s %s: decode %q: %v", method, path, body, err)
		}
	}
}

// Two teams on three real ember nodes (real etcd and S3; issue 19's "on a 3-node cluster the
// same"), over the API in plain HTTP: the admin key makes both teams; through every edge, team
// B's get, kill, pause, connect, resume, timeout, fork and snapshot of team A's sandbox (on
// another node than B's) and its get, delete, create from and build from A's snapshot answer
// word for word as for a missing one; lists (sandboxes, snapshots, templates) show only the
// caller's; a quota set through one edge answers 429 naming it through another; the admin key
// lists both teams and makes and revokes team B's keys, which a team key cannot. Not covered
// here: exec through envd (the sandbox plane needs the sandbox's own token, which B never has).
func TestClusterTeamsRealNodes(t *testing.T) {
	etcd, nodes := storedCluster(t, 1, []string{"g1", "g2", "g3"}, 66)
	admin := nodes[0].key
	t.Cleanup(func() {
		if t.Failed() {
			for _, n := range nodes {
				t.Logf("node %s:\n%s", n.nodeID, n.logs())
			}
		}
	})
	type team struct {
		ID  string `json:"teamID"`
		Key struct {
			Key string `json:"key"`
		} `json:"apiKey"`
	}
	var ta, tb team
	nodes[0].asJSON(t, admin, "POST", "/ember/teams", map[string]any{"name": "team-a"}, 201, &ta)
	nodes[1].asJSON(t, admin, "POST", "/ember/teams", map[string]any{"name": "team-b"}, 201, &tb)
	a, b := ta.Key.Key, tb.Key.Key

	create := func(d *daemon, key string) sbx {
		t.Helper()
		var s sbx
		d.asJSON(t, key, "POST", "/v2/sandboxes", map[string]any{"templateID": "base", "timeout": 300}, 201, &s)
		t.Cleanup(func() { d.as(t, key, "DELETE", "/sandboxes/"+s.SandboxID, nil) })
		return s
	}
	// A's sandbox, and B's until one runs on another node than A's.
	sa := create(nodes[0], a)
	onA := nodeOf(t, nodes[0], sa.SandboxID)
	var bIDs []string
	for i := 0; ; i++ {
		if i == 6 {
			t.Fatalf("6 creates of team B all placed on %s, with A's sandbox", onA)
		}
		s := create(nodes[(i+1)%3], b)
		bIDs = append(bIDs, s.SandboxID)
		if nodeOf(t, nodes[0], s.SandboxID) != onA {
			break
		}
	}
	var snap struct {
		SnapshotID string `json:"snapshotID"`
	}
	nodes[2].asJSON(t, a, "POST", "/sandboxes/"+sa.SandboxID+"/snapshots", map[string]any{}, 201, &snap)
	t.Cleanup(func() { nodes[2].as(t, a, "DELETE", "/templates/"+snap.SnapshotID, nil) })

	// Another team's object answers as a missing one, through every edge.
	const missingSbx, missingTpl = "0000000000000000000a", "no-such-snapshot"
	sameAsMissing := func(d *daemon, method, path, id, missing string, body any) {
		t.Helper()
		code, got, _ := d.as(t, b, method, strings.ReplaceAll(path, "%s", id), body)
		mcode, want, _ := d.as(t, b, method, strings.ReplaceAll(path, "%s", missing), body)
		if code != http.StatusNotFound || mcode != code || strings.ReplaceAll(got, id, missing) != want {
			t.Errorf("through %s, team B's %s %s on A's: %d %s; on a missing one: %d %s", d.nodeID, method, path, code, got, mcode, want)
		}
	}
	for _, d := range nodes {
		for _, rt := range []struct {
			method, path string
			body         any
		}{
			{"GET", "/sandboxes/%s", nil}, {"DELETE", "/sandboxes/%s", nil}, {"POST", "/sandboxes/%s/pause", nil},
			{"POST", "/sandboxes/%s/connect", map[string]any{"timeout": 60}}, {"POST", "/sandboxes/%s/resume", map[string]any{"timeout": 60}},
			{"POST", "/sandboxes/%s/timeout", map[string]any{"timeout": 60}}, {"POST", "/sandboxes/%s/fork", map[string]any{"count": 1}},
			{"POST", "/sandboxes/%s/snapshots", map[string]any{}},
		} {
			sameAsMissing(d, rt.method, rt.path, sa.SandboxID, missingSbx, rt.body)
		}
		sameAsMissing(d, "GET", "/templates/%s", snap.SnapshotID, missingTpl, nil)
		sameAsMissing(d, "DELETE", "/templates/%s", snap.SnapshotID, missingTpl, nil)
	}
	// A create from A's snapshot, through every edge.
	for _, d := range nodes {
		code, got, _ := d.as(t, b, "POST", "/v2/sandboxes", map[string]any{"templateID": snap.SnapshotID})
		_, want, _ := d.as(t, b, "POST", "/v2/sandboxes", map[string]any{"templateID": missingTpl})
		if code != http.StatusNotFound || strings.ReplaceAll(got, snap.SnapshotID, missingTpl) != want {
			t.Errorf("through %s, team B's create from A's snapshot: %d %s; from a missing one: %s", d.nodeID, code, got, want)
		}
	}
	// A build from A's snapshot, by B (a build is its edge's: requested and started there).
	var req struct {
		TemplateID string `json:"templateID"`
		BuildID    string `json:"buildID"`
	}
	start := func(from string) (int, string) {
		nodes[1].asJSON(t, b, "POST", "/v3/templates", map[string]any{"name": "from-" + from}, 202, &req)
		code, body, _ := nodes[1].as(t, b, "POST", "/v2/templates/"+req.TemplateID+"/builds/"+req.BuildID, map[string]any{"fromTemplate": from, "steps": []any{}})
		return code, body
	}
	code, got := start(snap.SnapshotID)
	_, want := start(missingTpl)
	if code != http.StatusNotFound || strings.ReplaceAll(got, snap.SnapshotID, missingTpl) != want {
		t.Errorf("team B's build from A's snapshot: %d %s; from a missing one: %s", code, got, want)
	}

	// Lists show only the caller's, through every edge, once every edge lists A's snapshot (it
	// is the cluster's once uploaded); the owner's calls work through every edge.
	testutil.Eventually(t, 30*time.Second, "A's snapshot listed through every edge", func() bool {
		for _, d := range nodes {
			if _, l, _ := d.as(t, a, "GET", "/snapshots", nil); !strings.Contains(l, snap.SnapshotID) {
				return false
			}
		}
		return true
	})
	for _, d := range nodes {
		for _, c := range []struct {
			key       string
			own, not  []string
			snapshots bool
		}{{b, bIDs, []string{sa.SandboxID}, false}, {a, []string{sa.SandboxID}, bIDs, true}} {
			_, list, _ := d.as(t, c.key, "GET", "/v2/sandboxes", nil)
			for _, id := range c.own {
				if !strings.Contains(list, id) {
					t.Errorf("through %s: a team's list misses its sandbox %s: %s", d.nodeID, id, list)
				}
			}
			for _, id := range c.not {
				if strings.Contains(list, id) {
					t.Errorf("through %s: a team's list shows the other's sandbox %s", d.nodeID, id)
				}
			}
			for _, path := range []string{"/snapshots", "/templates"} {
				_, l, _ := d.as(t, c.key, "GET", path, nil)
				if strings.Contains(l, snap.SnapshotID) != c.snapshots {
					t.Errorf("through %s: GET %s of a team shows A's snapshot: %v, want %v", d.nodeID, path, !c.snapshots, c.snapshots)
				}
			}
		}
		d.asJSON(t, a, "GET", "/sandboxes/"+sa.SandboxID, nil, 200, nil)
	}

	// A quota set through one edge answers 429 naming it through another, once the nodes
	// that run B's sandboxes hold blocks of the quota for them (internal/cluster/quota.go).
	nodes[0].asJSON(t, admin, "PUT", "/ember/teams/"+tb.ID+"/quota", map[string]any{"sandboxes": len(bIDs)}, 200, nil)
	c := etcd.Client(t)
	testutil.Eventually(t, 15*time.Second, "the quota's blocks cover B's sandboxes", func() bool {
		sum, ok := clustertest.QuotaBlocks(t.Context(), c, tb.ID)
		return ok && sum.Sandboxes == len(bIDs)
	})
	code, body, h := nodes[2].as(t, b, "POST", "/v2/sandboxes", map[string]any{"templateID": "base"})
	if code != http.StatusTooManyRequests || !strings.Contains(body, "(quota sandboxes)") || h.Get("Retry-After") == "" {
		t.Errorf("team B over its quota through %s: %d %s (Retry-After %q)", nodes[2].nodeID, code, body, h.Get("Retry-After"))
	}
	// A is not held by B's quota.
	create(nodes[2], a)

	// The admin key manages both teams; a team key manages none.
	_, teams, _ := nodes[1].as(t, admin, "GET", "/ember/teams", nil)
	if !strings.Contains(teams, ta.ID) || !strings.Contains(teams, tb.ID) {
		t.Errorf("the admin's team list: %s", teams)
	}
	var k struct {
		ID   string `json:"id"`
		Key  string `json:"key"`
		Team string `json:"team"`
	}
	nodes[2].asJSON(t, admin, "POST", "/api-keys", map[string]any{"name": "second", "team": tb.ID}, 201, &k)
	if k.Team != tb.ID {
		t.Errorf("the admin's key for team B is of team %q", k.Team)
	}
	if _, l, _ := nodes[0].as(t, k.Key, "GET", "/v2/sandboxes", nil); !strings.Contains(l, bIDs[0]) || strings.Contains(l, sa.SandboxID) {
		t.Errorf("team B's second key lists: %s", l)
	}
	if code, _, _ := nodes[1].as(t, a, "POST", "/ember/teams", map[string]any{"name": "x"}); code != http.StatusForbidden {
		t.Errorf("a team key makes a team: %d", code)
	}
	if code, _, _ := nodes[1].as(t, a, "DELETE", "/api-keys/"+k.ID, nil); code != http.StatusNotFound {
		t.Errorf("team A revokes team B's key: %d", code)
	}
	if code, _, _ := nodes[0].as(t, admin, "DELETE", "/api-keys/"+k.ID, nil); code != http.StatusNoContent {
		t.Errorf("the admin revokes team B's key: %d", code)
	}
}
