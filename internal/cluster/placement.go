package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	mrand "math/rand/v2"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// Placement hands out room in blocks. An edge reserves room on a node for several sandboxes at
// once (a block: one transaction that compares the node's allocation revision, as a single
// reservation did, so concurrent edges never overcommit the node) and places its next creates
// from the block without touching etcd; the node consumes the block's units as it claims the
// sandboxes (counted here, in memory), the edge gives back what it did not use once it goes idle,
// and the block goes with the edge's lease if the edge dies. Contention on a node's allocation
// key is then one transaction per block, not per create: the herd of edges racing for the same
// roomy node shrinks by the block size, and one edge's concurrent creates wait for its grant
// in flight instead of racing each other. A block is sized to the edge's recent demand
// (MaxBlockUnits at most, and never more than a quarter of the node's room, so that a nearly
// full node is shared one unit at a time, as before).

// PlaceRequest asks for room for one sandbox.
type PlaceRequest struct {
	TemplateID string
	// Exclude names nodes not to place on (they refused this create already).
	Exclude []string
	// Runsc and CPUClass, when set, restrict placement to nodes that can restore a checkpoint
	// made with them.
	Runsc, CPUClass string
	// Prefer names the node tried first when it is a candidate (a paused sandbox's own).
	Prefer string
	// Avoid names nodes placed on only when no other node has room (a fork's children spread
	// over the nodes: each child avoids the nodes its siblings went to).
	Avoid []string
}

// Reservation is room held on a node for one create, under the edge's lease: the node that
// creates the sandbox consumes it (Claim), the edge cancels it on failure, and it goes with
// the edge if the edge dies. Its ID is the block's ("<block>" for a block of one unit,
// "<block>.<n>" for unit n of a larger one).
type Reservation struct {
	ID   string
	Node string
	URL  string
	// Local: the node is this one.
	Local bool
	Size  TemplateSize
}

// maxPlaceTime bounds how long one placement retries lost races.
const maxPlaceTime = 10 * time.Second

// MaxBlockUnits bounds the sandboxes one block holds room for.
const MaxBlockUnits = 8

const (
	// blockDemandWindow: the edge's demand is measured over this long.
	blockDemandWindow = 4 * time.Second
	// blockIdle: a block unused for this long gives its free units back.
	blockIdle = 2 * time.Second
	// blockMaxAge: an edge stops drawing on a block this old (well within ReservationTTL,
	// after which the node drops it).
	blockMaxAge = 30 * time.Second
)

// Place reserves room for a sandbox of req.TemplateID on a live, undrained, compatible node
// that has the template: from a block this edge holds there, or from a new block, reserved
// atomically on the roomier of two candidates picked at random. Losing a race re-reads that
// node and tries again (counted in PlacementRetries).
func (cl *Cluster) Place(ctx context.Context, req PlaceRequest) (*Reservation, error) {
	ctx, done := cl.opCtx(ctx, maxPlaceTime+cl.cfg.OpTimeout)
	defer done()
	edge := cl.epoch.Load()
	if edge == 0 {
		return nil, fmt.Errorf("this node is cut off from the cluster: %w", errdefs.ErrUnavailable)
	}
	if len(req.Exclude) > 0 {
		cl.placementRetried() // a node refused this create
		cl.pool.forget(req.Exclude)
	}
	cl.pool.demand()
	for {
		if r := cl.takePooled(req); r != nil {
			return r, nil
		}
		// One grant at a time per edge: placements that arrive meanwhile wait for it and take
		// from its block instead of racing it for the same node.
		wait, mine := cl.pool.grantTurn()
		if !mine {
			select {
			case <-wait:
				continue
			case <-ctx.Done():
				return nil, fmt.Errorf("placement: %w", errdefs.ErrUnavailable)
			}
		}
		r, err := cl.grant(ctx, req, edge)
		cl.pool.grantDone()
		return r, err
	}
}

