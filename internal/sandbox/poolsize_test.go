package sandbox_test

import (
	"context"
	"errors"
	"github.com/ember-sandbox/ember/internal/testutil"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/sandbox/sandboxtest"
)

// chargingDriver is the fake driver whose instances each hold mb MiB on the host.
type chargingDriver struct {
	*sandboxtest.Driver
	mb uint64
}

func (d chargingDriver) MemoryCharge(ctx context.Context, id string) (uint64, error) {
	return d.mb << 20, nil
}

func poolOf(n *node, id, kind string) sandbox.PoolState {
	for _, p := range n.m.Pools(context.Background()) {
		if p.TemplateID == id && p.Kind == kind {
			return p
		}
	}
	return sandbox.PoolState{}
}

// 20 creates in a loop drain a pool of 1; the pool then grows to the burst's size, within the
// memory budget at the instances' measured cost (20 MiB, not the 32 MiB estimate), and shows
// it all in its state.
func TestPoolGrowsToABurstWithinTheBudget(t *testing.T) {
	n := newNode(t, func(c *sandbox.Config) {
		c.PoolSize, c.PoolMemoryMB = 1, 300 // 15 instances at 20 MiB, 9 at the 32 MiB estimate
		c.Driver = chargingDriver{c.Driver.(*sandboxtest.Driver), 20}
	})
	tpl := n.build("base")
	testutil.Eventually(t, 5*time.Second, "pool at its minimum", func() bool { return poolOf(n, tpl.ID, "restored").Ready == 1 })
	for i := 0; i < 20; i++ {
		n.m.Kill(context.Background(), n.create(sandbox.CreateRequest{}).ID)
	}
	st := poolOf(n, tpl.ID, "restored")
	if st.Target < 20 || st.Burst < 19 {
		t.Fatalf("after 20 creates in a loop: %+v; want a target of at least the burst of 20", st)
	}
	testutil.Eventually(t, 10*time.Second, "pool filled to its budget", func() bool { return poolOf(n, tpl.ID, "restored").Ready == 15 })
	time.Sleep(1500 * time.Millisecond)
	st = poolOf(n, tpl.ID, "restored")
	if st.Ready != 15 || st.InstanceMB != 20 || st.BudgetMB != 300 || st.UsedMB > 300 || len(n.rig.Driver.Running()) != 15 {
		t.Fatalf("pool %+v with %d instances running; want 15 ready at 20 MiB within the 300 MiB budget", st, len(n.rig.Driver.Running()))
	}
	// The next burst of 15 is served from the pool.
	hits := st.Hits
	for i := 0; i < 15; i++ {
		n.m.Kill(context.Background(), n.create(sandbox.CreateRequest{}).ID)
	}
	if got := poolOf(n, tpl.ID, "restored").Hits - hits; got != 15 {
		t.Fatalf("%d of the next 15 creates came from the pool, want 15", got)
	}
}

// After a burst the pool holds its size for a decay period, then shrinks back to its minimum,
// slowly: not all at once.
func TestPoolShrinksSlowlyAfterABurst(t *testing.T) {
	n := newNode(t, func(c *sandbox.Config) { c.PoolSize = 1; c.PoolDecay = 2 * time.Second })
	tpl := n.build("base")
	testutil.Eventually(t, 5*time.Second, "pool at its minimum", func() bool { return poolOf(n, tpl.ID, "restored").Ready == 1 })
	for i := 0; i < 12; i++ {
		n.m.Kill(context.Background(), n.create(sandbox.CreateRequest{}).ID)
	}
	testutil.Eventually(t, 10*time.Second, "pool grew to the burst", func() bool { return poolOf(n, tpl.ID, "restored").Ready >= 10 })
	grown := time.Now()
	testutil.Eventually(t, 30*time.Second, "pool shrank back to its minimum", func() bool { return len(n.rig.Driver.Running()) == 1 })
	// The burst holds 2 s then halves every 2 s: from 12 to 1 takes about 9 s, never a single
	// step.
	if took := time.Since(grown); took < 4*time.Second {
		t.Fatalf("the pool shrank from its burst size to its minimum in %s: too fast", took)
	}
}

