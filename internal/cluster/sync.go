package cluster

import (
	"context"
	"encoding/json"
	"maps"
	"strconv"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

func (cl *Cluster) syncLoop(ctx context.Context) {
	t := time.NewTicker(cl.cfg.SyncInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-cl.kick:
		}
		cl.sync(ctx)
	}
}

// sync reconciles etcd with what this node holds: routes for its sandboxes (a sandbox the
// cluster marked lost, or routes to another node or epoch, is killed: never resurrected),
// routes of ended sandboxes removed, routes of an earlier epoch marked lost, and alloc/<id> =
// what runs here plus the reservations made for it.
func (cl *Cluster) sync(ctx context.Context) {
	epoch := cl.epoch.Load()
	if epoch == 0 || cl.Available() != nil {
		return // fenced, or etcd cannot commit: nothing to reconcile against
	}
	self := cl.cfg.NodeID
	// Reservations before the local list: a reservation consumed in between is then counted
	// twice (until the next round), never missed.
	// One read for both: the allocation compared below is the one these reservations sum to.
	tr, err := cl.c.Txn(ctx).Then(clientv3.OpGet(cl.key("resv", self)+"/", clientv3.WithPrefix()), clientv3.OpGet(cl.key("alloc", self))).Commit()
	if err != nil {
		cl.log.Warn("cluster: sync: read reservations", "err", err)
		return
	}
	cl.noteStore(nil) // a linearizable read answered: no probe needed this interval
	rr, ar := tr.Responses[0].GetResponseRange(), tr.Responses[1].GetResponseRange()
	var ae allocEntry
	hasAlloc := len(ar.Kvs) > 0
	if hasAlloc {
		_ = json.Unmarshal(ar.Kvs[0].Value, &ae.a)
		ae.modRev = ar.Kvs[0].ModRevision
	}
	total := cl.reservedHere(ctx, rr.Kvs) // placement.go
	revBefore := cl.Revision()
	local, err := cl.cfg.Local.Sandboxes(ctx)
	if err != nil {
		cl.log.Warn("cluster: sync: list local sandboxes", "err", err)
		return
	}
	have := map[string]bool{}
	var stale []staleRoute
	for _, s := range local {
		have[s.ID] = true
		r := cl.route(s.ID)
		switch {
		case r == nil:
			if err := cl.claim(ctx, s, ""); err != nil {
				cl.killLocal(ctx, s.ID, err.Error())
				continue
			}
		case r.Node != self || r.Epoch != epoch:
			cl.killLocal(ctx, s.ID, "the cluster has it on node "+r.Node)
			if r.Node == self && !r.Stored { // a stored one stays resumable anywhere
				stale = append(stale, staleRoute{s.ID, r.modRev})
			}
			continue
		}
		if s.Running {
			total = total.add(TemplateSize{CPU: s.CPU, MemoryMB: s.MemoryMB}, 1)
		}
	}
	cl.mu.RLock()
	var ended []staleRoute
	for id := range cl.byNode[self] {
		r := cl.routes[id]
		if have[id] || r == nil || r.modRev > revBefore {
			continue
		}
		if r.Epoch != epoch {
			if r.Stored {
				continue // resumable anywhere (moves.go)
			}
			stale = append(stale, staleRoute{id, r.modRev})
		} else {
			ended = append(ended, staleRoute{id, r.modRev})
		}
	}
	cl.mu.RUnlock()
	for _, e := range ended {
		_, _ = cl.c.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(cl.key("sandboxes", e.id)), "=", e.modRev)).
			Then(clientv3.OpDelete(cl.key("sandboxes", e.id))).Commit()
	}
	if len(stale) > 0 {
		cl.markLost(ctx, self, stale, "the node restarted", time.Now())
	}
	if !hasAlloc || cl.allocDue(ae.a, total) { // placement.go
		b, _ := json.Marshal(total)
		cmp := []clientv3.Cmp{clientv3.Compare(clientv3.LeaseValue(cl.key("nodes", self)), "=", epoch)}
		if hasAlloc {
			cmp = append(cmp, clientv3.Compare(clientv3.ModRevision(cl.key("alloc", self)), "=", ae.modRev))
		}
		if _, err := cl.c.Txn(ctx).If(cmp...).Then(clientv3.OpPut(cl.key("alloc", self), string(b), clientv3.WithLease(clientv3.LeaseID(epoch)))).Commit(); err != nil {
			cl.log.Warn("cluster: sync: write allocation", "err", err)
		}
	}
	// The node record follows the templates it can start.
	if tpls, err := cl.cfg.Local.Templates(ctx); err == nil {
		if n := cl.node(self); n != nil && !maps.Equal(n.Templates, tpls) {
			n.Templates = tpls
			b, _ := json.Marshal(n)
			_, _ = cl.c.Txn(ctx).If(clientv3.Compare(clientv3.LeaseValue(cl.key("nodes", self)), "=", epoch)).
				Then(clientv3.OpPut(cl.key("nodes", self), string(b), clientv3.WithLease(clientv3.LeaseID(epoch)))).Commit()
		}
	}
}

type staleRoute struct {
	id     string
	modRev int64
}

func (cl *Cluster) killLocal(ctx context.Context, id, why string) {
	cl.log.Warn("cluster: killing a sandbox the cluster no longer gives this node", "sandbox_id", id, "why", why)
	if err := cl.cfg.Local.Kill(ctx, id); err != nil {
		cl.log.Error("cluster: kill", "sandbox_id", id, "err", err)
	}
}

