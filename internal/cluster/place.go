package cluster

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// HasReservation reports whether reservation id holds room on this node.
func (cl *Cluster) HasReservation(ctx context.Context, id string) bool {
	ctx, done := cl.opCtx(ctx, cl.cfg.OpTimeout)
	defer done()
	id, _, _ = strings.Cut(id, ".") // a unit of a block (placement.go)
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
	r := cl.route(s.ID)
	if r != nil && (r.Node != self || r.Epoch != epoch) {
		return fmt.Errorf("sandbox %q is held by node %s: %w", s.ID, r.Node, errdefs.ErrConflict)
	}
	rt := Route{Node: self, Team: s.Team, Epoch: epoch, TemplateID: s.TemplateID, CPU: s.CPU, MemoryMB: s.MemoryMB, Since: time.Now().UTC(), Volumes: s.Volumes}
	b, _ := json.Marshal(rt)
	rk := cl.key("sandboxes", s.ID)
	// Running here now: a pause image stored earlier is stale (moves.go).
	ops := []clientv3.Op{clientv3.OpPut(rk, string(b)), clientv3.OpDelete(cl.key("stored", s.ID))}
	if rid != "" {
		ops = append(ops, clientv3.OpDelete(cl.key("resv", self, rid)))
	}
	cl.noteClaimed(rid, 1) // placement.go: counted before the transaction, undone on failure
	// The route is this node's as last seen, or there is none: one written meanwhile (by
	// another node adopting it) is never overwritten.
	var prev int64
	if r != nil {
		prev = r.modRev
	}
	for attempt := 0; ; attempt++ {
		resp, err := cl.c.Txn(ctx).If(
			clientv3.Compare(clientv3.Version(cl.key("lost", s.ID)), "=", 0),
			clientv3.Compare(clientv3.LeaseValue(cl.key("nodes", self)), "=", epoch),
			clientv3.Compare(clientv3.ModRevision(rk), "=", prev),
		).Then(ops...).Else(clientv3.OpGet(rk)).Commit()
		if err != nil {
			cl.noteClaimed(rid, -1)
			return fmt.Errorf("etcd: claim: %w", errdefs.ErrUnavailable)
		}
		if resp.Succeeded {
			rt.modRev = resp.Header.Revision
			cl.setRoute(s.ID, &rt)
			return nil
		}
		kvs := resp.Responses[0].GetResponseRange().Kvs
		var cur Route
		if len(kvs) == 0 || json.Unmarshal(kvs[0].Value, &cur) != nil || cur.Node != self || cur.Epoch != epoch || attempt == 2 {
			if len(kvs) > 0 && cur.Node != "" {
				cur.modRev = kvs[0].ModRevision
				cl.setRoute(s.ID, &cur)
				if cur.Node != self || cur.Epoch != epoch {
					cl.noteClaimed(rid, -1)
					return fmt.Errorf("sandbox %q is held by node %s: %w", s.ID, cur.Node, errdefs.ErrConflict)
				}
			}
			cl.noteClaimed(rid, -1)
			return fmt.Errorf("sandbox %q was lost with its node or this node's epoch ended: %w", s.ID, errdefs.ErrConflict)
		}
		cur.modRev = kvs[0].ModRevision
		if r == nil {
			// Routed here already (a reconcile that listed the sandbox before its claim was
			// cached): kept as it is, never overwritten (it may be stored since).
			cl.setRoute(s.ID, &cur)
			return nil
		}
		prev = cur.modRev // this node's, written again since it was cached
	}
}

// Release drops the route of a sandbox this node ended.
func (cl *Cluster) Release(ctx context.Context, id string) {
	ctx, done := cl.opCtx(ctx, cl.cfg.OpTimeout)
	defer done()
	if r := cl.route(id); r != nil && r.Node == cl.cfg.NodeID {
		cl.dropOwnRoute(ctx, id, r.modRev, cl.key("stored", id))
	}
	cl.kickSync()
}

// dropOwnRoute deletes the route of sandbox id (and keys) if it is still this node's as of
// modRev (read again once if it changed).
func (cl *Cluster) dropOwnRoute(ctx context.Context, id string, modRev int64, keys ...string) {
	rk := cl.key("sandboxes", id)
	for attempt := 0; attempt < 2; attempt++ {
		ops := []clientv3.Op{clientv3.OpDelete(rk)}
		for _, k := range keys {
			ops = append(ops, clientv3.OpDelete(k))
		}
		t, err := cl.c.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(rk), "=", modRev)).Then(ops...).Commit()
		if err != nil {
			return
		}
		if t.Succeeded {
			cl.setRoute(id, nil)
			return
		}
		r, err := cl.freshRoute(ctx, id)
		if err != nil {
			return
		}
		if r == nil || r.Node != cl.cfg.NodeID {
			cl.setRoute(id, r) // gone, or another node's now
			return
		}
		modRev = r.modRev
	}
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
	// Team owns the sandbox (from its route or lost record; "" : the default team).
	Team string
}

