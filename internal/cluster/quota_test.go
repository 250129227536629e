package cluster_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/cluster/clustertest"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// The work of a team's quota in a cluster per create (real etcd, two nodes): a node writes its
// block of the quota only when it runs out (in blocks sized to its demand), so a burst of
// creates costs far less than a write each; the blocks together never exceed the quota, and
// a node refused names what the others hold.
func TestQuotaBlocksWorkPerCreate(t *testing.T) {
	e := clustertest.Start(t, 1)
	a := join(t, e.Endpoints(), "a", 4, newLocal("base"))
	b := join(t, e.Endpoints(), "b", 4, newLocal("base"))
	var mu sync.Mutex
	held := map[string]int{} // by node: the sandboxes it holds of the team
	heldBy := func(node string) func(context.Context) (map[string]auth.Quota, error) {
		return func(context.Context) (map[string]auth.Quota, error) {
			mu.Lock()
			defer mu.Unlock()
			return map[string]auth.Quota{"t1": {Sandboxes: held[node]}}, nil
		}
	}
	qa, qb := a.NewQuotaBlocks(heldBy("a")), b.NewQuotaBlocks(heldBy("b"))
	c := e.Client(t)
	var writes atomic.Int64
	wctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	wch := c.Watch(wctx, "/ember/quota/", clientv3.WithPrefix())
	go func() {
		for r := range wch {
			writes.Add(int64(len(r.Events)))
		}
	}()
	ctx := context.Background()
	one := auth.Quota{Sandboxes: 1}
	create := func(node string, q interface {
		Cover(context.Context, string, auth.Quota, auth.Quota, auth.Quota) (auth.Quota, bool, error)
	}, limit int) (auth.Quota, bool) {
		mu.Lock()
		need := auth.Quota{Sandboxes: held[node] + 1}
		mu.Unlock()
		others, ok, err := q.Cover(ctx, "t1", auth.Quota{Sandboxes: limit}, need, one)
		if err != nil {
			t.Fatal(err)
		}
		if ok {
			mu.Lock()
			held[node]++
			mu.Unlock()
		}
		return others, ok
	}
	const n = 200
	for i := 0; i < n; i++ {
		if _, ok := create("a", qa, 1000); !ok {
			t.Fatalf("create %d refused under a quota of 1000", i)
		}
	}
	// The watch has seen every write once it sees one made after them.
	before := writes.Load()
	if _, err := c.Put(ctx, "/ember/quota/zz-flush", "x"); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 5*time.Second, "the watch up to date", func() bool { return writes.Load() > before })
	w := writes.Load() - 1
	t.Logf("%d creates on one node: %d writes of quota blocks (%.2f a create)", n, w, float64(w)/n)
	if float64(w)/n > 0.5 {
		t.Fatalf("%d writes for %d creates", w, n)
	}
	// Once a is idle its block comes down to what it holds; then b takes exactly what is left
	// of a quota of n+2, and is refused naming what a holds.
	testutil.Eventually(t, 5*time.Second, "a's idle block lowered", func() bool { return qa.Held("t1").Sandboxes == n })
	for i := 0; i < 2; i++ {
		if _, ok := create("b", qb, n+2); !ok {
			t.Fatalf("b's create %d refused with room left", i)
		}
	}
	if others, ok := create("b", qb, n+2); ok || others.Sandboxes != n {
		t.Fatalf("b over the quota: admitted %v, naming %d held elsewhere (want a's %d)", ok, others.Sandboxes, n)
	}
	if got := qa.Held("t1").Sandboxes + qb.Held("t1").Sandboxes; got != n+2 {
		t.Fatalf("blocks hold %d of a quota of %d", got, n+2)
	}
}