// grant reserves a new block and takes its first unit.
func (cl *Cluster) grant(ctx context.Context, req PlaceRequest, edge int64) (*Reservation, error) {
	cands, haveTpl := cl.candidates(req)
	build := false // no node has the template: nodes that build it (candidates)
	if len(cands) > 0 && cands[0].build {
		build = true
	}
	if len(cands) == 0 {
		if !haveTpl {
			return nil, fmt.Errorf("template %q: %w", req.TemplateID, errdefs.ErrNotFound)
		}
		return nil, fmt.Errorf("no node has room for a sandbox of template %q: %w", req.TemplateID, errdefs.ErrExhausted)
	}
	if len(req.Avoid) > 0 {
		if rest := slices.DeleteFunc(slices.Clone(cands), func(c candidate) bool { return slices.Contains(req.Avoid, c.n.ID) }); len(rest) > 0 {
			cands = rest
		}
	}
	want := cl.pool.wanted()
	bid := newID()
	// Lost races are retried while some node has room, within a bound: running out of
	// candidates means no room; running out of time means contention, not a full cluster.
	until := time.Now().Add(maxPlaceTime)
	retry := -1 // a node whose allocation the last lost race returned, tried again
	for attempt := 0; len(cands) > 0; attempt++ {
		if time.Now().After(until) {
			return nil, fmt.Errorf("placement kept losing races for %v: %w", maxPlaceTime, errdefs.ErrUnavailable)
		}
		i := retry
		if i < 0 {
			// The roomier of two picked at random (edges placing at once spread over the nodes
			// instead of all racing for the single roomiest, and load still evens out), as
			// etcd has them now: the cache may be behind (a node's reconcile rewrites its
			// allocation), and a reservation compared with a stale revision would only lose.
			pick := []int{mrand.IntN(len(cands))}
			if len(cands) > 1 {
				j := mrand.IntN(len(cands) - 1)
				if j >= pick[0] {
					j++
				}
				pick = append(pick, j)
			}
			if attempt == 0 && req.Prefer != "" {
				if p := preferred(cands, req.Prefer, -1); p >= 0 {
					pick = []int{p}
				}
			}
			if build {
				// Every edge picks the same node: the creates that arrive while it builds
				// join its one build instead of starting one on each node.
				pick = []int{0}
			}
			ops := make([]clientv3.Op, len(pick))
			for k, p := range pick {
				ops[k] = clientv3.OpGet(cl.key("alloc", cands[p].n.ID))
			}
			resp, err := cl.c.Txn(ctx).Then(ops...).Commit()
			if err != nil {
				if ctx.Err() == nil && attempt < 5 && sleep(ctx, 100*time.Millisecond*time.Duration(attempt+1)) {
					continue
				}
				return nil, fmt.Errorf("etcd: read allocations: %w", errdefs.ErrUnavailable)
			}
			i = -1
			var gone []int
			for k, p := range pick {
				kvs := resp.Responses[k].GetResponseRange().Kvs
				if len(kvs) == 0 || kvs[0].Lease != cands[p].n.Epoch {
					gone = append(gone, p)
					continue
				}
				var a Alloc
				_ = json.Unmarshal(kvs[0].Value, &a)
				cands[p].alloc, cands[p].modRev, cands[p].score = a, kvs[0].ModRevision, room(cands[p].n.Capacity, a)
				cl.noteAlloc(cands[p].n.ID, a, kvs[0].ModRevision)
				if !cl.fits(cands[p].n, a, cands[p].size) {
					gone = append(gone, p)
					continue
				}
				if i < 0 || cands[p].score > cands[i].score {
					i = p
				}
			}
			if i < 0 {
				slices.Sort(gone)
				for k := len(gone) - 1; k >= 0; k-- {
					cands = slices.Delete(cands, gone[k], gone[k]+1)
				}
				continue
			}
		}
		retry = -1
		c := cands[i]
		size := c.size
		// At most a quarter of the node's room in one block: a nearly full node is shared a
		// unit at a time.
		units := min(want, max(1, cl.units(c.n, c.alloc, size)/4))
		next := c.alloc.add(size, units)
		b, _ := json.Marshal(next)
		sb, _ := json.Marshal(resvRecord{TemplateSize: size, Units: units, At: time.Now().UTC()})
		resp, err := cl.c.Txn(ctx).If(
			clientv3.Compare(clientv3.ModRevision(cl.key("alloc", c.n.ID)), "=", c.modRev),
			clientv3.Compare(clientv3.LeaseValue(cl.key("nodes", c.n.ID)), "=", c.n.Epoch),
			clientv3.Compare(clientv3.Version(cl.key("drain", c.n.ID)), "=", 0),
		).Then(
			clientv3.OpPut(cl.key("alloc", c.n.ID), string(b), clientv3.WithLease(clientv3.LeaseID(c.n.Epoch))),
			clientv3.OpPut(cl.key("resv", c.n.ID, bid), string(sb), clientv3.WithLease(clientv3.LeaseID(edge))),
		).Else(
			clientv3.OpGet(cl.key("alloc", c.n.ID)),
			clientv3.OpGet(cl.key("drain", c.n.ID)),
		).Commit()
		if err != nil {
			// etcd does not retry writes: a member that just went away, or an election. The
			// reservation may have been made all the same; the owner drops it when it is stale.
			if ctx.Err() == nil && attempt < 5 && sleep(ctx, 100*time.Millisecond*time.Duration(attempt+1)) {
				continue
			}
			return nil, fmt.Errorf("etcd: reserve: %w", errdefs.ErrUnavailable)
		}
		if resp.Succeeded {
			// This edge's next placement sees its own reservation without waiting for the watch.
			cl.noteAlloc(c.n.ID, next, resp.Header.Revision)
			rid := bid
			if units > 1 {
				rid = bid + ".0"
				now := time.Now()
				cl.pool.add(&block{id: bid, node: c.n.ID, epoch: c.n.Epoch, url: c.n.URL, size: size,
					units: units, free: units - 1, next: 1, at: now, used: now})
			}
			return &Reservation{ID: rid, Node: c.n.ID, URL: c.n.URL, Local: c.n.ID == cl.cfg.NodeID, Size: size}, nil
		}
		cl.placementRetried()
		// A little jitter: edges that lost the same race do not meet again at once.
		sleep(ctx, time.Duration(mrand.Int64N(int64(time.Millisecond)*int64(min(attempt+1, 10)))))
		// Lost the race (or the node went, or was drained): that node as it is now.
		ar, dr := resp.Responses[0].GetResponseRange(), resp.Responses[1].GetResponseRange()
		if len(ar.Kvs) == 0 || len(dr.Kvs) > 0 || ar.Kvs[0].Lease != c.n.Epoch {
			cands = slices.Delete(cands, i, i+1)
			continue
		}
		var a Alloc
		_ = json.Unmarshal(ar.Kvs[0].Value, &a)
		cands[i].alloc, cands[i].modRev = a, ar.Kvs[0].ModRevision
		cl.noteAlloc(c.n.ID, a, ar.Kvs[0].ModRevision)
		if !cl.fits(c.n, a, size) {
			cands = slices.Delete(cands, i, i+1)
			continue
		}
		retry = i
	}
	return nil, fmt.Errorf("no node could take a sandbox of template %q: %w", req.TemplateID, errdefs.ErrExhausted)
}

