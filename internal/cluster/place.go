package cluster

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	mrand "math/rand/v2"
	"slices"
	"sort"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

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
// the edge if the edge dies.
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

// Place reserves room for a sandbox of req.TemplateID on the live, undrained, compatible
// node with the most room that has the template, atomically: the reservation transaction
// compares the node's allocation revision, so concurrent edges never overcommit it. Losing a
// race re-reads that node and tries again (counted in PlacementRetries).
func (cl *Cluster) Place(ctx context.Context, req PlaceRequest) (*Reservation, error) {
	ctx, done := cl.opCtx(ctx, maxPlaceTime+cl.cfg.OpTimeout)
	defer done()
	edge := cl.epoch.Load()
	if edge == 0 {
		return nil, fmt.Errorf("this node is cut off from the cluster: %w", errdefs.ErrUnavailable)
	}
	if len(req.Exclude) > 0 {
		cl.placementRetried() // a node refused this create
	}
	cands, haveTpl := cl.candidates(req)
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
	rid := newID()
	// Lost races are retried while some node has room, within a bound: running out of
	// candidates means no room; running out of time means contention, not a full cluster.
	until := time.Now().Add(maxPlaceTime)
	for attempt := 0; len(cands) > 0; attempt++ {
		if time.Now().After(until) {
			return nil, fmt.Errorf("placement kept losing races for %v: %w", maxPlaceTime, errdefs.ErrUnavailable)
		}
		// The roomier of two picked at random: edges placing at once spread over the nodes
		// instead of all racing for the single roomiest, and load still evens out.
		i := mrand.IntN(len(cands))
		if len(cands) > 1 {
			j := mrand.IntN(len(cands) - 1)
			if j >= i {
				j++
			}
			if cands[j].score > cands[i].score {
				i = j
			}
		}
		if attempt == 0 && req.Prefer != "" {
			i = preferred(cands, req.Prefer, i) // moves.go
		}
		c := cands[i]
		size := c.size
		next := c.alloc.add(size, 1)
		b, _ := json.Marshal(next)
		sb, _ := json.Marshal(resvRecord{TemplateSize: size, At: time.Now().UTC()})
		resp, err := cl.c.Txn(ctx).If(
			clientv3.Compare(clientv3.ModRevision(cl.key("alloc", c.n.ID)), "=", c.modRev),
			clientv3.Compare(clientv3.LeaseValue(cl.key("nodes", c.n.ID)), "=", c.n.Epoch),
			clientv3.Compare(clientv3.Version(cl.key("drain", c.n.ID)), "=", 0),
		).Then(
			clientv3.OpPut(cl.key("alloc", c.n.ID), string(b), clientv3.WithLease(clientv3.LeaseID(c.n.Epoch))),
			clientv3.OpPut(cl.key("resv", c.n.ID, rid), string(sb), clientv3.WithLease(clientv3.LeaseID(edge))),
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
		}
	}
	return nil, fmt.Errorf("no node could take a sandbox of template %q: %w", req.TemplateID, errdefs.ErrExhausted)
}

// resvRecord is the value of resv/<node>/<rid>.
type resvRecord struct {
	TemplateSize
	At time.Time `json:"at"`
}

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

func (cl *Cluster) candidates(req PlaceRequest) (out []candidate, haveTpl bool) {
	cl.mu.RLock()
	defer cl.mu.RUnlock()
	for id, n := range cl.nodes {
		size, ok := n.Templates[req.TemplateID]
		if !ok {
			// A template of the cluster's: the node loads it from the image store.
			if size, ok = cl.sharedSize(req.TemplateID); !ok {
				continue
			}
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
		out = append(out, candidate{n: n, alloc: ae.a, modRev: ae.modRev, size: size, score: room(n.Capacity, ae.a)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].score > out[j].score })
	return out, haveTpl
}

func (cl *Cluster) fits(n *NodeInfo, a Alloc, s TemplateSize) bool {
	c := n.Capacity
	return a.Slots+1 <= c.Slots && a.MemoryMB+int64(s.MemoryMB) <= c.MemoryMB && c.DiskFreeMB >= cl.cfg.MinDiskFreeMB
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

// Cancel gives a reservation's room back (the create failed or was refused).
func (cl *Cluster) Cancel(ctx context.Context, r *Reservation) {
	ctx, done := cl.opCtx(ctx, cl.cfg.OpTimeout)
	defer done()
	rk, ak := cl.key("resv", r.Node, r.ID), cl.key("alloc", r.Node)
	for attempt := 0; attempt < 8; attempt++ {
		resp, err := cl.c.Txn(ctx).Then(clientv3.OpGet(ak), clientv3.OpGet(rk)).Commit()
		if err != nil {
			return
		}
		ar, rr := resp.Responses[0].GetResponseRange(), resp.Responses[1].GetResponseRange()
		if len(rr.Kvs) == 0 {
			return // consumed, or gone with its lease
		}
		if len(ar.Kvs) == 0 {
			_, _ = cl.c.Delete(ctx, rk)
			return
		}
		var a Alloc
		_ = json.Unmarshal(ar.Kvs[0].Value, &a)
		b, _ := json.Marshal(a.add(r.Size, -1))
		t, err := cl.c.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(ak), "=", ar.Kvs[0].ModRevision)).
			Then(clientv3.OpPut(ak, string(b), clientv3.WithLease(clientv3.LeaseID(ar.Kvs[0].Lease))), clientv3.OpDelete(rk)).Commit()
		if err != nil || t.Succeeded {
			return
		}
	}
}

