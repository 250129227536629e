package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// Paused sandboxes that move between nodes. In cluster mode with a shared image store a
// memory pause stores the sandbox's pause image before it answers, then records it under
// stored/<sid> (no lease) and marks its route Stored, in one transaction. A stored sandbox is
// not lost with its node: when its node is gone (or drained), the edge that gets a request
// for it places it (preferring its node), and the chosen node adopts it (loads its layers and
// pause image from the store, verified, and takes the route over in a transaction that
// compares the route's revision, so two edges never adopt it twice) and serves the request.
// A resume makes it running: the route stops being Stored and stored/<sid> goes. A drained
// node pauses its running sandboxes, so that they too resume elsewhere.

// PausedPorter is what moving paused sandboxes needs of the node's Manager.
type PausedPorter interface {
	ImportPaused(ctx context.Context, p *sandbox.PortableSandbox) (*sandbox.Sandbox, error)
	List(ctx context.Context, f sandbox.ListFilter) ([]*sandbox.Sandbox, error)
	Pause(ctx context.Context, id string) error
	Kill(ctx context.Context, id string) error
	// DeleteStored removes an image nothing refers to any more from the image store.
	DeleteStored(ctx context.Context, imageID string)
}

// Moves moves this node's paused sandboxes through the image store.
type Moves struct {
	cl     *Cluster
	p      PausedPorter
	cancel context.CancelFunc
	done   chan struct{}
}

// NewMoves returns the moving of p's paused sandboxes over cl, and starts pausing p's running
// sandboxes whenever this node is drained.
func NewMoves(cl *Cluster, p PausedPorter) *Moves {
	ctx, cancel := context.WithCancel(context.Background())
	mv := &Moves{cl: cl, p: p, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(mv.done)
		mv.drainLoop(ctx)
	}()
	return mv
}

// Close stops the drain loop (before the Manager closes).
func (mv *Moves) Close() {
	mv.cancel()
	<-mv.done
}

// preferred returns the index of node among cands, else i.
func preferred(cands []candidate, node string, i int) int {
	for j, c := range cands {
		if c.n.ID == node {
			return j
		}
	}
	return i
}

// Stored records that sandbox p, paused on this node, is in the image store.
func (mv *Moves) Stored(ctx context.Context, p *sandbox.PortableSandbox) error {
	cl := mv.cl
	epoch := cl.epoch.Load()
	id := p.Sandbox.ID
	r := cl.route(id)
	if epoch == 0 || r == nil || r.Node != cl.cfg.NodeID || r.Epoch != epoch {
		return fmt.Errorf("sandbox %q is not this node's in the cluster: %w", id, errdefs.ErrConflict)
	}
	sv, err := cl.sealJSON(cl.key("stored", id), p) // its envd token and env vars (seal.go)
	if err != nil {
		return err
	}
	var resp *clientv3.TxnResponse
	for attempt := 0; ; attempt++ {
		nr := *r
		nr.Stored = true
		rb, _ := json.Marshal(nr)
		resp, err = cl.c.Txn(ctx).If(
			clientv3.Compare(clientv3.ModRevision(cl.key("sandboxes", id)), "=", r.modRev),
			clientv3.Compare(clientv3.LeaseValue(cl.key("nodes", cl.cfg.NodeID)), "=", epoch),
		).Then(clientv3.OpPut(cl.key("stored", id), sv, clientv3.WithPrevKV()), clientv3.OpPut(cl.key("sandboxes", id), string(rb))).Commit()
		if err != nil {
			return fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
		}
		if resp.Succeeded {
			break
		}
		// The route was written again since this node's cache saw it (this node's sync claims
		// what it runs too): read it afresh, and store the pause if it is still this node's.
		if r, err = cl.freshRoute(ctx, id); err != nil {
			return err
		}
		cl.setRoute(id, r)
		if attempt == 2 || r == nil || r.Node != cl.cfg.NodeID || r.Epoch != epoch {
			return fmt.Errorf("sandbox %q: its route changed: %w", id, errdefs.ErrConflict)
		}
	}
	{
		nr := *r
		nr.Stored, nr.modRev = true, resp.Header.Revision
		cl.setRoute(id, &nr)
	}
	// The image of an earlier pause that no resume consumed is nobody's now.
	if prev := resp.Responses[0].GetResponsePut().GetPrevKv(); prev != nil {
		var old sandbox.PortableSandbox
		if cl.openJSON(string(prev.Key), prev.Value, &old) == nil && old.ImageID != "" && old.ImageID != p.ImageID {
			mv.p.DeleteStored(context.WithoutCancel(ctx), old.ImageID)
		}
	}
	return nil
}