// allocDue says whether the node's reconcile rewrites its allocation record from have to
// total: at once when it records less than the node holds, a lower figure at most once a
// reconcile interval (every rewrite makes the reservations being made there retry).
func (cl *Cluster) allocDue(have, total Alloc) bool {
	if have == total {
		return false
	}
	if total.Slots > have.Slots || total.MemoryMB > have.MemoryMB || total.CPU > have.CPU {
		return true
	}
	cl.pool.mu.Lock()
	defer cl.pool.mu.Unlock()
	if time.Since(cl.pool.lowered) < cl.cfg.SyncInterval {
		return false
	}
	cl.pool.lowered = time.Now()
	return true
}

// takePooled takes a unit from a block this edge holds on a node req may go to, or nil. A
// preferred node without a block here is reserved afresh; an avoided node's block is used only
// when no other node has room.
func (cl *Cluster) takePooled(req PlaceRequest) *Reservation {
	cl.pool.mu.Lock()
	defer cl.pool.mu.Unlock()
	if len(cl.pool.blocks) == 0 {
		return nil
	}
	now := time.Now()
	var best, avoided *block
	for _, b := range cl.pool.blocks {
		if b.free == 0 || now.Sub(b.at) > blockMaxAge || !cl.eligibleBlock(b, req) {
			continue
		}
		switch {
		case b.node == req.Prefer:
			best = b
		case slices.Contains(req.Avoid, b.node):
			avoided = b
			continue
		case best == nil || (best.node != req.Prefer && b.free > best.free):
			best = b
		}
	}
	if req.Prefer != "" && (best == nil || best.node != req.Prefer) && cl.node(req.Prefer) != nil {
		return nil // try the sandbox's own node first
	}
	if best == nil && avoided != nil {
		if cands, _ := cl.candidates(req); slices.ContainsFunc(cands, func(c candidate) bool { return !slices.Contains(req.Avoid, c.n.ID) }) {
			return nil // another node has room
		}
		best = avoided
	}
	if best == nil {
		return nil
	}
	best.free--
	best.used = now
	rid := best.id + "." + strconv.Itoa(best.next)
	best.next++
	if best.free == 0 {
		delete(cl.pool.blocks, best.id) // the node settles the rest
	}
	return &Reservation{ID: rid, Node: best.node, URL: best.url, Local: best.node == cl.cfg.NodeID, Size: best.size}
}

