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
	// The edge reads the route it does not know, and keeps it.
	if l, err := edge.cl.Locate(ctx, id, false); err != nil || l.Node != owner.id {
		t.Fatalf("the edge routes the sandbox to %+v (%v), want %s", l, err, owner.id)
	}
	// Its route goes from etcd; an edge that kept it learns from the owner's "not here".
	testutil.Eventually(t, 10*time.Second, "the timed-out sandbox leaves the routing", func() bool {
		for _, n := range nodes {
			if l, _ := n.cl.Locate(ctx, id, true); l.Known() {
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
		v, _ := edge.cl.GetNode(ctx, n.id)
		for _, s := range v.Sandboxes {
			if s == id {
				t.Fatalf("/nodes lists %s on %s", id, n.id)
			}
		}
	}
}
