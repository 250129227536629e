package cluster_test

import (
	"context"
	"errors"
	"github.com/ember-sandbox/ember/internal/testutil"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/cluster/clustertest"
	"github.com/ember-sandbox/ember/internal/errdefs"
)

// fakeLocal is a node's sandboxes without a runtime.
type fakeLocal struct {
	mu     sync.Mutex
	sbxs   map[string]cluster.LocalSandbox
	tpls   map[string]cluster.TemplateSize
	killed []string
}

func newLocal(tpls ...string) *fakeLocal {
	l := &fakeLocal{sbxs: map[string]cluster.LocalSandbox{}, tpls: map[string]cluster.TemplateSize{}}
	for _, t := range tpls {
		l.tpls[t] = cluster.TemplateSize{CPU: 1, MemoryMB: 512}
	}
	return l
}

func (l *fakeLocal) Sandboxes(context.Context) ([]cluster.LocalSandbox, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []cluster.LocalSandbox
	for _, s := range l.sbxs {
		out = append(out, s)
	}
	return out, nil
}

func (l *fakeLocal) Templates(context.Context) (map[string]cluster.TemplateSize, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := map[string]cluster.TemplateSize{}
	for k, v := range l.tpls {
		out[k] = v
	}
	return out, nil
}

func (l *fakeLocal) Kill(_ context.Context, id string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.sbxs, id)
	l.killed = append(l.killed, id)
	return nil
}

func (l *fakeLocal) add(id string) cluster.LocalSandbox {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := cluster.LocalSandbox{ID: id, TemplateID: "base", Running: true, CPU: 1, MemoryMB: 512}
	l.sbxs[id] = s
	return s
}

func (l *fakeLocal) has(id string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	_, ok := l.sbxs[id]
	return ok
}

const ttl = 2 * time.Second

func join(t *testing.T, endpoints []string, id string, slots int, local *fakeLocal, mod ...func(*cluster.Config)) *cluster.Cluster {
	t.Helper()
	c, err := clientv3.New(clustertest.ClientConfig(endpoints))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	cfg := cluster.Config{Client: c, NodeID: id, URL: "http://" + id + ".test", TTL: ttl, Local: local,
		Capacity:     cluster.Capacity{CPU: 4, MemoryMB: int64(slots) * 512, Slots: slots, DiskFreeMB: 10000},
		SyncInterval: 200 * time.Millisecond, Runsc: "r1", CPUClass: "x86-64-v3"}
	for _, m := range mod {
		m(&cfg)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cl, err := cluster.New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	return cl
}

func nodeState(cl *cluster.Cluster, id string) string {
	v, err := cl.Node(id)
	if err != nil {
		return "absent"
	}
	return v.State
}

// A node that stops renewing is seen gone within its TTL plus a margin; its sandboxes are
// marked lost naming it, its capacity is released, and /nodes shows it lost.
func TestNodeLossMarksSandboxesLost(t *testing.T) {
	e := clustertest.Start(t, 3)
	la, lb := newLocal("base"), newLocal("base")
	a := join(t, e.Endpoints(), "a", 4, la)
	b := join(t, e.Endpoints(), "b", 4, lb)
	ctx := context.Background()
	testutil.Eventually(t, 5*time.Second, "a sees b", func() bool { return nodeState(a, "b") == cluster.StateActive })
	if err := b.Claim(ctx, lb.add("sb1"), ""); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 5*time.Second, "a routes sb1 to b", func() bool {
		l, _ := a.Locate(ctx, "sb1", false)
		return l.Node == "b" && l.URL == "http://b.test" && !l.Local
	})
	testutil.Eventually(t, 5*time.Second, "b's allocation counts sb1", func() bool {
		v, _ := a.Node("b")
		return v.Allocated.Slots == 1 && len(v.Sandboxes) == 1
	})
	stopped := time.Now()
	b.Close() // no Leave: the lease runs out
	testutil.Eventually(t, ttl+3*time.Second, "sb1 reported lost", func() bool {
		l, err := a.Locate(ctx, "sb1", true)
		return err == nil && l.Lost != nil && l.Lost.Node == "b"
	})
	t.Logf("sb1 lost %v after b stopped (TTL %v)", time.Since(stopped).Round(time.Millisecond), ttl)
	if nodeState(a, "b") != cluster.StateLost {
		t.Fatalf("b is %s, want lost", nodeState(a, "b"))
	}
	// The reaper replaces the route by a lost record.
	testutil.Eventually(t, 5*time.Second, "sb1's route replaced by a lost record", func() bool {
		l, err := a.Locate(ctx, "sb1", false)
		return err == nil && l.Node == "" && l.Lost != nil && l.Lost.Node == "b"
	})
	// Nothing is placed on b any more.
	for i := 0; i < 8; i++ {
		r, err := a.Place(ctx, cluster.PlaceRequest{TemplateID: "base"})
		if err != nil {
			if errors.Is(err, errdefs.ErrExhausted) {
				break
			}
			t.Fatal(err)
		}
		if r.Node != "a" {
			t.Fatalf("placed on %s", r.Node)
		}
	}
}