// freshRoute reads sandbox id's route from etcd (nil when it has none), not from the cache.
func (cl *Cluster) freshRoute(ctx context.Context, id string) (*Route, error) {
	resp, err := cl.c.Get(ctx, cl.key("sandboxes", id))
	if err != nil {
		return nil, fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	if len(resp.Kvs) == 0 {
		return nil, nil
	}
	var r Route
	if err := json.Unmarshal(resp.Kvs[0].Value, &r); err != nil {
		return nil, fmt.Errorf("route of %q: %w", id, err)
	}
	r.modRev = resp.Kvs[0].ModRevision
	return &r, nil
}

// Adopt makes stored sandbox id this node's: loaded from the image store, paused here, its
// route taken over. It fails (ErrConflict) when the sandbox is not stored or its node still
// serves it (alive and not drained).
func (mv *Moves) Adopt(ctx context.Context, id string) error {
	cl := mv.cl
	epoch := cl.epoch.Load()
	if epoch == 0 {
		return fmt.Errorf("this node is cut off from the cluster: %w", errdefs.ErrUnavailable)
	}
	self := cl.cfg.NodeID
	resp, err := cl.c.Txn(ctx).Then(clientv3.OpGet(cl.key("sandboxes", id)), clientv3.OpGet(cl.key("stored", id))).Commit()
	if err != nil {
		return fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	rk, sk := resp.Responses[0].GetResponseRange().Kvs, resp.Responses[1].GetResponseRange().Kvs
	if len(rk) == 0 {
		return fmt.Errorf("sandbox %q: %w", id, errdefs.ErrNotFound)
	}
	var r Route
	if err := json.Unmarshal(rk[0].Value, &r); err != nil {
		return fmt.Errorf("sandbox %q: bad route: %w", id, errdefs.ErrCorrupt)
	}
	if r.Node == self && r.Epoch == epoch {
		return nil // here already
	}
	if !r.Stored || len(sk) == 0 {
		return fmt.Errorf("sandbox %q is not stored: node %s holds it: %w", id, r.Node, errdefs.ErrConflict)
	}
	if n := cl.node(r.Node); n != nil && n.Epoch == r.Epoch && !cl.draining(r.Node) {
		return fmt.Errorf("sandbox %q: its node %s serves it: %w", id, r.Node, errdefs.ErrConflict)
	}
	var p sandbox.PortableSandbox
	if err := cl.openJSON(string(sk[0].Key), sk[0].Value, &p); err != nil || p.Sandbox.ID != id {
		return fmt.Errorf("sandbox %q: bad stored record: %w", id, errdefs.ErrCorrupt)
	}
	start := time.Now()
	cl.setAdopting(id, true)
	defer cl.setAdopting(id, false)
	if _, err := mv.p.ImportPaused(ctx, &p); err != nil {
		return err
	}
	from := r.Node
	r.Node, r.Epoch, r.Since = self, epoch, time.Now().UTC()
	b, _ := json.Marshal(r)
	t, err := cl.c.Txn(ctx).If(
		clientv3.Compare(clientv3.ModRevision(cl.key("sandboxes", id)), "=", rk[0].ModRevision),
		clientv3.Compare(clientv3.Version(cl.key("lost", id)), "=", 0),
		clientv3.Compare(clientv3.LeaseValue(cl.key("nodes", self)), "=", epoch),
	).Then(clientv3.OpPut(cl.key("sandboxes", id), string(b))).Commit()
	if err != nil || !t.Succeeded {
		// Another edge moved it first (or etcd did not answer): never hold what is not routed here.
		_ = mv.p.Kill(context.WithoutCancel(ctx), id)
		if err != nil {
			return fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
		}
		return fmt.Errorf("sandbox %q moved meanwhile: %w", id, errdefs.ErrConflict)
	}
	r.modRev = t.Header.Revision
	cl.setRoute(id, &r)
	cl.log.Info("cluster: adopted a stored paused sandbox", "sandbox_id", id, "from", from, "ms", time.Since(start).Milliseconds())
	return nil
}

// setAdopting marks sandbox id as being adopted here (on), or no longer (off).
func (cl *Cluster) setAdopting(id string, on bool) {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	if cl.adopting == nil {
		cl.adopting = map[string]bool{}
	}
	if on {
		cl.adopting[id] = true
	} else {
		delete(cl.adopting, id)
	}
}

func (cl *Cluster) draining(node string) bool {
	cl.mu.RLock()
	defer cl.mu.RUnlock()
	return cl.drains[node]
}

// drainLoop pauses this node's running sandboxes (into the image store) while it is drained.
func (mv *Moves) drainLoop(ctx context.Context) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if !mv.cl.draining(mv.cl.cfg.NodeID) || mv.cl.epoch.Load() == 0 {
			continue
		}
		sbxs, err := mv.p.List(ctx, sandbox.ListFilter{States: []sandbox.State{sandbox.StateRunning}})
		if err != nil {
			continue
		}
		for _, s := range sbxs {
			if s.State != sandbox.StateRunning || ctx.Err() != nil {
				continue
			}
			if err := mv.p.Pause(ctx, s.ID); err != nil {
				mv.cl.log.Warn("cluster: drain: pause", "sandbox_id", s.ID, "err", err)
				continue
			}
			mv.cl.log.Info("cluster: drain: paused into the image store", "sandbox_id", s.ID)
		}
	}
}

