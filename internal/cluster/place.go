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
	if r := cl.route(s.ID); r != nil && (r.Node != self || r.Epoch != epoch) {
		return fmt.Errorf("sandbox %q is held by node %s: %w", s.ID, r.Node, errdefs.ErrConflict)
	}
	b, _ := json.Marshal(Route{Node: self, Epoch: epoch, TemplateID: s.TemplateID, CPU: s.CPU, MemoryMB: s.MemoryMB, Since: time.Now().UTC()})
	// Running here now: a pause image stored earlier is stale (moves.go).
	ops := []clientv3.Op{clientv3.OpPut(cl.key("sandboxes", s.ID), string(b)), clientv3.OpDelete(cl.key("stored", s.ID))}
	if rid != "" {
		ops = append(ops, clientv3.OpDelete(cl.key("resv", self, rid)))
	}
	cl.noteClaimed(rid, 1) // placement.go
	resp, err := cl.c.Txn(ctx).If(
		clientv3.Compare(clientv3.Version(cl.key("lost", s.ID)), "=", 0),
		clientv3.Compare(clientv3.LeaseValue(cl.key("nodes", self)), "=", epoch),
	).Then(ops...).Commit()
	if err != nil {
		cl.noteClaimed(rid, -1)
		return fmt.Errorf("etcd: claim: %w", errdefs.ErrUnavailable)
	}
	if !resp.Succeeded {
		cl.noteClaimed(rid, -1)
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
