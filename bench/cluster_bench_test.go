package bench

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/cluster/clustertest"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"log/slog"
)

// simLocal is a simulated node's runtime: sandboxes are map entries.
type simLocal struct {
	mu   sync.Mutex
	sbxs map[string]cluster.LocalSandbox
}

func (l *simLocal) Sandboxes(context.Context) ([]cluster.LocalSandbox, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make([]cluster.LocalSandbox, 0, len(l.sbxs))
	for _, s := range l.sbxs {
		out = append(out, s)
	}
	return out, nil
}

func (l *simLocal) Templates(context.Context) (map[string]cluster.TemplateSize, error) {
	return map[string]cluster.TemplateSize{"base": {CPU: 1, MemoryMB: 256}}, nil
}

func (l *simLocal) Kill(_ context.Context, id string) error {
	l.mu.Lock()
	delete(l.sbxs, id)
	l.mu.Unlock()
	return nil
}

func (l *simLocal) set(s cluster.LocalSandbox) {
	l.mu.Lock()
	l.sbxs[s.ID] = s
	l.mu.Unlock()
}

type simNode struct {
	id    string
	cl    *cluster.Cluster
	local *simLocal
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

// BenchmarkClusterScale is the control-plane scale simulation (issue 12): simulated nodes
// (ember's real membership, placement and routing code over a fake runtime) on a real 3-member
// etcd hold sandboxes under a churn of creates, pauses, resumes and kills; then some nodes
// stop. It prints placement latency, the routing cache's lag behind etcd, the time to mark the
// stopped nodes' sandboxes lost, etcd's size and one edge's memory. Sizes:
// EMBER_SIM_NODES (100), EMBER_SIM_SANDBOXES (30000), EMBER_SIM_CHURN (6000),
// EMBER_SIM_STOP (10), EMBER_SIM_TTL_S (10).
//
//	go test -run '^$' -bench BenchmarkClusterScale -benchtime 1x -timeout 20m ./bench/
func BenchmarkClusterScale(b *testing.B) {
	nNodes, nSbx := envInt("EMBER_SIM_NODES", 100), envInt("EMBER_SIM_SANDBOXES", 30000)
	nChurn, nStop := envInt("EMBER_SIM_CHURN", 6000), envInt("EMBER_SIM_STOP", 10)
	ttl := time.Duration(envInt("EMBER_SIM_TTL_S", 10)) * time.Second
	slots := nSbx*13/10/nNodes + 1
	e := clustertest.Start(b, 3)
	ctx := context.Background()
	logger := slog.New(slog.DiscardHandler)
	fmt.Printf("\n== cluster scale simulation: %d nodes, %d sandboxes, %d churn ops, %d nodes stopped, TTL %v, 3-member etcd ==\n",
		nNodes, nSbx, nChurn, nStop, ttl)

	// A few shared clients, as a fleet would have one each: enough connections to spread load.
	var clients []*clientv3.Client
	for i := 0; i < 8; i++ {
		c, err := clientv3.New(clientv3.Config{Endpoints: e.Endpoints(), DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
		if err != nil {
			b.Fatal(err)
		}
		defer c.Close()
		clients = append(clients, c)
	}
	start := time.Now()
	nodes := make([]*simNode, nNodes)
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	for i := range nodes {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			l := &simLocal{sbxs: map[string]cluster.LocalSandbox{}}
			cl, err := cluster.New(ctx, cluster.Config{Client: clients[i%len(clients)], Prefix: "/sim/", NodeID: fmt.Sprintf("n%03d", i),
				URL: "http://sim", TTL: ttl, Local: l, Logger: logger, SyncInterval: 2 * time.Second,
				Capacity: cluster.Capacity{CPU: 64, MemoryMB: int64(slots) * 256, Slots: slots, DiskFreeMB: 1 << 20}})
			if err != nil {
				b.Error(err)
				return
			}
			nodes[i] = &simNode{id: fmt.Sprintf("n%03d", i), cl: cl, local: l}
		}()
	}
	wg.Wait()
	if b.Failed() {
		return
	}
	defer func() {
		for _, n := range nodes {
			n.cl.Close() // idempotent
		}
	}()
	byID := map[string]*simNode{}
	for _, n := range nodes {
		byID[n.id] = n
	}
	for _, n := range nodes {
		for len(n.cl.Live()) < nNodes {
			time.Sleep(50 * time.Millisecond)
		}
	}
	fmt.Printf("%d nodes joined in %v\n", nNodes, time.Since(start).Round(time.Millisecond))

	var (
		mu          sync.Mutex
		place, lag  dist
		ids         []string
		where       = map[string]*simNode{}
		seq         atomic.Int64
		refused     atomic.Int64
		unavailable atomic.Int64
		filling     atomic.Bool
	)
	// create places one sandbox through a random edge and starts it on its node.
	create := func(r *rand.Rand) {
		edge := nodes[r.IntN(len(nodes))]
		t0 := time.Now()
		resv, err := edge.cl.Place(ctx, cluster.PlaceRequest{TemplateID: "base"})
		d := time.Since(t0)
		if err != nil {
			switch {
			case errors.Is(err, errdefs.ErrExhausted):
				if refused.Add(1) <= 3 {
					fmt.Printf("  refused: %v (after %d sandboxes)\n", err, seq.Load())
				}
			case errors.Is(err, errdefs.ErrUnavailable):
				unavailable.Add(1) // a fenced edge, or placement contention past its bound: the client retries
			default:
				b.Error(err)
			}
			return
		}
		owner := byID[resv.Node]
		s := cluster.LocalSandbox{ID: fmt.Sprintf("s%07d", seq.Add(1)), TemplateID: "base", Running: true, CPU: 1, MemoryMB: 256}
		owner.local.set(s)
		if err := owner.cl.Claim(ctx, s, resv.ID); err != nil {
			// The owner fenced between the reservation and the start: never run it.
			owner.local.Kill(ctx, s.ID)
			edge.cl.Cancel(ctx, resv)
			unavailable.Add(1)
			return
		}
		// How long another edge's cache takes to route the new sandbox (sampled).
		var l time.Duration
		sample := r.IntN(20) == 0
		if sample {
			other := nodes[r.IntN(len(nodes))]
			t1 := time.Now()
			for {
				if loc, _ := other.cl.Locate(ctx, s.ID, false); loc.Node == owner.id {
					break
				}
				time.Sleep(200 * time.Microsecond)
			}
			l = time.Since(t1)
		}
		mu.Lock()
		if filling.Load() && len(ids)%5000 == 4999 {
			fmt.Printf("  %d sandboxes, %v\n", len(ids)+1, time.Since(start).Round(time.Second))
		}
		place = append(place, d)
		if sample {
			lag = append(lag, l)
		}
		ids = append(ids, s.ID)
		where[s.ID] = owner
		mu.Unlock()
	}
	const workers = 32
	run := func(n int, op func(r *rand.Rand)) {
		var next atomic.Int64
		var wg sync.WaitGroup
		for w := 0; w < workers; w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r := rand.New(rand.NewPCG(uint64(w), uint64(time.Now().UnixNano())))
				for next.Add(1) <= int64(n) && !b.Failed() {
					op(r)
				}
			}()
		}
		wg.Wait()
	}
	start = time.Now()
	filling.Store(true)
	run(nSbx, create)
	filling.Store(false)
	fill := time.Since(start)
	fmt.Printf("filled %d sandboxes in %v (%.0f creates/s, %d refused for room, %d unavailable: a fenced node, or 10 s of lost races)\n", len(ids), fill.Round(time.Millisecond), float64(len(ids))/fill.Seconds(), refused.Load(), unavailable.Load())
	report(b, "placement (fill)", place)
	report(b, "routing cache lag (fill, sampled)", lag)

	// Churn: kills, pauses, resumes and creates, keeping the population steady.
	place, lag = nil, nil
	var kills, pauses, resumes, creates atomic.Int64
	start = time.Now()
	run(nChurn, func(r *rand.Rand) {
		switch r.IntN(4) {
		case 0:
			create(r)
			creates.Add(1)
			return
		}
		mu.Lock()
		if len(ids) == 0 {
			mu.Unlock()
			return
		}
		i := r.IntN(len(ids))
		id := ids[i]
		owner := where[id]
		mu.Unlock()
		owner.local.mu.Lock()
		s, ok := owner.local.sbxs[id]
		owner.local.mu.Unlock()
		if !ok {
			return
		}
		switch r.IntN(3) {
		case 0:
			owner.local.Kill(ctx, id)
			owner.cl.Release(ctx, id)
			mu.Lock()
			if i < len(ids) && ids[i] == id {
				ids[i] = ids[len(ids)-1]
				ids = ids[:len(ids)-1]
			}
			delete(where, id)
			mu.Unlock()
			kills.Add(1)
		case 1:
			s.Running = false
			owner.local.set(s)
			pauses.Add(1)
		case 2:
			s.Running = true
			owner.local.set(s)
			if err := owner.cl.Claim(ctx, s, ""); err != nil {
				owner.local.Kill(ctx, id)
				unavailable.Add(1)
			}
			resumes.Add(1)
		}
	})
	churn := time.Since(start)
	fmt.Printf("churn: %d ops in %v (%d creates, %d kills, %d pauses, %d resumes)\n", nChurn, churn.Round(time.Millisecond),
		creates.Load(), kills.Load(), pauses.Load(), resumes.Load())
	report(b, "placement (churn)", place)
	report(b, "routing cache lag (churn, sampled)", lag)

	obs, err := cluster.New(ctx, cluster.Config{Client: clients[0], Prefix: "/sim/", NodeID: "obs", URL: "http://sim", TTL: ttl,
		Local: &simLocal{sbxs: map[string]cluster.LocalSandbox{}}, Logger: logger, SyncInterval: time.Hour})
	if err != nil {
		b.Fatal(err)
	}
	defer obs.Close()
	// One edge's memory: a new member's caches of every node and route (the simulated nodes
	// are idle now).
	// Two edges in turn: the second one's growth leaves out what the first paid once (client
	// buffers, the initial read).
	var edges []*cluster.Cluster
	var heap []uint64
	for i := 0; i < 3; i++ {
		if i > 0 {
			edge, err := cluster.New(ctx, cluster.Config{Client: clients[i], Prefix: "/sim/", NodeID: fmt.Sprintf("edge%d", i), URL: "http://sim", TTL: ttl,
				Local: &simLocal{sbxs: map[string]cluster.LocalSandbox{}}, Logger: logger, SyncInterval: time.Hour})
			if err != nil {
				b.Fatal(err)
			}
			edges = append(edges, edge)
		}
		time.Sleep(time.Second)
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		heap = append(heap, m.HeapAlloc)
	}
	fmt.Printf("edge memory: %.1f MiB of heap for one edge's caches of %d routes and %d nodes (the first edge: %.1f MiB)\n",
		float64(int64(heap[2])-int64(heap[1]))/(1<<20), edges[1].Routes(), len(edges[1].Live()), float64(int64(heap[1])-int64(heap[0]))/(1<<20))
	for _, e := range edges {
		_ = e.Leave(ctx) // gone at once: not counted as a stopped node below
		e.Close()
	}
	// Stop nodes (no goodbye: their leases run out) and time their sandboxes marked lost.
	victims := nodes[:nStop]
	routedTo := func() int {
		n := 0
		for _, v := range victims {
			n += obs.Routed(v.id)
		}
		return n
	}
	var victimIDs []string
	for _, v := range victims {
		v.local.mu.Lock()
		for id := range v.local.sbxs {
			victimIDs = append(victimIDs, id)
		}
		v.local.mu.Unlock()
	}
	time.Sleep(3 * time.Second) // the last routes settle in the observer's cache
	before := routedTo()
	start = time.Now()
	for _, n := range victims {
		n.cl.Close()
	}
	// Marked lost = their routes replaced by lost records (one transaction), as an edge sees it.
	deadline := start.Add(ttl + 60*time.Second)
	var gone time.Duration
	for routedTo() > 0 && time.Now().Before(deadline) {
		if gone == 0 && len(obs.Live()) <= nNodes+1-nStop {
			gone = time.Since(start) // every stopped node's record expired, as the edge sees it
		}
		time.Sleep(20 * time.Millisecond)
	}
	marked := time.Since(start)
	if gone == 0 {
		gone = marked
	}
	fmt.Printf("  the stopped nodes' leases expired (as an edge saw it) %v after the stop\n", gone.Round(time.Millisecond))
	lostRecs := 0
	for _, id := range victimIDs {
		if l, err := obs.Lost(ctx, id); err == nil && l != nil {
			lostRecs++
		}
	}
	fmt.Printf("%d nodes stopped holding %d routed sandboxes: all marked lost %v after the stop (TTL %v); %d of %d have a lost record; %d still routed\n",
		nStop, before, marked.Round(time.Millisecond), ttl, lostRecs, len(victimIDs), routedTo())
	if routedTo() > 0 {
		b.Errorf("%d sandboxes still routed to stopped nodes", routedTo())
	}

	for i, ep := range e.Endpoints() {
		st, err := clients[0].Status(ctx, ep)
		if err == nil {
			fmt.Printf("etcd member %d: db %.1f MiB (in use %.1f MiB), revision %d\n", i, float64(st.DbSize)/(1<<20), float64(st.DbSizeInUse)/(1<<20), st.Header.Revision)
		}
	}
	var retries, fences int64
	for _, x := range nodes {
		retries += x.cl.PlacementRetries()
		fences += x.cl.Fences()
	}
	fmt.Printf("placement retries (lost races) over all edges: %d; nodes fenced (missed renewals under load): %d\n", retries, fences)
}