// eligibleBlock: b's node is as it was when the block was reserved, undrained, and may take
// req.
func (cl *Cluster) eligibleBlock(b *block, req PlaceRequest) bool {
	cl.mu.RLock()
	defer cl.mu.RUnlock()
	n := cl.nodes[b.node]
	if n == nil || n.Epoch != b.epoch || cl.drains[b.node] || slices.Contains(req.Exclude, b.node) ||
		(req.Runsc != "" && n.Runsc != req.Runsc) || (req.CPUClass != "" && n.CPUClass != req.CPUClass) {
		return false
	}
	size, ok := n.Templates[req.TemplateID]
	if !ok {
		size, ok = cl.sharedSize(req.TemplateID)
	}
	if !ok {
		// A node that builds it, while no node has it.
		size, ok = n.Builtins[req.TemplateID]
		ok = ok && !cl.anyHasLocked(req.TemplateID)
	}
	return ok && size == b.size
}

// anyHasLocked reports whether a node has template id (or the cluster does); the caller holds
// mu.
func (cl *Cluster) anyHasLocked(id string) bool {
	if _, ok := cl.sharedSize(id); ok {
		return true
	}
	for _, n := range cl.nodes {
		if _, ok := n.Templates[id]; ok {
			return true
		}
	}
	return false
}

// resvRecord is the value of resv/<node>/<block>.
type resvRecord struct {
	TemplateSize
	// Units is the sandboxes the block holds room for (0: one, a record of before blocks).
	Units int       `json:"units,omitempty"`
	At    time.Time `json:"at"`
}

func (r resvRecord) units() int { return max(r.Units, 1) }

// ReservationTTL bounds how long a reservation holds room: a create takes far less, and the
// owner drops older ones (an edge that lost its answer, or a write that failed ambiguously).
const ReservationTTL = 2 * time.Minute

// noteAlloc records an allocation read or written here, if newer than the cache's.
func (cl *Cluster) noteAlloc(node string, a Alloc, modRev int64) {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	if e, ok := cl.allocs[node]; ok && e.modRev < modRev {
		cl.allocs[node] = allocEntry{a: a, modRev: modRev}
	}
}

type candidate struct {
	n      *NodeInfo
	alloc  Alloc
	modRev int64
	size   TemplateSize
	score  float64
	build  bool // the node has not the template but builds it (a built-in: NodeInfo.Builtins)
}