// Known reports whether the cluster knows the sandbox.
func (l Location) Known() bool { return l.Node != "" || l.Lost != nil }

// Locate says where sandbox id is: from this node's cache (its own routes, and those of
// other nodes' sandboxes it looked up), else (a miss, a route to a gone node) or with fresh
// (a node answered "not here") from one etcd read, which it caches. A route whose node is gone (its lease
// expired, or it came back under another) is lost, unless the sandbox is stored (moves.go):
// no record has to be written for that, so a node's sandboxes are lost the moment its lease
// ends, however many it held.
func (cl *Cluster) Locate(ctx context.Context, id string, fresh bool) (Location, error) {
	var r *Route
	if !fresh {
		// A miss is read; so is a cached route to a node that is gone (it may have been
		// stored or moved since), and a stored sandbox of this node while another may adopt
		// it (moves.go).
		if r = cl.route(id); r == nil || r.Node != cl.cfg.NodeID && cl.gone(r) || r.Node == cl.cfg.NodeID && r.Stored && cl.adoptable() {
			fresh = true
		}
	}
	if fresh {
		resp, err := cl.readRoute(ctx, id)
		if err != nil {
			return Location{}, err
		}
		r = nil
		if kvs := resp.Responses[0].GetResponseRange().Kvs; len(kvs) > 0 {
			r = &Route{}
			_ = json.Unmarshal(kvs[0].Value, r)
			r.modRev = kvs[0].ModRevision
			cl.setRoute(id, r)
		} else if kvs := resp.Responses[1].GetResponseRange().Kvs; len(kvs) > 0 {
			cl.setRoute(id, nil)
			var l Lost
			_ = json.Unmarshal(kvs[0].Value, &l)
			return Location{Lost: &l, Team: l.Team}, nil
		} else {
			cl.setRoute(id, nil)
		}
	}
	if r == nil {
		return Location{}, nil
	}
	loc := Location{Node: r.Node, Local: r.Node == cl.cfg.NodeID && r.Epoch == cl.epoch.Load(), Stored: r.Stored, TemplateID: r.TemplateID, Team: r.Team}
	if n := cl.node(r.Node); n != nil && n.Epoch == r.Epoch {
		loc.URL = n.URL
	} else if !loc.Local {
		loc.Dead = true
		if !r.Stored {
			loc.Lost = cl.lostOf(r)
		}
	}
	return loc, nil
}