// A node cut off from etcd fences itself within its TTL (kills its sandboxes), the others
// mark them lost, and once back it registers under a new epoch without resurrecting them.
func TestFencingOnPartition(t *testing.T) {
	e := clustertest.Start(t, 3)
	p := e.NewProxy(t)
	la, lb := newLocal("base"), newLocal("base")
	var fencedAt atomic.Int64
	a := join(t, p.Endpoints(), "a", 4, la, func(c *cluster.Config) {
		c.OnFence = func(string) { fencedAt.Store(time.Now().UnixNano()) }
	})
	b := join(t, e.Endpoints(), "b", 4, lb)
	ctx := context.Background()
	if err := a.Claim(ctx, la.add("sa1"), ""); err != nil {
		t.Fatal(err)
	}
	epoch := a.Epoch()
	testutil.Eventually(t, 5*time.Second, "b routes sa1 to a", func() bool { l, _ := b.Locate(ctx, "sa1", false); return l.Node == "a" })
	cut := time.Now()
	p.Cut()
	// OnFence runs once the sandboxes are killed (Fenced is true a moment before).
	testutil.Eventually(t, ttl+2*time.Second, "a fenced", func() bool { return fencedAt.Load() != 0 })
	if d := time.Duration(fencedAt.Load() - cut.UnixNano()); d > ttl+500*time.Millisecond {
		t.Fatalf("fenced %v after the cut, TTL %v", d, ttl)
	}
	if la.has("sa1") {
		t.Fatal("a fenced but sa1 still runs")
	}
	testutil.Eventually(t, ttl+3*time.Second, "b marks sa1 lost", func() bool {
		l, _ := b.Locate(ctx, "sa1", true)
		return l.Lost != nil && l.Lost.Node == "a"
	})
	// The sandbox the runtime failed to kill while cut off must not come back either.
	la.add("sa1")
	p.Mend()
	testutil.Eventually(t, 10*time.Second, "a back under a new epoch", func() bool { return !a.Fenced() && a.Epoch() != 0 && a.Epoch() != epoch })
	testutil.Eventually(t, 5*time.Second, "a kills the lost sa1", func() bool { return !la.has("sa1") })
	if l, _ := b.Locate(ctx, "sa1", true); l.Lost == nil {
		t.Fatalf("sa1 resurrected: %+v", l)
	}
	testutil.Eventually(t, 5*time.Second, "b sees a active again", func() bool { return nodeState(b, "a") == cluster.StateActive })
}

