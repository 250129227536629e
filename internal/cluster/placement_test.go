package cluster_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/cluster/clustertest"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// Many edges placing at once, each until the cluster stays full, never overcommit a node: the
// units handed out (half of them claimed by their node, the rest held as reservations) fill
// every node to exactly its slots, no reservation ever takes a node's allocation over its capacity,
// the blocks the edges held are all spent or given back, and the lost races are counted.
func TestPlacementNeverOvercommits(t *testing.T) {
	e := clustertest.Start(t, 3)
	const nodes, slots, edges, perEdge = 3, 24, 6, 6
	members := map[string]*cluster.Cluster{}
	locals := map[string]*fakeLocal{}
	for i := 0; i < nodes; i++ {
		id := fmt.Sprintf("n%d", i)
		locals[id] = newLocal("base")
		// A TTL that a loaded host renews in time: a node that fences kills what it holds.
		members[id] = join(t, e.Endpoints(), id, slots, locals[id], func(c *cluster.Config) { c.TTL = 10 * time.Second })
	}
	var edgeNodes []*cluster.Cluster
	var hooked atomic.Int64 // OnPlacementRetry calls (the daemon's /metrics counter)
	for i := 0; i < edges; i++ {
		edgeNodes = append(edgeNodes, join(t, e.Endpoints(), fmt.Sprintf("e%d", i), 0, newLocal(),
			func(c *cluster.Config) { c.OnPlacementRetry = func() { hooked.Add(1) }; c.TTL = 10 * time.Second }))
	}
	for _, en := range edgeNodes {
		testutil.Eventually(t, 5*time.Second, "edge sees all nodes", func() bool { return len(en.Live()) == nodes+edges })
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// Every allocation a reservation wrote (with its block, in one revision), as they come. (A
	// node's reconcile may count a sandbox claimed meanwhile twice for a round: that only
	// holds room back.)
	admin := e.Client(t)
	var overAlloc atomic.Value
	watching := make(chan struct{})
	go func() {
		wch := admin.Watch(ctx, "/ember/", clientv3.WithPrefix())
		close(watching)
		for resp := range wch {
			byRev := map[int64][]*clientv3.Event{}
			for _, ev := range resp.Events {
				byRev[ev.Kv.ModRevision] = append(byRev[ev.Kv.ModRevision], ev)
			}
			for _, evs := range byRev {
				var alloc *clientv3.Event
				resv := false
				for _, ev := range evs {
					if ev.IsCreate() && strings.HasPrefix(string(ev.Kv.Key), "/ember/resv/") {
						resv = true
					} else if strings.HasPrefix(string(ev.Kv.Key), "/ember/alloc/") {
						alloc = ev
					}
				}
				var a cluster.Alloc
				if resv && alloc != nil && json.Unmarshal(alloc.Kv.Value, &a) == nil && (a.Slots > slots || a.MemoryMB > slots*512) {
					overAlloc.Store(fmt.Sprintf("%s = %+v", alloc.Kv.Key, a))
				}
			}
		}
	}()
	<-watching
	var mu sync.Mutex
	held := map[string]int{}
	var placed, claimed atomic.Int64
	var wg sync.WaitGroup
	for ei, en := range edgeNodes {
		for g := 0; g < perEdge; g++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				var fullSince time.Time
				for i := 0; ; i++ {
					r, err := en.Place(ctx, cluster.PlaceRequest{TemplateID: "base"})
					if errors.Is(err, errdefs.ErrExhausted) {
						// Full: until it has stayed full for longer than an idle block is kept.
						if fullSince.IsZero() {
							fullSince = time.Now()
						} else if time.Since(fullSince) > 4*time.Second {
							return
						}
						time.Sleep(50 * time.Millisecond)
						continue
					}
					fullSince = time.Time{}
					if err != nil {
						t.Error(err)
						return
					}
					placed.Add(1)
					if i%2 == 0 {
						s := locals[r.Node].add(fmt.Sprintf("sb-%d-%d-%d", ei, g, i))
						if err := members[r.Node].Claim(ctx, s, r.ID); err != nil {
							t.Error(err)
							return
						}
						claimed.Add(1)
					}
					mu.Lock()
					held[r.Node]++
					mu.Unlock()
				}
			}()
		}
	}
	wg.Wait()
	total, retries := 0, int64(0)
	for n, c := range held {
		if c > slots {
			t.Errorf("node %s holds %d sandboxes and reservations for %d slots", n, c, slots)
		}
		total += c
	}
	if total != nodes*slots {
		t.Errorf("held %d in all, want the cluster's %d slots (%v)", total, nodes*slots, held)
	}
	for _, en := range edgeNodes {
		retries += en.PlacementRetries()
	}
	if hooked.Load() != retries {
		t.Errorf("OnPlacementRetry ran %d times for %d placement retries", hooked.Load(), retries)
	}
	if v := overAlloc.Load(); v != nil {
		t.Errorf("a reservation took a node's allocation over its capacity: %v", v)
	}
	// Every node's allocation is what it holds: nothing stranded in an edge's block.
	testutil.Eventually(t, 10*time.Second, "allocations settle at the slots", func() bool {
		for id := range members {
			if v, err := edgeNodes[0].Node(id); err != nil || v.Allocated.Slots != slots {
				return false
			}
		}
		return true
	})
	resv, err := admin.Get(ctx, "/ember/resv/", clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	units := 0
	for _, kv := range resv.Kvs {
		var r struct {
			Units int `json:"units"`
		}
		_ = json.Unmarshal(kv.Value, &r)
		units += max(r.Units, 1)
		if !strings.HasPrefix(string(kv.Key), "/ember/resv/n") {
			t.Errorf("reservation on a node with no slots: %s", kv.Key)
		}
	}
	t.Logf("%d placements (%d claimed) from %d edges × %d: %v; %d lost races (%.3f a placement); %d reservation records for %d units left",
		placed.Load(), claimed.Load(), edges, perEdge, held, retries, float64(retries)/float64(placed.Load()), len(resv.Kvs), units)
}

