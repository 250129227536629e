package cluster_test

import (
	"context"
	"errors"
	"github.com/ember-sandbox/ember/internal/testutil"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/cluster/clustertest"
	"github.com/ember-sandbox/ember/internal/errdefs"
)

// With 2 of 3 etcd members stopped, for several TTLs: every node says why control calls are
// refused (no quorum), no node fences or kills anything, and once the members are back every
// node is available again under the same epoch, with its sandboxes routed to it, not lost.
func TestQuorumLossKillsNothing(t *testing.T) {
	e := clustertest.Start(t, 3)
	la, lb := newLocal("base"), newLocal("base")
	// A TTL well above etcd's election timeout (500 ms here, 1 s by default): the members
	// notice the lost leader, and say so, before any node's renewal is due.
	const ttl = 4 * time.Second
	long := func(c *cluster.Config) { c.TTL = ttl }
	a := join(t, e.Endpoints(), "a", 4, la, long)
	b := join(t, e.Endpoints(), "b", 4, lb, long)
	ctx := context.Background()
	if err := a.Claim(ctx, la.add("qa1"), ""); err != nil {
		t.Fatal(err)
	}
	if err := b.Claim(ctx, lb.add("qb1"), ""); err != nil {
		t.Fatal(err)
	}
	ea, eb := a.Epoch(), b.Epoch()
	testutil.Eventually(t, 5*time.Second, "a routes qb1 to b", func() bool { l, _ := a.Locate(ctx, "qb1", false); return l.Node == "b" })

	stopped := time.Now()
	e.Kill(1)
	e.Kill(2)
	took := testutil.Eventually(t, 5*time.Second, "a and b refuse control calls", func() bool {
		return a.Available() != nil && b.Available() != nil
	})
	t.Logf("control calls refused %v after 2 of 3 members stopped", took)
	err := a.Available()
	if !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "no quorum") {
		t.Fatalf("a says %v, want no quorum (ErrUnavailable)", err)
	}
	// Well past the TTL: nobody fenced, nothing killed, the routing caches still route.
	time.Sleep(3 * ttl)
	if a.Fenced() || b.Fenced() || a.Fences()+b.Fences() != 0 {
		t.Fatalf("a node fenced during a quorum loss (fences a=%d b=%d)", a.Fences(), b.Fences())
	}
	if !la.has("qa1") || !lb.has("qb1") {
		t.Fatal("a sandbox was killed during a quorum loss")
	}
	if l, _ := a.Locate(ctx, "qb1", false); l.Node != "b" || l.Dead {
		t.Fatalf("a's cache routes qb1 %+v, want to b", l)
	}

	e.Restart(1)
	e.Restart(2)
	back := testutil.Eventually(t, 15*time.Second, "a and b available again", func() bool {
		return a.Available() == nil && b.Available() == nil
	})
	t.Logf("available again %v after the members restarted (%v after the stop)", back, time.Since(stopped).Round(time.Millisecond))
	// A few syncs and renewals later: same epochs, nothing lost.
	time.Sleep(ttl)
	if a.Epoch() != ea || b.Epoch() != eb || a.Fences()+b.Fences() != 0 {
		t.Fatal("a node changed epoch across the quorum loss")
	}
	for _, id := range []string{"qa1", "qb1"} {
		l, err := b.Locate(ctx, id, true)
		if err != nil || l.Lost != nil || l.Node == "" || l.Dead {
			t.Fatalf("%s after the quorum loss: %+v %v", id, l, err)
		}
	}
	if !la.has("qa1") || !lb.has("qb1") {
		t.Fatal("a sandbox was killed after the quorum came back")
	}
	r, err := a.Place(ctx, cluster.PlaceRequest{TemplateID: "base"})
	if err != nil {
		t.Fatalf("place after the quorum came back: %v", err)
	}
	a.Cancel(ctx, r)
}

// A node cut off from a healthy majority (no member answers it) still fences within its TTL,
// and says why control calls are refused meanwhile.
func TestCutOffNodeRefusesAndFences(t *testing.T) {
	e := clustertest.Start(t, 3)
	p := e.NewProxy(t)
	la := newLocal("base")
	var fenced atomic.Bool
	a := join(t, p.Endpoints(), "a", 4, la, func(c *cluster.Config) { c.OnFence = func(string) { fenced.Store(true) } })
	ctx := context.Background()
	if err := a.Claim(ctx, la.add("ca1"), ""); err != nil {
		t.Fatal(err)
	}
	p.Cut()
	testutil.Eventually(t, 3*time.Second, "a refuses control calls", func() bool { return a.Available() != nil })
	if err := a.Available(); !strings.Contains(err.Error(), "unreachable from node a") {
		t.Fatalf("a says %v", err)
	}
	testutil.Eventually(t, ttl+2*time.Second, "a fenced", func() bool { return fenced.Load() })
	if la.has("ca1") {
		t.Fatal("a fenced but ca1 still runs")
	}
	p.Mend()
	testutil.Eventually(t, 10*time.Second, "a available again", func() bool { return a.Available() == nil && !a.Fenced() })
}