// Room is how many sandboxes of templateID the live, undrained nodes have room for (slots
// and memory), as this node's view of the cluster has it: no etcd read. The edge's admission
// queue asks it for a create waiting in a full cluster.
func (cl *Cluster) Room(templateID string) int {
	cands, _ := cl.candidates(PlaceRequest{TemplateID: templateID})
	n := 0
	for _, c := range cands {
		free := c.n.Capacity.Slots - c.alloc.Slots
		if c.size.MemoryMB > 0 {
			free = min(free, int((c.n.Capacity.MemoryMB-c.alloc.MemoryMB)/int64(c.size.MemoryMB)))
		}
		n += max(free, 0)
	}
	return n
}

// candidates are the nodes with room for a sandbox of req.TemplateID, roomiest first; haveTpl
// says whether any node has (or, a built-in one, can build) the template. When no node has it
// and it is a built-in template, the nodes that build it, in the order of their ids (every
// edge then prefers the same one).
func (cl *Cluster) candidates(req PlaceRequest) (out []candidate, haveTpl bool) {
	cl.mu.RLock()
	defer cl.mu.RUnlock()
	out, haveTpl = cl.candidatesLocked(req, false)
	if !haveTpl {
		out, haveTpl = cl.candidatesLocked(req, true)
		sort.Slice(out, func(i, j int) bool { return out[i].n.ID < out[j].n.ID })
	}
	return out, haveTpl
}

// candidatesLocked: build = the nodes that build the template rather than the ones that have
// it. The caller holds mu.
func (cl *Cluster) candidatesLocked(req PlaceRequest, build bool) (out []candidate, haveTpl bool) {
	for id, n := range cl.nodes {
		size, ok := n.Templates[req.TemplateID]
		if build {
			size, ok = n.Builtins[req.TemplateID]
		} else if !ok {
			// A template of the cluster's: the node loads it from the image store.
			if size, ok = cl.sharedSize(req.TemplateID); !ok {
				continue
			}
		}
		if !ok {
			continue
		}
		haveTpl = true
		if cl.drains[id] || slices.Contains(req.Exclude, id) ||
			(req.Runsc != "" && n.Runsc != req.Runsc) || (req.CPUClass != "" && n.CPUClass != req.CPUClass) {
			continue
		}
		ae, ok := cl.allocs[id]
		if !ok || !cl.fits(n, ae.a, size) {
			continue
		}
		out = append(out, candidate{n: n, alloc: ae.a, modRev: ae.modRev, size: size, score: room(n.Capacity, ae.a), build: build})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].score > out[j].score })
	return out, haveTpl
}

func (cl *Cluster) fits(n *NodeInfo, a Alloc, s TemplateSize) bool {
	return cl.units(n, a, s) >= 1
}

// units is how many sandboxes of size s fit on n besides a.
func (cl *Cluster) units(n *NodeInfo, a Alloc, s TemplateSize) int {
	c := n.Capacity
	if c.DiskFreeMB < cl.cfg.MinDiskFreeMB {
		return 0
	}
	u := c.Slots - a.Slots
	if s.MemoryMB > 0 {
		u = min(u, int((c.MemoryMB-a.MemoryMB)/int64(s.MemoryMB)))
	} else if a.MemoryMB > c.MemoryMB {
		u = 0
	}
	return max(u, 0)
}

// room is the smaller free fraction of slots and memory (CPU is overcommitted, so it only
// breaks ties).
func room(c Capacity, a Alloc) float64 {
	f := 1.0
	if c.Slots > 0 {
		f = min(f, float64(c.Slots-a.Slots)/float64(c.Slots))
	}
	if c.MemoryMB > 0 {
		f = min(f, float64(c.MemoryMB-a.MemoryMB)/float64(c.MemoryMB))
	}
	if c.CPU > 0 {
		f += 0.001 * float64(c.CPU*4-a.CPU) / float64(c.CPU*4)
	}
	return f
}

// Cancel gives a reservation's room back (the create failed or was refused): to this edge's
// block while it holds it, else to the node (the block's record and the node's allocation
// lowered by one unit).
func (cl *Cluster) Cancel(ctx context.Context, r *Reservation) {
	bid, _, _ := strings.Cut(r.ID, ".")
	cl.pool.mu.Lock()
	if b := cl.pool.blocks[bid]; b != nil && b.node == r.Node {
		b.free++
		cl.pool.mu.Unlock()
		return
	}
	cl.pool.mu.Unlock()
	cl.shrink(ctx, r.Node, bid, 1)
}