// HasReservation reports whether reservation id holds room on this node.
func (cl *Cluster) HasReservation(ctx context.Context, id string) bool {
	ctx, done := cl.opCtx(ctx, cl.cfg.OpTimeout)
	defer done()
	r, err := cl.c.Get(ctx, cl.key("resv", cl.cfg.NodeID, id), clientv3.WithCountOnly())
	return err == nil && r.Count > 0
}

// Claim records that this node holds sandbox s (made, resumed or forked here), consuming
// reservation rid if set. It fails for a sandbox the cluster marked lost, and while the node
// is fenced.
func (cl *Cluster) Claim(ctx context.Context, s LocalSandbox, rid string) error {
	ctx, done := cl.opCtx(ctx, cl.cfg.OpTimeout)
	defer done()
	err := cl.claim(ctx, s, rid)
	cl.kickSync()
	return err
}

func (cl *Cluster) claim(ctx context.Context, s LocalSandbox, rid string) error {
	epoch := cl.epoch.Load()
	if epoch == 0 {
		return fmt.Errorf("this node is cut off from the cluster: %w", errdefs.ErrUnavailable)
	}
	self := cl.cfg.NodeID
	if r := cl.route(s.ID); r != nil && (r.Node != self || r.Epoch != epoch) {
		return fmt.Errorf("sandbox %q is held by node %s: %w", s.ID, r.Node, errdefs.ErrConflict)
	}
	b, _ := json.Marshal(Route{Node: self, Epoch: epoch, TemplateID: s.TemplateID, CPU: s.CPU, MemoryMB: s.MemoryMB, Since: time.Now().UTC(), Volumes: s.Volumes})
	// Running here now: a pause image stored earlier is stale (moves.go).
	ops := []clientv3.Op{clientv3.OpPut(cl.key("sandboxes", s.ID), string(b)), clientv3.OpDelete(cl.key("stored", s.ID))}
	if rid != "" {
		ops = append(ops, clientv3.OpDelete(cl.key("resv", self, rid)))
	}
	resp, err := cl.c.Txn(ctx).If(
		clientv3.Compare(clientv3.Version(cl.key("lost", s.ID)), "=", 0),
		clientv3.Compare(clientv3.LeaseValue(cl.key("nodes", self)), "=", epoch),
	).Then(ops...).Commit()
	if err != nil {
		return fmt.Errorf("etcd: claim: %w", errdefs.ErrUnavailable)
	}
	if !resp.Succeeded {
		return fmt.Errorf("sandbox %q was lost with its node or this node's epoch ended: %w", s.ID, errdefs.ErrConflict)
	}
	// The caches see the route before the create answers: the next request, through any
	// edge that reads etcd, finds it.
	_ = cl.WaitRevision(ctx, resp.Header.Revision)
	return nil
}

// Release drops the route of a sandbox this node ended.
func (cl *Cluster) Release(ctx context.Context, id string) {
	ctx, done := cl.opCtx(ctx, cl.cfg.OpTimeout)
	defer done()
	if r := cl.route(id); r != nil && r.Node == cl.cfg.NodeID {
		_, _ = cl.c.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(cl.key("sandboxes", id)), "=", r.modRev)).
			Then(clientv3.OpDelete(cl.key("sandboxes", id)), clientv3.OpDelete(cl.key("stored", id))).Commit()
	}
	cl.kickSync()
}

// Location is where a sandbox is served.
type Location struct {
	Node  string
	URL   string
	Local bool
	// Lost is set when the sandbox died with its node; Dead when its node is gone but the
	// cluster has not marked it lost yet.
	Lost *Lost
	Dead bool
	// Stored: paused, its pause image in the store (any node may adopt it); TemplateID is its
	// template (moves.go).
	Stored     bool
	TemplateID string
}

// Known reports whether the cluster knows the sandbox.
func (l Location) Known() bool { return l.Node != "" || l.Lost != nil }

