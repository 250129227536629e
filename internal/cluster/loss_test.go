package cluster_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/cluster/clustertest"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// A node that held 1,000 sandboxes stops: every one of them is reported lost once its lease
// ends (within its TTL + 1 s of the stop, whatever the count: no record has to be written per
// sandbox first), while its stored paused sandbox stays resumable elsewhere; the lost
// records replace the routes afterwards.
func TestThousandSandboxesLostInOneTTL(t *testing.T) {
	const n = 1000
	e := clustertest.Start(t, 1)
	la, lb := newLocal("base"), newLocal("base")
	a := join(t, e.Endpoints(), "a", 4, la)
	b := join(t, e.Endpoints(), "b", n+1, lb)
	pa, pb := &fakePorter{local: la}, &fakePorter{local: lb}
	ma, mb := cluster.NewMoves(a, pa), cluster.NewMoves(b, pb)
	t.Cleanup(ma.Close)
	t.Cleanup(mb.Close)
	ctx := context.Background()
	testutil.Eventually(t, 5*time.Second, "a sees b", func() bool { return len(a.Live()) == 2 })
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < n; i += 8 {
				if err := b.Claim(ctx, lb.add(fmt.Sprintf("s%04d", i)), ""); err != nil {
					errs <- err
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if err := b.Claim(ctx, lb.add("sp"), ""); err != nil {
		t.Fatal(err)
	}
	if err := mb.Stored(ctx, stored("sp", "paused-sp")); err != nil {
		t.Fatal(err)
	}
	if got := b.Routed("b"); got != n+1 {
		t.Fatalf("b holds %d routes, want %d", got, n+1)
	}

	stopped := time.Now()
	b.Close() // no Leave: the lease runs out
	for time.Since(stopped) < ttl+5*time.Second && len(a.Live()) != 1 {
		time.Sleep(5 * time.Millisecond)
	}
	gone := time.Since(stopped)
	lost, err := a.LostSandboxes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	listed := time.Since(stopped)
	byB := 0
	for _, l := range lost {
		if l.Node == "b" {
			byB++
		}
		if l.ID == "sp" {
			t.Fatal("the stored paused sandbox is listed lost")
		}
	}
	if byB != n {
		t.Fatalf("%d sandboxes listed lost %v after b stopped, want %d", byB, listed, n)
	}
	t.Logf("b gone %v after it stopped, its %d sandboxes listed lost at %v (TTL %v)", gone.Round(time.Millisecond), n, listed.Round(time.Millisecond), ttl)
	if listed > ttl+time.Second {
		t.Fatalf("%d sandboxes reported lost %v after their node stopped, want within TTL %v + 1 s", n, listed, ttl)
	}
	for i := 0; i < n; i += 97 {
		id := fmt.Sprintf("s%04d", i)
		if l, err := a.Locate(ctx, id, false); err != nil || l.Lost == nil || l.Lost.Node != "b" {
			t.Fatalf("%s: %+v %v, want lost with b", id, l, err)
		}
	}
	// The stored paused one: not lost, adopted by a.
	if l, err := a.Locate(ctx, "sp", false); err != nil || l.Lost != nil || !l.Stored || !l.Dead {
		t.Fatalf("sp after its node died: %+v %v, want stored, its node dead, not lost", l, err)
	}
	if err := ma.Adopt(ctx, "sp"); err != nil {
		t.Fatal(err)
	}
	if l, _ := a.Locate(ctx, "sp", true); !l.Local {
		t.Fatalf("sp after the adoption: %+v, want a's", l)
	}
	// The reaper replaces the dead epoch's routes by lost records.
	c := e.Client(t)
	testutil.Eventually(t, 20*time.Second, "the dead routes replaced by lost records", func() bool {
		r, err := c.Get(ctx, "/ember/lost/", clientv3.WithPrefix(), clientv3.WithCountOnly())
		return err == nil && r.Count == n
	})
	if l, err := a.LostSandboxes(ctx); err != nil || len(l) != n {
		t.Fatalf("lost after the reaping: %d %v, want %d", len(l), err, n)
	}
}

// The node that cleans up after a dead one (the reaper) meets an etcd failure on one of its
// steps (a lease, its claim's answer, the down record, the read of the routes, the lost
// records): it lets the job go and tries again, so that the dead node is still reported lost
// (GET /nodes/<id> "lost") a moment after its TTL, recorded down (for the nodes that start
// later) and its routes replaced by lost records, instead of a node gone from /nodes with no
// trace, its job held by a reaper that gave up.
func TestReaperSurvivesAFailedStep(t *testing.T) {
	e := clustertest.Start(t, 1)
	for i, tc := range []struct {
		name, method, key string
		after             bool
	}{
		{"lease grant", "grant", "", false},
		{"claim answer lost", "txn", "reaping/", true},
		{"down record", "txn", "down/", false},
		{"routes read", "get", "sandboxes/", false},
		{"lost records", "txn", "lost/", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			pfx := fmt.Sprintf("/reap%d/", i)
			f := &faults{}
			la, lb := newLocal("base"), newLocal("base")
			a := join(t, e.Endpoints(), "a", 4, la, func(c *cluster.Config) { c.Prefix = pfx; f.install(c.Client) })
			b := join(t, e.Endpoints(), "b", 4, lb, func(c *cluster.Config) { c.Prefix = pfx })
			ctx := context.Background()
			testutil.Eventually(t, 5*time.Second, "a sees b", func() bool { return nodeState(a, "b") == cluster.StateActive })
			for _, id := range []string{"s1", "s2", "s3"} {
				if err := b.Claim(ctx, lb.add(id), ""); err != nil {
					t.Fatal(err)
				}
			}
			fired := f.arm(tc.method, pfx+tc.key, tc.after)
			stopped := time.Now()
			b.Close() // no Leave: the lease runs out
			testutil.Eventually(t, ttl+5*time.Second, "b reported lost", func() bool { return nodeState(a, "b") == cluster.StateLost })
			t.Logf("b reported lost %v after it stopped (TTL %v)", time.Since(stopped).Round(time.Millisecond), ttl)
			c := e.Client(t)
			testutil.Eventually(t, 10*time.Second, "b recorded down, its routes replaced by lost records", func() bool {
				d, err := c.Get(ctx, pfx+"down/b", clientv3.WithCountOnly())
				r, err2 := c.Get(ctx, pfx+"lost/", clientv3.WithPrefix(), clientv3.WithCountOnly())
				return err == nil && err2 == nil && d.Count == 1 && r.Count == 3
			})
			select {
			case <-fired:
			default:
				t.Fatalf("the %s fault never fired: the test proves nothing", tc.name)
			}
			if l, err := a.Locate(ctx, "s2", true); err != nil || l.Lost == nil || l.Lost.Node != "b" {
				t.Fatalf("s2: %+v %v, want lost with b", l, err)
			}
		})
	}
}

// A node that dies while another is cut off from etcd, its deletion compacted away before the
// other's watch comes back: the watch reloads the nodes, and the one that vanished from them is
// reaped all the same (reported lost, its routes replaced by lost records), not forgotten.
func TestReaperAfterCompactedWatch(t *testing.T) {
	e := clustertest.Start(t, 1)
	p := e.NewProxy(t)
	la, lb := newLocal("base"), newLocal("base")
	a := join(t, p.Endpoints(), "a", 4, la, func(c *cluster.Config) { c.TTL = 20 * time.Second })
	b := join(t, e.Endpoints(), "b", 4, lb)
	ctx := context.Background()
	testutil.Eventually(t, 5*time.Second, "a sees b", func() bool { return nodeState(a, "b") == cluster.StateActive })
	if err := b.Claim(ctx, lb.add("s1"), ""); err != nil {
		t.Fatal(err)
	}
	p.Cut()
	b.Close() // no Leave: the lease runs out
	c := e.Client(t)
	testutil.Eventually(t, ttl+5*time.Second, "b's record gone", func() bool {
		r, err := c.Get(ctx, "/ember/nodes/b", clientv3.WithCountOnly())
		return err == nil && r.Count == 0
	})
	r, err := c.Put(ctx, "/ember/test/after", "x")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Compact(ctx, r.Header.Revision); err != nil {
		t.Fatal(err)
	}
	p.Mend()
	testutil.Eventually(t, 15*time.Second, "b reported lost", func() bool { return nodeState(a, "b") == cluster.StateLost })
	testutil.Eventually(t, 10*time.Second, "b's route replaced by a lost record", func() bool {
		r, err := c.Get(ctx, "/ember/lost/s1", clientv3.WithCountOnly())
		return err == nil && r.Count == 1
	})
}