// shrink gives n units of block bid on node back: the block's record and the node's
// allocation lowered in one transaction that compares both.
func (cl *Cluster) shrink(ctx context.Context, node, bid string, n int) {
	ctx, done := cl.opCtx(ctx, cl.cfg.OpTimeout)
	defer done()
	rk, ak := cl.key("resv", node, bid), cl.key("alloc", node)
	for attempt := 0; attempt < 8; attempt++ {
		resp, err := cl.c.Txn(ctx).Then(clientv3.OpGet(ak), clientv3.OpGet(rk)).Commit()
		if err != nil {
			return
		}
		ar, rr := resp.Responses[0].GetResponseRange(), resp.Responses[1].GetResponseRange()
		if len(rr.Kvs) == 0 {
			return // consumed, or gone with its lease
		}
		var rec resvRecord
		_ = json.Unmarshal(rr.Kvs[0].Value, &rec)
		give := min(n, rec.units())
		resvOp := clientv3.OpDelete(rk)
		if left := rec.units() - give; left > 0 {
			rec.Units = left
			b, _ := json.Marshal(rec)
			resvOp = clientv3.OpPut(rk, string(b), clientv3.WithLease(clientv3.LeaseID(rr.Kvs[0].Lease)))
		}
		cmps := []clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(rk), "=", rr.Kvs[0].ModRevision)}
		ops := []clientv3.Op{resvOp}
		if len(ar.Kvs) > 0 {
			var a Alloc
			_ = json.Unmarshal(ar.Kvs[0].Value, &a)
			b, _ := json.Marshal(a.add(rec.TemplateSize, -give))
			cmps = append(cmps, clientv3.Compare(clientv3.ModRevision(ak), "=", ar.Kvs[0].ModRevision))
			ops = append(ops, clientv3.OpPut(ak, string(b), clientv3.WithLease(clientv3.LeaseID(ar.Kvs[0].Lease))))
		}
		t, err := cl.c.Txn(ctx).If(cmps...).Then(ops...).Commit()
		if err != nil || t.Succeeded {
			return
		}
	}
}

// block is room this edge reserved on a node for several sandboxes.
type block struct {
	id, node, url string
	epoch         int64
	size          TemplateSize
	units, free   int // reserved; not handed out yet
	next          int // the next unit's number
	at, used      time.Time
}

// blockPool is an edge's blocks, and the node's count of the units it claimed.
type blockPool struct {
	mu       sync.Mutex
	blocks   map[string]*block
	granting chan struct{} // closed when the grant in flight ends; nil if none
	recent   []time.Time   // this edge's placements within blockDemandWindow
	claimed  map[string]*claimedUnits
	lowered  time.Time // this node's allocation was last lowered by its reconcile
}

type claimedUnits struct {
	n  int
	at time.Time
}

func (p *blockPool) add(b *block) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.blocks == nil {
		p.blocks = map[string]*block{}
	}
	p.blocks[b.id] = b
}

// demand notes one placement.
func (p *blockPool) demand() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.recent = noteDemand(p.recent, time.Now())
}

// noteDemand adds now to recent, the times of the last blockDemandWindow.
func noteDemand(recent []time.Time, now time.Time) []time.Time {
	i := 0
	for i < len(recent) && now.Sub(recent[i]) > blockDemandWindow {
		i++
	}
	return append(recent[i:], now)
}

// wanted is the size of the next block: the placements this edge is likely to make before
// the block goes idle, at its rate of the last window.
func (p *blockPool) wanted() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return min(MaxBlockUnits, max(1, len(p.recent)*int(blockIdle)/int(blockDemandWindow)))
}

// grantTurn returns mine=true if the caller may grant now (then call grantDone), else a
// channel closed when the grant in flight ends.
func (p *blockPool) grantTurn() (wait <-chan struct{}, mine bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.granting != nil {
		return p.granting, false
	}
	p.granting = make(chan struct{})
	return nil, true
}