// A create of a built-in template (E2B's code-interpreter-v1) that no node has yet is placed
// on a node that builds it, the same one from every edge (the creates that arrive while it
// builds join its one build), never on a node that cannot build it; once a node has the
// template, creates go to the nodes that have it; an unknown template is still not found.
func TestPlacementOfABuiltinTemplate(t *testing.T) {
	e := clustertest.Start(t, 1)
	builtin := func(c *cluster.Config) {
		c.Builtins = map[string]cluster.TemplateSize{"interp-v1": {CPU: 1, MemoryMB: 512}}
	}
	join(t, e.Endpoints(), "a", 8, newLocal("base"))
	join(t, e.Endpoints(), "b", 8, newLocal("base"), builtin)
	cLocal := newLocal("base")
	join(t, e.Endpoints(), "c", 8, cLocal, builtin)
	var edges []*cluster.Cluster
	for i := 0; i < 3; i++ {
		edges = append(edges, join(t, e.Endpoints(), fmt.Sprintf("e%d", i), 0, newLocal()))
	}
	for _, en := range edges {
		testutil.Eventually(t, 5*time.Second, "edge sees all nodes", func() bool { return len(en.Live()) == 6 })
	}
	ctx := context.Background()
	for i := 0; i < 6; i++ {
		r, err := edges[i%3].Place(ctx, cluster.PlaceRequest{TemplateID: "interp-v1"})
		if err != nil {
			t.Fatalf("place %d of a built-in template no node has: %v", i, err)
		}
		if r.Node != "b" {
			t.Fatalf("place %d went to %s, not to b (the first node that builds it)", i, r.Node)
		}
	}
	if _, err := edges[0].Place(ctx, cluster.PlaceRequest{TemplateID: "nosuch"}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("an unknown template: %v", err)
	}
	// c has built it: creates go there (b, building it meanwhile, is no longer asked).
	cLocal.mu.Lock()
	cLocal.tpls["interp-v1"] = cluster.TemplateSize{CPU: 1, MemoryMB: 512}
	cLocal.mu.Unlock()
	late := join(t, e.Endpoints(), "e9", 0, newLocal())
	testutil.Eventually(t, 5*time.Second, "the edge sees c with the template", func() bool {
		for _, n := range late.Live() {
			if _, ok := n.Templates["interp-v1"]; ok && n.ID == "c" {
				return true
			}
		}
		return false
	})
	for i := 0; i < 3; i++ {
		r, err := late.Place(ctx, cluster.PlaceRequest{TemplateID: "interp-v1"})
		if err != nil {
			t.Fatal(err)
		}
		if r.Node != "c" {
			t.Fatalf("placed on %s, not on c (which has the template)", r.Node)
		}
	}
}