type deadNode struct {
	id    string
	epoch int64
}

// nodeDied runs when a node's record goes (its lease expired or was revoked). One live node
// takes the reaping of that epoch (a create-if-absent key under its own lease) and marks the
// dead node's sandboxes lost at once; the others look again a TTL later and take it over if
// the reaper died too (its claim went with its lease) and routes remain.
func (cl *Cluster) nodeDied(ctx context.Context, d deadNode, at time.Time) {
	if d.id == cl.cfg.NodeID {
		return
	}
	cl.wg.Add(1)
	go func() {
		defer cl.wg.Done()
		for attempt := 0; attempt < 3; attempt++ {
			if cl.claimReaping(ctx, d) {
				cl.reap(ctx, d.id, at)
				_, _ = cl.c.Delete(ctx, cl.key("reaping", d.id, strconv.FormatInt(d.epoch, 16)))
				return
			}
			if !sleep(ctx, cl.cfg.TTL) || !cl.hasRoutes(d.id) {
				return
			}
		}
	}()
}

func (cl *Cluster) claimReaping(ctx context.Context, d deadNode) bool {
	epoch := cl.epoch.Load()
	if epoch == 0 {
		return false
	}
	k := cl.key("reaping", d.id, strconv.FormatInt(d.epoch, 16))
	r, err := cl.c.Txn(ctx).If(clientv3.Compare(clientv3.Version(k), "=", 0)).
		Then(clientv3.OpPut(k, cl.cfg.NodeID, clientv3.WithLease(clientv3.LeaseID(epoch)))).Commit()
	return err == nil && r.Succeeded
}

func (cl *Cluster) hasRoutes(node string) bool {
	cl.mu.RLock()
	defer cl.mu.RUnlock()
	return len(cl.byNode[node]) > 0
}

// reap marks every sandbox of a dead node (or of an ended epoch of it) lost and records the
// node as down. Its capacity went with its lease.
func (cl *Cluster) reap(ctx context.Context, node string, at time.Time) {
	if cl.epoch.Load() == 0 {
		return
	}
	cl.mu.RLock()
	n := cl.nodes[node]
	var rs []staleRoute
	for id := range cl.byNode[node] {
		// A stored paused sandbox is not lost: another node resumes it (moves.go).
		if r := cl.routes[id]; r != nil && !r.Stored && (n == nil || r.Epoch != n.Epoch) {
			rs = append(rs, staleRoute{id, r.modRev})
		}
	}
	_, known := cl.down[node]
	cl.mu.RUnlock()
	if n == nil && !known {
		if l, err := cl.c.Grant(ctx, int64(cl.cfg.LostTTL/time.Second)); err == nil {
			b, _ := json.Marshal(at.UTC())
			_, _ = cl.c.Txn(ctx).If(clientv3.Compare(clientv3.Version(cl.key("nodes", node)), "=", 0)).
				Then(clientv3.OpPut(cl.key("down", node), string(b), clientv3.WithLease(l.ID))).Commit()
		}
	}
	if len(rs) > 0 {
		cl.log.Warn("cluster: node lost: marking its sandboxes lost", "lost_node", node, "sandboxes", len(rs))
		cl.markLost(ctx, node, rs, "its node stopped answering", at)
	}
}

// markLost replaces routes (unchanged since read) by lost records, in batches.
func (cl *Cluster) markLost(ctx context.Context, node string, rs []staleRoute, reason string, at time.Time) {
	l, err := cl.c.Grant(ctx, int64(cl.cfg.LostTTL/time.Second))
	if err != nil {
		cl.log.Warn("cluster: mark lost: grant", "err", err)
		return
	}
	record := func(id string) string {
		lr := Lost{Node: node, At: at.UTC(), Reason: reason}
		if r := cl.route(id); r != nil {
			lr.TemplateID, lr.CPU, lr.MemoryMB, lr.Since = r.TemplateID, r.CPU, r.MemoryMB, r.Since
		}
		b, _ := json.Marshal(lr)
		return string(b)
	}
	const batch = 40 // 3 entries each, within etcd's default 128 operations a transaction
	for len(rs) > 0 {
		n := min(batch, len(rs))
		var cmps []clientv3.Cmp
		var ops []clientv3.Op
		for _, r := range rs[:n] {
			cmps = append(cmps, clientv3.Compare(clientv3.ModRevision(cl.key("sandboxes", r.id)), "=", r.modRev))
			ops = append(ops, clientv3.OpDelete(cl.key("sandboxes", r.id)), clientv3.OpPut(cl.key("lost", r.id), record(r.id), clientv3.WithLease(l.ID)))
		}
		resp, err := cl.c.Txn(ctx).If(cmps...).Then(ops...).Commit()
		if err != nil {
			cl.log.Warn("cluster: mark lost", "err", err)
			return
		}
		if !resp.Succeeded && n > 1 {
			// One of them changed: one by one.
			for _, r := range rs[:n] {
				_, _ = cl.c.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(cl.key("sandboxes", r.id)), "=", r.modRev)).
					Then(clientv3.OpDelete(cl.key("sandboxes", r.id)), clientv3.OpPut(cl.key("lost", r.id), record(r.id), clientv3.WithLease(l.ID))).Commit()
			}
		}
		rs = rs[n:]
	}
}