// StoredImage returns the store id of sandbox id's stored pause image, "" when its route
// (cached, or read on a miss) is not stored.
func (mv *Moves) StoredImage(ctx context.Context, id string) string {
	r := mv.cl.route(id)
	if r == nil {
		r, _ = mv.cl.freshRoute(ctx, id)
	}
	if r == nil || !r.Stored {
		return ""
	}
	resp, err := mv.cl.c.Get(ctx, mv.cl.key("stored", id))
	if err != nil || len(resp.Kvs) == 0 {
		return ""
	}
	var p sandbox.PortableSandbox
	if mv.cl.openJSON(string(resp.Kvs[0].Key), resp.Kvs[0].Value, &p) != nil {
		return ""
	}
	return p.ImageID
}

// gone reports whether the node of route r no longer serves it (its lease ran out, or it
// came back under a new lease, holding nothing).
func (cl *Cluster) gone(r *Route) bool {
	n := cl.node(r.Node)
	return n == nil || n.Epoch != r.Epoch
}

// maxTxnOps bounds the operations of one transaction (etcd's default --max-txn-ops is 128).
const maxTxnOps = 128

// Unheld returns the stored paused sandboxes whose node is gone, which no node lists: with
// ids, those of ids; else all of them. Each is its stored record, paused. A sandbox adopted
// since (its route another node's) is not returned: its node lists it.
func (mv *Moves) Unheld(ctx context.Context, ids ...string) ([]sandbox.Sandbox, error) {
	cl := mv.cl
	ctx, done := cl.opCtx(ctx, cl.cfg.OpTimeout)
	defer done()
	recs := map[string][]byte{}
	if len(ids) == 0 {
		resp, err := cl.c.Get(ctx, cl.key("stored")+"/", clientv3.WithPrefix())
		if err != nil {
			return nil, fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
		}
		for _, kv := range resp.Kvs {
			id := strings.TrimPrefix(string(kv.Key), cl.key("stored")+"/")
			if r := cl.route(id); r != nil && !cl.gone(r) {
				continue // a live node holds it (the fresh read below decides for the others)
			}
			recs[id] = kv.Value
			ids = append(ids, id)
		}
	}
	var out []sandbox.Sandbox
	for len(ids) > 0 {
		batch := ids[:min(len(ids), maxTxnOps/3)]
		ids = ids[len(batch):]
		ops := make([]clientv3.Op, 0, 3*len(batch))
		for _, id := range batch {
			ops = append(ops, clientv3.OpGet(cl.key("sandboxes", id)), clientv3.OpGet(cl.key("lost", id)), clientv3.OpGet(cl.key("stored", id)))
		}
		t, err := cl.c.Txn(ctx).Then(ops...).Commit()
		if err != nil {
			return nil, fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
		}
		for i, id := range batch {
			rk := t.Responses[3*i].GetResponseRange().Kvs
			lk := t.Responses[3*i+1].GetResponseRange().Kvs
			sk := t.Responses[3*i+2].GetResponseRange().Kvs
			var r Route
			if len(rk) == 0 || len(lk) > 0 || len(sk) == 0 || json.Unmarshal(rk[0].Value, &r) != nil || !r.Stored || !cl.gone(&r) {
				continue
			}
			var p sandbox.PortableSandbox
			if cl.openJSON(string(sk[0].Key), sk[0].Value, &p) != nil || p.Sandbox.ID != id {
				continue
			}
			p.Sandbox.State = sandbox.StatePaused
			out = append(out, p.Sandbox)
		}
	}
	return out, nil
}

