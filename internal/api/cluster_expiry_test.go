package api

import (
	"context"
	"github.com/ember-sandbox/ember/internal/testutil"
	"net/http"
	"testing"
	"time"
)

// A sandbox that times out on its node leaves the cluster's routing: within a sync interval
// or two no edge routes to it, GET through any edge is a 404, and /nodes lists it nowhere.
func TestClusterTimedOutSandboxLeavesRouting(t *testing.T) {
	nodes := newTestCluster(t, 3)
	var id string
	var owner, edge *clusterNode
	for i := 0; i < 12 && owner == nil; i++ {
		r := nodes[0].env.ctl(http.MethodPost, "/sandboxes", `{"templateID":"base","timeout":3}`)
		var sb struct {
			SandboxID string `json:"sandboxID"`
		}
		r.json(t, &sb)
		for _, n := range nodes[1:] {
			if n.holds(sb.SandboxID) {
				id, owner = sb.SandboxID, n
			}
		}
	}
	if owner == nil {
		t.Fatal("no create landed off the edge")
	}
	edge = nodes[0]
	ctx := context.Background()
	created := time.Now()
	// The edge's cache is fed by a watch: it learns the route a moment after the create.
	testutil.Eventually(t, 2*time.Second, "the edge routes the sandbox to its owner", func() bool {
		l, _ := edge.cl.Locate(ctx, id, false)
		return l.Node == owner.id
	})
	testutil.Eventually(t, 10*time.Second, "the timed-out sandbox leaves every edge's routing", func() bool {
		for _, n := range nodes {
			if l, _ := n.cl.Locate(ctx, id, false); l.Known() {
				return false
			}
		}
		return true
	})
	t.Logf("routes gone %v after the create (timeout 3 s)", time.Since(created).Round(time.Millisecond))
	if owner.holds(id) {
		t.Fatal("the route went but the sandbox still runs")
	}
	if l, err := edge.cl.Locate(ctx, id, true); err != nil || l.Known() {
		t.Fatalf("etcd still has %s: %+v %v", id, l, err)
	}
	if r := edge.env.ctl(http.MethodGet, "/sandboxes/"+id, ""); r.status != http.StatusNotFound {
		t.Fatalf("GET of the timed-out sandbox through %s: %d %s", edge.id, r.status, r.body)
	}
	for _, n := range nodes {
		v, _ := edge.cl.Node(n.id)
		for _, s := range v.Sandboxes {
			if s == id {
				t.Fatalf("/nodes lists %s on %s", id, n.id)
			}
		}
	}
}