// Locate says where sandbox id is, from the watch-fed cache, or with fresh from one etcd read
// (for a miss, or a node that answered "not here").
func (cl *Cluster) Locate(ctx context.Context, id string, fresh bool) (Location, error) {
	var r *Route
	if !fresh {
		r = cl.route(id)
	} else {
		ctx, done := cl.opCtx(ctx, cl.cfg.OpTimeout)
		defer done()
		resp, err := cl.c.Txn(ctx).Then(clientv3.OpGet(cl.key("sandboxes", id)), clientv3.OpGet(cl.key("lost", id))).Commit()
		if err != nil {
			return Location{}, fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
		}
		if kvs := resp.Responses[0].GetResponseRange().Kvs; len(kvs) > 0 {
			r = &Route{}
			_ = json.Unmarshal(kvs[0].Value, r)
		} else if kvs := resp.Responses[1].GetResponseRange().Kvs; len(kvs) > 0 {
			var l Lost
			_ = json.Unmarshal(kvs[0].Value, &l)
			return Location{Lost: &l}, nil
		}
	}
	if r == nil {
		return Location{}, nil
	}
	loc := Location{Node: r.Node, Local: r.Node == cl.cfg.NodeID && r.Epoch == cl.epoch.Load(), Stored: r.Stored, TemplateID: r.TemplateID}
	if n := cl.node(r.Node); n != nil && n.Epoch == r.Epoch {
		loc.URL = n.URL
	} else if !loc.Local {
		loc.Dead = true
	}
	return loc, nil
}

// Lost returns the record of a sandbox lost with its node, or nil.
func (cl *Cluster) Lost(ctx context.Context, id string) (*Lost, error) {
	ctx, done := cl.opCtx(ctx, cl.cfg.OpTimeout)
	defer done()
	r, err := cl.c.Get(ctx, cl.key("lost", id))
	if err != nil {
		return nil, fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	if len(r.Kvs) == 0 {
		return nil, nil
	}
	var l Lost
	_ = json.Unmarshal(r.Kvs[0].Value, &l)
	return &l, nil
}

// Routed counts the sandboxes routed to node (in this node's cache).
func (cl *Cluster) Routed(node string) int {
	cl.mu.RLock()
	defer cl.mu.RUnlock()
	return len(cl.byNode[node])
}

// Routes counts the routes in this node's cache.
func (cl *Cluster) Routes() int {
	cl.mu.RLock()
	defer cl.mu.RUnlock()
	return len(cl.routes)
}

// Live returns the live nodes' records.
func (cl *Cluster) Live() []NodeInfo {
	cl.mu.RLock()
	defer cl.mu.RUnlock()
	out := make([]NodeInfo, 0, len(cl.nodes))
	for _, n := range cl.nodes {
		out = append(out, *n)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// Nodes lists the live nodes and those found dead lately.
func (cl *Cluster) Nodes() []NodeView {
	cl.mu.RLock()
	defer cl.mu.RUnlock()
	var out []NodeView
	for id, n := range cl.nodes {
		v := NodeView{ID: id, State: StateActive, URL: n.URL, Capacity: n.Capacity, Allocated: cl.allocs[id].a,
			Runsc: n.Runsc, CPUClass: n.CPUClass, Since: n.Started}
		if cl.drains[id] {
			v.State = StateDraining
		}
		if id == cl.cfg.NodeID && cl.fenced.Load() {
			v.State = StateFenced
		}
		for t := range n.Templates {
			v.Templates = append(v.Templates, t)
		}
		sort.Strings(v.Templates)
		out = append(out, v)
	}
	for id, at := range cl.down {
		if _, live := cl.nodes[id]; !live {
			out = append(out, NodeView{ID: id, State: StateLost, Since: at})
		}
	}
	for i := range out {
		v := &out[i]
		v.Sandboxes = []string{}
		for sid := range cl.byNode[v.ID] {
			if r := cl.routes[sid]; r != nil && v.State != StateLost {
				v.Sandboxes = append(v.Sandboxes, sid)
			}
		}
		sort.Strings(v.Sandboxes)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// Node returns one node's view.
func (cl *Cluster) Node(id string) (NodeView, error) {
	for _, v := range cl.Nodes() {
		if v.ID == id {
			return v, nil
		}
	}
	return NodeView{}, fmt.Errorf("node %q: %w", id, errdefs.ErrNotFound)
}

// Drain stops (on) or resumes (off) new placements on node id.
func (cl *Cluster) Drain(ctx context.Context, id string, on bool) error {
	ctx, done := cl.opCtx(ctx, cl.cfg.OpTimeout)
	defer done()
	if _, err := cl.Node(id); err != nil {
		return err
	}
	var rev int64
	if on {
		r, err := cl.c.Put(ctx, cl.key("drain", id), time.Now().UTC().Format(time.RFC3339))
		if err != nil {
			return fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
		}
		rev = r.Header.Revision
	} else {
		r, err := cl.c.Delete(ctx, cl.key("drain", id))
		if err != nil {
			return fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
		}
		rev = r.Header.Revision
	}
	// The answer (and this edge's next placement) sees the change.
	return cl.WaitRevision(ctx, rev)
}

func newID() string {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