// One etcd member killed changes nothing: no node fences, placement and claims go on.
func TestOneEtcdMemberKilled(t *testing.T) {
	e := clustertest.Start(t, 3)
	la, lb := newLocal("base"), newLocal("base")
	a := join(t, e.Endpoints(), "a", 8, la)
	b := join(t, e.Endpoints(), "b", 8, lb)
	ctx := context.Background()
	ea, eb := a.Epoch(), b.Epoch()
	testutil.Eventually(t, 5*time.Second, "a sees both", func() bool { return len(a.Live()) == 2 })
	// The leader, the hardest member to lose: an election follows.
	leader := e.Leader(e.Client(t))
	if leader < 0 {
		t.Fatal("no leader")
	}
	e.Kill(leader)
	deadline := time.Now().Add(3 * ttl)
	for i := 0; time.Now().Before(deadline); i++ {
		r, err := a.Place(ctx, cluster.PlaceRequest{TemplateID: "base"})
		if err != nil {
			t.Fatalf("place %d with a member down: %v", i, err)
		}
		a.Cancel(ctx, r)
		time.Sleep(100 * time.Millisecond)
	}
	if err := b.Claim(ctx, lb.add("x1"), ""); err != nil {
		t.Fatal(err)
	}
	if a.Fenced() || b.Fenced() || a.Epoch() != ea || b.Epoch() != eb {
		t.Fatal("a node fenced or changed epoch with one etcd member down")
	}
	if nodeState(a, "b") != cluster.StateActive {
		t.Fatalf("b is %s", nodeState(a, "b"))
	}
}

// A reservation that is cancelled gives its room back; a placement skips excluded and
// drained nodes.
func TestCancelExcludeDrain(t *testing.T) {
	e := clustertest.Start(t, 3)
	a := join(t, e.Endpoints(), "a", 1, newLocal("base"))
	b := join(t, e.Endpoints(), "b", 1, newLocal("base"))
	ctx := context.Background()
	testutil.Eventually(t, 5*time.Second, "a sees b", func() bool { return len(a.Live()) == 2 })
	r, err := a.Place(ctx, cluster.PlaceRequest{TemplateID: "base", Exclude: []string{"a"}})
	if err != nil || r.Node != "b" {
		t.Fatalf("place excluding a: %+v %v", r, err)
	}
	if _, err := a.Place(ctx, cluster.PlaceRequest{TemplateID: "base", Exclude: []string{"a"}}); !errors.Is(err, errdefs.ErrExhausted) {
		t.Fatalf("b is full, got %v", err)
	}
	a.Cancel(ctx, r)
	testutil.Eventually(t, 5*time.Second, "b has room again", func() bool { v, _ := a.Node("b"); return v.Allocated.Slots == 0 })
	if err := a.Drain(ctx, "b", true); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 5*time.Second, "b draining", func() bool { return nodeState(a, "b") == cluster.StateDraining })
	if _, err := a.Place(ctx, cluster.PlaceRequest{TemplateID: "base", Exclude: []string{"a"}}); !errors.Is(err, errdefs.ErrExhausted) {
		t.Fatalf("b is drained, got %v", err)
	}
	if _, err := a.Place(ctx, cluster.PlaceRequest{TemplateID: "nope"}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("unknown template: %v", err)
	}
	_ = b
}

// An API key made on one node works on every node, and a revoked one nowhere.
func TestKeysAreTheClusters(t *testing.T) {
	e := clustertest.Start(t, 3)
	a := join(t, e.Endpoints(), "a", 1, newLocal())
	b := join(t, e.Endpoints(), "b", 1, newLocal())
	ctx := context.Background()
	ka, kb := auth.NewKeys(a.Keys()), auth.NewKeys(b.Keys())
	if _, _, err := ka.Create(ctx, "first"); err != nil {
		t.Fatal(err)
	}
	plain, k, err := ka.Create(ctx, "ci")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kb.Verify(ctx, plain); err != nil {
		t.Fatalf("key made on a, verified on b: %v", err)
	}
	if err := kb.Revoke(ctx, k.ID, ""); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 5*time.Second, "revoked on a", func() bool { _, err := ka.Verify(ctx, plain); return err != nil })
}