// Forget ends stored sandbox id whose node is gone, without moving it: its route and stored
// record go (in a transaction that compares both, so an edge adopting it meanwhile wins),
// then its pause image. ErrConflict: it is not stored, or its node is not gone.
func (mv *Moves) Forget(ctx context.Context, id string) error {
	cl := mv.cl
	ctx, done := cl.opCtx(ctx, cl.cfg.OpTimeout)
	defer done()
	rkey, skey := cl.key("sandboxes", id), cl.key("stored", id)
	resp, err := cl.c.Txn(ctx).Then(clientv3.OpGet(rkey), clientv3.OpGet(skey)).Commit()
	if err != nil {
		return fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	rk, sk := resp.Responses[0].GetResponseRange().Kvs, resp.Responses[1].GetResponseRange().Kvs
	var r Route
	var p sandbox.PortableSandbox
	if len(rk) == 0 || len(sk) == 0 || json.Unmarshal(rk[0].Value, &r) != nil || cl.openJSON(skey, sk[0].Value, &p) != nil || !r.Stored || !cl.gone(&r) {
		return fmt.Errorf("sandbox %q is not a stored sandbox of a gone node: %w", id, errdefs.ErrConflict)
	}
	t, err := cl.c.Txn(ctx).If(
		clientv3.Compare(clientv3.ModRevision(rkey), "=", rk[0].ModRevision),
		clientv3.Compare(clientv3.ModRevision(skey), "=", sk[0].ModRevision),
	).Then(clientv3.OpDelete(rkey), clientv3.OpDelete(skey)).Commit()
	if err != nil {
		return fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	if !t.Succeeded {
		return fmt.Errorf("sandbox %q moved meanwhile: %w", id, errdefs.ErrConflict)
	}
	if p.ImageID != "" {
		mv.p.DeleteStored(context.WithoutCancel(ctx), p.ImageID)
	}
	cl.setRoute(id, nil)
	cl.log.Info("cluster: killed a stored paused sandbox of a gone node", "sandbox_id", id, "node", r.Node)
	return nil
}