func (p *blockPool) grantDone() {
	p.mu.Lock()
	defer p.mu.Unlock()
	close(p.granting)
	p.granting = nil
}

// forget marks the blocks on nodes that refused a create idle, to be given back.
func (p *blockPool) forget(nodes []string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, b := range p.blocks {
		if slices.Contains(nodes, b.node) {
			b.used = time.Time{}
		}
	}
}

// returnIdle gives back the free units of blocks unused for blockIdle, too old, or on a node
// gone or drained.
func (cl *Cluster) returnIdle(ctx context.Context) {
	now := time.Now()
	var back []*block
	cl.pool.mu.Lock()
	for id, b := range cl.pool.blocks {
		n := cl.node(b.node)
		if now.Sub(b.used) > blockIdle || now.Sub(b.at) > blockMaxAge || n == nil || n.Epoch != b.epoch || cl.drained(b.node) {
			delete(cl.pool.blocks, id)
			if b.free > 0 {
				back = append(back, b)
			}
		}
	}
	cl.pool.mu.Unlock()
	for _, b := range back {
		cl.shrink(ctx, b.node, b.id, b.free)
	}
}

func (cl *Cluster) drained(node string) bool {
	cl.mu.RLock()
	defer cl.mu.RUnlock()
	return cl.drains[node]
}

// placementLoop gives idle blocks back.
func (cl *Cluster) placementLoop(ctx context.Context) { every(ctx, blockIdle/4, cl.returnIdle) }

// every calls f every d until ctx ends.
func every(ctx context.Context, d time.Duration, f func(context.Context)) {
	t := time.NewTicker(d)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			f(ctx)
		}
	}
}

// noteClaimed counts reservation rid's unit consumed on this node by a claim (delta 1, before
// the claim's transaction: the sandbox is already in the node's list, so a reconcile in between
// does not count it twice, which would rewrite the allocation), or not after all (-1).
func (cl *Cluster) noteClaimed(rid string, delta int) {
	if rid == "" {
		return
	}
	bid, _, _ := strings.Cut(rid, ".")
	cl.pool.mu.Lock()
	defer cl.pool.mu.Unlock()
	if cl.pool.claimed == nil {
		cl.pool.claimed = map[string]*claimedUnits{}
	}
	c := cl.pool.claimed[bid]
	if c == nil {
		c = &claimedUnits{}
		cl.pool.claimed[bid] = c
	}
	c.n += delta
	c.at = time.Now()
}

// reservedHere sums the room the blocks on this node still hold (their units not claimed
// yet), given its resv/ records as read; it drops the records that are spent (every unit
// claimed) or stale (older than ReservationTTL), and forgets the counts of records gone.
func (cl *Cluster) reservedHere(ctx context.Context, kvs []*mvccpb.KeyValue) Alloc {
	prefix := cl.key("resv", cl.cfg.NodeID) + "/"
	cl.pool.mu.Lock()
	claimed := map[string]int{}
	for id, c := range cl.pool.claimed {
		claimed[id] = c.n
	}
	cl.pool.mu.Unlock()
	var total Alloc
	present := map[string]bool{}
	for _, kv := range kvs {
		id := strings.TrimPrefix(string(kv.Key), prefix)
		present[id] = true
		var r resvRecord
		if json.Unmarshal(kv.Value, &r) != nil {
			continue
		}
		left := r.units() - claimed[id]
		if left <= 0 || time.Since(r.At) > ReservationTTL {
			_, _ = cl.c.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(string(kv.Key)), "=", kv.ModRevision)).Then(clientv3.OpDelete(string(kv.Key))).Commit()
			continue
		}
		total = total.add(r.TemplateSize, left)
	}
	cl.pool.mu.Lock()
	for id, c := range cl.pool.claimed {
		// A claim may land before its block's record is read: counts are kept a while.
		if !present[id] && time.Since(c.at) > 10*time.Second {
			delete(cl.pool.claimed, id)
		}
	}
	cl.pool.mu.Unlock()
	return total
}