// When the node that would reap is itself dead but not yet expired, another live node takes
// the reaping at once: the dead node's sandboxes are lost within its TTL plus a margin, not a
// second TTL later (regression: the lowest-id live node was the reaper, even when dead).
func TestReapingWhenTheReaperIsDeadToo(t *testing.T) {
	e := clustertest.Start(t, 3)
	la, lb := newLocal("base"), newLocal("base")
	a := join(t, e.Endpoints(), "a", 4, la)
	b := join(t, e.Endpoints(), "b", 4, lb)
	c := join(t, e.Endpoints(), "c", 4, newLocal("base"))
	join(t, e.Endpoints(), "d", 4, newLocal("base"))
	ctx := context.Background()
	if err := b.Claim(ctx, lb.add("sb1"), ""); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 5*time.Second, "c sees all", func() bool { return len(c.Live()) == 4 })
	// b stops, then a (the lowest id): b's lease runs out while a, dead, still looks live.
	stopped := time.Now()
	b.Close()
	time.Sleep(ttl / 2)
	a.Close()
	testutil.Eventually(t, ttl+1500*time.Millisecond-time.Since(stopped), "sb1 lost within TTL + 1.5 s of b's stop", func() bool {
		l, _ := c.Locate(ctx, "sb1", true)
		return l.Lost != nil
	})
	t.Logf("sb1 lost %v after b stopped (TTL %v)", time.Since(stopped).Round(time.Millisecond), ttl)
}

// A node that already holds sandboxes the cluster has no route for (its routes were never
// written, e.g. a crash right after a create) joins at once and routes them: New's first
// reconcile used to claim them before the watch ran and wait for its context to end.
func TestJoinWithUnroutedSandboxes(t *testing.T) {
	e := clustertest.Start(t, 3)
	la := newLocal("base")
	la.add("held1")
	la.add("held2")
	start := time.Now()
	a := join(t, e.Endpoints(), "a", 4, la)
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("joining with 2 unrouted sandboxes took %s", d)
	}
	ctx := context.Background()
	for _, id := range []string{"held1", "held2"} {
		if l, err := a.Locate(ctx, id, true); err != nil || l.Node != "a" {
			t.Fatalf("%s: located %+v, %v; want node a", id, l, err)
		}
	}
}

// Avoid is soft: the avoided nodes are left out while another has room, and used when none has.
func TestPlacementAvoids(t *testing.T) {
	e := clustertest.Start(t, 3)
	a := join(t, e.Endpoints(), "a", 4, newLocal("base"))
	join(t, e.Endpoints(), "b", 4, newLocal("base"))
	join(t, e.Endpoints(), "c", 4, newLocal("base"))
	ctx := context.Background()
	testutil.Eventually(t, 5*time.Second, "a sees b and c", func() bool { return len(a.Live()) == 3 })
	for i := 0; i < 6; i++ {
		used := map[string]bool{}
		var avoid []string
		for j := 0; j < 3; j++ {
			r, err := a.Place(ctx, cluster.PlaceRequest{TemplateID: "base", Avoid: avoid})
			if err != nil {
				t.Fatalf("place avoiding %v: %v", avoid, err)
			}
			if used[r.Node] {
				t.Fatalf("round %d: placed on %s again while avoiding %v", i, r.Node, avoid)
			}
			used[r.Node] = true
			avoid = append(avoid, r.Node)
			a.Cancel(ctx, r)
		}
		// Every node avoided: placed all the same.
		r, err := a.Place(ctx, cluster.PlaceRequest{TemplateID: "base", Avoid: avoid})
		if err != nil {
			t.Fatalf("place avoiding every node: %v", err)
		}
		a.Cancel(ctx, r)
	}
}