// readRoute reads sandbox id's route and lost record. Without a quorum (or when the
// linearizable read fails) it reads them from the member it reaches (a serializable read,
// which needs no leader): the sandbox plane goes on through any edge while etcd has no
// leader, as it did when every edge cached every route.
func (cl *Cluster) readRoute(ctx context.Context, id string) (*clientv3.TxnResponse, error) {
	ops := func(o ...clientv3.OpOption) []clientv3.Op {
		return []clientv3.Op{clientv3.OpGet(cl.key("sandboxes", id), o...), clientv3.OpGet(cl.key("lost", id), o...)}
	}
	if cl.Available() == nil {
		octx, done := cl.opCtx(ctx, cl.cfg.OpTimeout)
		resp, err := cl.c.Txn(octx).Then(ops()...).Commit()
		done()
		if err == nil {
			return resp, nil
		}
	}
	sctx, done := context.WithTimeout(ctx, cl.cfg.ProbeTimeout)
	defer done()
	resp, err := cl.c.Txn(sctx).Then(ops(clientv3.WithSerializable())...).Commit()
	if err != nil {
		return nil, fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	return resp, nil
}

// lostOf is the loss of route r, whose node is gone.
func (cl *Cluster) lostOf(r *Route) *Lost {
	cl.mu.RLock()
	at, ok := cl.down[r.Node]
	cl.mu.RUnlock()
	if !ok {
		at = time.Now()
	}
	reason := "its node stopped answering"
	if r.Node == cl.cfg.NodeID || cl.node(r.Node) != nil {
		reason = "the node restarted"
	}
	return &Lost{Node: r.Node, At: at.UTC(), Reason: reason, TemplateID: r.TemplateID, CPU: r.CPU, MemoryMB: r.MemoryMB, Since: r.Since}
}

// Lost returns the record of a sandbox lost with its node, or nil.
func (cl *Cluster) Lost(ctx context.Context, id string) (*Lost, error) {
	loc, err := cl.Locate(ctx, id, true)
	if err != nil {
		return nil, err
	}
	return loc.Lost, nil
}

// Routed counts the sandboxes routed to node in this node's cache (all of them for this
// node; for another, those this node looked up).
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

// scanRoutes calls fn for every route in etcd (paged range reads: for listings and the
// reaping of a dead node, never on a sandbox's operation).
func (cl *Cluster) scanRoutes(ctx context.Context, fn func(id string, r *Route)) error {
	pfx := cl.key("sandboxes") + "/"
	from, end := pfx, clientv3.GetPrefixRangeEnd(pfx)
	for {
		resp, err := cl.c.Get(ctx, from, clientv3.WithRange(end), clientv3.WithLimit(1000))
		if err != nil {
			return fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
		}
		for _, kv := range resp.Kvs {
			var r Route
			if json.Unmarshal(kv.Value, &r) == nil {
				r.modRev = kv.ModRevision
				fn(strings.TrimPrefix(string(kv.Key), pfx), &r)
			}
		}
		if !resp.More || len(resp.Kvs) == 0 {
			return nil
		}
		from = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
}

// Nodes lists the live nodes and those found dead lately from this node's caches: the
// sandboxes it shows are the ones this node knows of (all of its own, those of other nodes
// it looked up). ListNodes reads them all.
func (cl *Cluster) Nodes() []NodeView {
	cl.mu.RLock()
	held := map[string][]string{}
	for node, ids := range cl.byNode {
		for id := range ids {
			held[node] = append(held[node], id)
		}
	}
	cl.mu.RUnlock()
	return cl.nodeViews(held)
}

// Node returns one node's view from this node's caches (Nodes).
func (cl *Cluster) Node(id string) (NodeView, error) {
	return findNode(cl.Nodes(), id)
}

// ListNodes lists the live nodes and those found dead lately, with every sandbox routed to
// each (one paged read of the routes) and their leases (one read per live node).
func (cl *Cluster) ListNodes(ctx context.Context) ([]NodeView, error) {
	ctx, done := cl.opCtx(ctx, cl.cfg.OpTimeout)
	defer done()
	held := map[string][]string{}
	if err := cl.scanRoutes(ctx, func(id string, r *Route) {
		if n := cl.node(r.Node); n == nil || n.Epoch == r.Epoch {
			held[r.Node] = append(held[r.Node], id)
		}
	}); err != nil {
		return nil, err
	}
	out := cl.nodeViews(held)
	for i := range out {
		if v := &out[i]; v.epoch != 0 {
			if ttl, err := cl.c.TimeToLive(ctx, clientv3.LeaseID(v.epoch)); err == nil && ttl.TTL >= 0 {
				v.LeaseTTL = float64(ttl.GrantedTTL)
				v.LeaseAge = float64(ttl.GrantedTTL - ttl.TTL)
			}
		}
	}
	return out, nil
}

// GetNode returns one node's view, read as ListNodes does.
func (cl *Cluster) GetNode(ctx context.Context, id string) (NodeView, error) {
	vs, err := cl.ListNodes(ctx)
	if err != nil {
		return NodeView{}, err
	}
	return findNode(vs, id)
}

func findNode(vs []NodeView, id string) (NodeView, error) {
	for _, v := range vs {
		if v.ID == id {
			return v, nil
		}
	}
	return NodeView{}, fmt.Errorf("node %q: %w", id, errdefs.ErrNotFound)
}

// nodeViews builds the views of the nodes, held giving the sandboxes routed to each (those of
// an epoch of a node other than its current one are not its any more).
func (cl *Cluster) nodeViews(held map[string][]string) []NodeView {
	cl.mu.RLock()
	defer cl.mu.RUnlock()
	var out []NodeView
	for id, n := range cl.nodes {
		v := NodeView{ID: id, State: StateActive, URL: n.URL, Capacity: n.Capacity, Allocated: cl.allocs[id].a,
			Runsc: n.Runsc, CPUClass: n.CPUClass, Since: n.Started, epoch: n.Epoch}
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
		if v.State != StateLost {
			v.Sandboxes = append(v.Sandboxes, held[v.ID]...)
		}
		sort.Strings(v.Sandboxes)
		v.Routes = len(v.Sandboxes)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// Draining reports whether node id is drained (from the watched cache).
func (cl *Cluster) Draining(id string) bool { return cl.draining(id) }

// known reports whether node id is live or was found dead lately.
func (cl *Cluster) known(id string) bool {
	cl.mu.RLock()
	defer cl.mu.RUnlock()
	_, live := cl.nodes[id]
	_, down := cl.down[id]
	return live || down
}

// Drain stops (on) or resumes (off) new placements on node id.
func (cl *Cluster) Drain(ctx context.Context, id string, on bool) error {
	ctx, done := cl.opCtx(ctx, cl.cfg.OpTimeout)
	defer done()
	if !cl.known(id) {
		return fmt.Errorf("node %q: %w", id, errdefs.ErrNotFound)
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
