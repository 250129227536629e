package api

import (
	"context"
	"github.com/ember-sandbox/ember/internal/testutil"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/cluster/clustertest"
)

// With 2 of 3 etcd members stopped, control calls through every edge answer 503 with
// {"code":503,"message":...} naming the cause, within a few seconds each; the sandbox plane
// goes on through any edge for sandboxes on any node; when the members are back everything
// works again and no sandbox was killed.
func TestClusterQuorumLoss(t *testing.T) {
	e := clustertest.Start(t, 3)
	// A TTL well above etcd's election timeout (500 ms here, 1 s by default): the members
	// notice the lost leader, and say so, before any node's renewal is due.
	const ttl = 4 * time.Second
	long := func(c *cluster.Config) { c.TTL = ttl }
	nodes := []*clusterNode{newClusterNodeWith(t, e, "a", nil, long, nil), newClusterNodeWith(t, e, "b", nil, long, nil)}
	key, _, err := nodes[0].env.keys.Create(context.Background(), "test")
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range nodes {
		n.env.key = key
	}
	testutil.Eventually(t, 5*time.Second, "both nodes see both", func() bool { return len(nodes[0].cl.Live()) == 2 && len(nodes[1].cl.Live()) == 2 })
	owner := map[string]*clusterNode{}
	var ids []string
	for i := 0; i < 6 && len(owner) < 4; i++ {
		r := nodes[i%2].env.ctl(http.MethodPost, "/sandboxes", `{"templateID":"base","timeout":300}`)
		var sb struct {
			SandboxID string `json:"sandboxID"`
		}
		r.json(t, &sb)
		for _, n := range nodes {
			if n.holds(sb.SandboxID) {
				owner[sb.SandboxID] = n
				ids = append(ids, sb.SandboxID)
			}
		}
	}
	if len(ids) == 0 {
		t.Fatal("no sandbox created")
	}

	e.Kill(1)
	e.Kill(2)
	testutil.Eventually(t, 5*time.Second, "an edge refuses creates", func() bool {
		return nodes[0].env.ctl(http.MethodPost, "/sandboxes", `{"templateID":"base"}`).status == http.StatusServiceUnavailable
	})
	calls := []struct{ method, path, body string }{
		{http.MethodPost, "/sandboxes", `{"templateID":"base"}`},
		{http.MethodGet, "/sandboxes", ""},
		{http.MethodGet, "/v2/sandboxes", ""},
		{http.MethodGet, "/sandboxes/" + ids[0], ""},
		{http.MethodPost, "/sandboxes/" + ids[0] + "/pause", ""},
		{http.MethodPost, "/sandboxes/" + ids[0] + "/connect", `{"timeout":60}`},
		{http.MethodDelete, "/sandboxes/" + ids[0], ""},
		{http.MethodGet, "/api-keys", ""},
		{http.MethodPost, "/api-keys", `{"name":"x"}`},
		{http.MethodGet, "/templates", ""},
	}
	// Long past the TTL: still refused, nothing killed.
	for round := 0; round < 4; round++ {
		for _, n := range nodes {
			for _, c := range calls {
				start := time.Now()
				r := n.env.ctl(c.method, c.path, c.body)
				took := time.Since(start)
				var eb errorBody
				r.json(t, &eb)
				if r.status != http.StatusServiceUnavailable || eb.Code != 503 || !strings.Contains(eb.Message, "cluster store (etcd)") {
					t.Fatalf("%s %s through %s without quorum: %d %s", c.method, c.path, n.id, r.status, r.body)
				}
				if took > 3*time.Second {
					t.Fatalf("%s %s through %s took %v to refuse", c.method, c.path, n.id, took)
				}
			}
			for _, id := range ids {
				r := n.env.do(http.MethodPost, "/echo", "hi "+id, "E2b-Sandbox-Id", id)
				if r.status != http.StatusOK || !strings.Contains(string(r.body), "hi "+id) {
					t.Fatalf("sandbox plane %s (on %s) through %s without quorum: %d %s", id, owner[id].id, n.id, r.status, r.body)
				}
			}
		}
		time.Sleep(ttl / 2)
	}
	var eb errorBody
	nodes[1].env.ctl(http.MethodGet, "/sandboxes", "").json(t, &eb)
	t.Logf("without quorum: %s", eb.Message)

	e.Restart(1)
	e.Restart(2)
	testutil.Eventually(t, 15*time.Second, "control calls served again", func() bool {
		return nodes[0].env.ctl(http.MethodGet, "/sandboxes", "").status == http.StatusOK &&
			nodes[1].env.ctl(http.MethodGet, "/sandboxes", "").status == http.StatusOK
	})
	for _, n := range nodes {
		if n.cl.Fences() != 0 {
			t.Fatalf("%s fenced during the quorum loss", n.id)
		}
		var l []listedSandboxJSON
		n.env.ctl(http.MethodGet, "/sandboxes", "").json(t, &l)
		if len(l) != len(ids) {
			t.Fatalf("after the quorum loss %s lists %d sandboxes, want %d", n.id, len(l), len(ids))
		}
	}
	for _, id := range ids {
		if !owner[id].holds(id) {
			t.Fatalf("%s was killed", id)
		}
	}
	if r := nodes[1].env.ctl(http.MethodPost, "/sandboxes", `{"templateID":"base"}`); r.status != http.StatusCreated {
		t.Fatalf("create after the quorum came back: %d %s", r.status, r.body)
	}
}