// Refills run concurrently, up to PoolRefills at once.
func TestPoolRefillsRunConcurrentlyWithinTheirBound(t *testing.T) {
	var cur, peak atomic.Int32
	var mu sync.Mutex
	hold := false // from the build's return on: the build restores its image once itself
	release := make(chan struct{})
	n := newNode(t, func(c *sandbox.Config) { c.PoolSize = 1; c.PoolRefills = 3 })
	n.rig.Driver.Fail = func(op, id string) error {
		if op != "Restore" {
			return nil
		}
		mu.Lock()
		h := hold
		mu.Unlock()
		if !h {
			return nil
		}
		c := cur.Add(1)
		for {
			p := peak.Load()
			if c <= p || peak.CompareAndSwap(p, c) {
				break
			}
		}
		<-release
		cur.Add(-1)
		return nil
	}
	tpl := n.build("base")
	mu.Lock()
	hold = true
	mu.Unlock()
	if _, err := n.m.WarmPool(context.Background(), tpl.ID, 8); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 5*time.Second, "3 refills in flight", func() bool { return cur.Load() == 3 })
	time.Sleep(300 * time.Millisecond)
	if st := poolOf(n, tpl.ID, "restored"); peak.Load() != 3 || st.RefillsInFlight != 3 || len(st.SandboxIDs) != 3 {
		t.Fatalf("refills at once: peak %d, state %+v; want 3", peak.Load(), st)
	}
	mu.Lock()
	hold = false
	mu.Unlock()
	close(release)
	testutil.Eventually(t, 10*time.Second, "warmed to 8", func() bool { return poolOf(n, tpl.ID, "restored").Ready == 8 })
}

// An explicit warm-up keeps a pool at N whatever the demand, beyond PoolMax, until it is set
// back to 0; it refuses what has no pool.
func TestWarmPool(t *testing.T) {
	n := newNode(t, func(c *sandbox.Config) { c.PoolSize = 1; c.PoolMax = 2; c.PoolDecay = time.Second })
	tpl := n.build("base")
	st, err := n.m.WarmPool(context.Background(), "base", 6)
	if err != nil || st.Warm != 6 || st.Target != 6 {
		t.Fatalf("WarmPool: %+v %v", st, err)
	}
	testutil.Eventually(t, 10*time.Second, "warmed to 6", func() bool { return poolOf(n, tpl.ID, "restored").Ready == 6 })
	time.Sleep(2500 * time.Millisecond) // more than a decay period: the floor holds
	if got := poolOf(n, tpl.ID, "restored").Ready; got != 6 {
		t.Fatalf("warmed pool holds %d after idling, want 6", got)
	}
	if _, err := n.m.WarmPool(context.Background(), "base", 0); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 20*time.Second, "back to its minimum", func() bool { return len(n.rig.Driver.Running()) == 1 })

	src := n.create(sandbox.CreateRequest{})
	if _, err := n.m.Snapshot(context.Background(), src.ID, "snap1"); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		id    string
		count int
		want  error
	}{{"nosuch", 1, errdefs.ErrNotFound}, {"base", -1, errdefs.ErrInvalid}, {"snap1", 2, errdefs.ErrInvalid}} {
		if _, err := n.m.WarmPool(context.Background(), c.id, c.count); !errors.Is(err, c.want) {
			t.Fatalf("WarmPool(%s, %d): %v, want %v", c.id, c.count, err, c.want)
		}
	}
	off := newNode(t, func(c *sandbox.Config) { c.PoolSize = 0 })
	off.build("base")
	if _, err := off.m.WarmPool(context.Background(), "base", 2); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("WarmPool with the pool disabled: %v, want a conflict", err)
	}
}

// A pre-started instance runs nothing until a create restores into it: the pool does not try
// to run a warm-up command in it (which could only fail, after a connection attempt).
func TestPrestartedInstancesAreNotWarmedUp(t *testing.T) {
	var mu sync.Mutex
	var dialed []string
	n := newNode(t, func(c *sandbox.Config) {
		c.PoolSize, c.PrestartSize, c.PrestartMax = 0, 1, 1
		dial := c.Dial
		c.Dial = func(ctx context.Context, network, addr string) (net.Conn, error) {
			mu.Lock()
			dialed = append(dialed, addr)
			mu.Unlock()
			return dial(ctx, network, addr)
		}
	})
	tpl := n.build("base")
	mu.Lock()
	dialed = nil // the build's own boot
	mu.Unlock()
	testutil.Eventually(t, 5*time.Second, "one pre-started instance", func() bool { return poolOf(n, tpl.ID, "prestarted").Ready == 1 })
	time.Sleep(200 * time.Millisecond)
	mu.Lock()
	defer mu.Unlock()
	if len(dialed) != 0 {
		t.Fatalf("the pool connected to %v, a pre-started instance's guest", dialed)
	}
}

// weightingDriver is the fake driver that records the CPU weights set on its instances.
type weightingDriver struct {
	*sandboxtest.Driver
	mu      *sync.Mutex
	weights map[string][]int
}

func (d weightingDriver) SetCPUWeight(ctx context.Context, id string, w int) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.weights[id] = append(d.weights[id], w)
	return nil
}

// Refills restore at a low CPU weight (pre-started, lowered, restored into), and a sandbox
// that takes a pool instance runs at the normal weight.
func TestPoolRefillsRunAtALowCPUWeight(t *testing.T) {
	wd := weightingDriver{mu: &sync.Mutex{}, weights: map[string][]int{}}
	n := newNode(t, func(c *sandbox.Config) {
		c.PoolSize = 1
		wd.Driver = c.Driver.(*sandboxtest.Driver)
		c.Driver = wd
	})
	tpl := n.build("base")
	testutil.Eventually(t, 5*time.Second, "pool filled", func() bool { return poolOf(n, tpl.ID, "restored").Ready == 1 })
	inst := n.rig.Driver.Running()[0]
	wd.mu.Lock()
	got := append([]int(nil), wd.weights[inst]...)
	wd.mu.Unlock()
	if len(got) != 1 || got[0] != 10 || n.rig.Driver.Calls("RestoreInto") == 0 {
		t.Fatalf("pool instance %s: weights %v, %d restores into pre-started instances; want weight 10 set before its restore", inst, got, n.rig.Driver.Calls("RestoreInto"))
	}
	sb := n.create(sandbox.CreateRequest{})
	if sb.Runtime.InstanceID != inst {
		t.Fatalf("create took %s, not the pool's %s", sb.Runtime.InstanceID, inst)
	}
	wd.mu.Lock()
	got = append([]int(nil), wd.weights[inst]...)
	wd.mu.Unlock()
	if len(got) != 2 || got[1] != 100 {
		t.Fatalf("weights of the instance a create took: %v, want 10 then 100", got)
	}
	// -1: one-step restores at the normal weight.
	wd2 := weightingDriver{mu: &sync.Mutex{}, weights: map[string][]int{}}
	o := newNode(t, func(c *sandbox.Config) {
		c.PoolSize, c.PoolRefillWeight = 1, -1
		wd2.Driver = c.Driver.(*sandboxtest.Driver)
		c.Driver = wd2
	})
	otpl := o.build("base")
	testutil.Eventually(t, 5*time.Second, "pool filled", func() bool { return poolOf(o, otpl.ID, "restored").Ready == 1 })
	if len(wd2.weights) != 0 || o.rig.Driver.Calls("RestoreInto") != 0 {
		t.Fatalf("with PoolRefillWeight -1: weights %v, %d restores into", wd2.weights, o.rig.Driver.Calls("RestoreInto"))
	}
}
