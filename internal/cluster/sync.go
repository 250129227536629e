package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"strconv"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

func (cl *Cluster) syncLoop(ctx context.Context) {
	t := time.NewTicker(cl.cfg.SyncInterval)
	defer t.Stop()
	for {
		full := true
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-cl.kick:
			full = false // a claim or a release here: this node's own allocation is what changed
		}
		cl.syncAllocs(ctx, full)
	}
}

// sync reconciles etcd with what this node holds: routes for its sandboxes (a sandbox the
// cluster marked lost, or routes to another node or epoch, is killed: never resurrected),
// routes of ended sandboxes removed, routes of an earlier epoch marked lost, and alloc/<id> =
// what runs here plus the reservations made for it. Its one read also refreshes the cached
// allocations of every node (they are not watched: cache.go).
func (cl *Cluster) sync(ctx context.Context) { cl.syncAllocs(ctx, true) }

// syncAllocs is sync; full reads every node's allocation into the cache, else only this
// node's: a round kicked by each claim and release must not read all N allocations, or the
// work of a create would grow with the cluster (BenchmarkClusterSim's bytes per create).
func (cl *Cluster) syncAllocs(ctx context.Context, full bool) {
	epoch := cl.epoch.Load()
	if epoch == 0 || cl.Available() != nil {
		return // fenced, or etcd cannot commit: nothing to reconcile against
	}
	self := cl.cfg.NodeID
	// Reservations before the local list: a reservation consumed in between is then counted
	// twice (until the next round), never missed.
	// One read for both: the allocation compared below is the one these reservations sum to.
	allocs := clientv3.OpGet(cl.key("alloc", self))
	if full {
		allocs = clientv3.OpGet(cl.key("alloc")+"/", clientv3.WithPrefix())
	}
	tr, err := cl.c.Txn(ctx).Then(clientv3.OpGet(cl.key("resv", self)+"/", clientv3.WithPrefix()), allocs).Commit()
	if err != nil {
		cl.log.Warn("cluster: sync: read reservations", "err", err)
		return
	}
	cl.noteStore(nil) // a linearizable read answered: no probe needed this interval
	rr, ar := tr.Responses[0].GetResponseRange(), tr.Responses[1].GetResponseRange()
	if full {
		cl.refreshAllocs(ar.Kvs)
	} else {
		cl.mu.Lock()
		for _, kv := range ar.Kvs {
			cl.applyPut(kv)
		}
		cl.mu.Unlock()
	}
	var ae allocEntry
	hasAlloc := false
	for _, kv := range ar.Kvs {
		if string(kv.Key) == cl.key("alloc", self) {
			hasAlloc = true
			_ = json.Unmarshal(kv.Value, &ae.a)
			ae.modRev = kv.ModRevision
		}
	}
	total := cl.reservedHere(ctx, rr.Kvs) // placement.go
	cl.mu.RLock()
	genBefore := cl.routeGen
	cl.mu.RUnlock()
	local, err := cl.cfg.Local.Sandboxes(ctx)
	if err != nil {
		cl.log.Warn("cluster: sync: list local sandboxes", "err", err)
		return
	}
	// Adopted elsewhere while this node was drained? Another node adopts a stored sandbox
	// only then (or once this node is gone: it fenced and killed everything), and nothing
	// tells this node but the route: read the routes of what it stored while it is drained,
	// and for a while after (an adoption that saw the drain may commit after it ended).
	if cl.adoptable() {
		cl.refreshStored(ctx, local)
	}
	have := map[string]bool{}
	var stale []staleRoute
	cl.mu.RLock()
	adopting := maps.Clone(cl.adopting)
	cl.mu.RUnlock()
	for _, s := range local {
		have[s.ID] = true
		if adopting[s.ID] {
			continue // imported, its route about to be taken over (moves.go)
		}
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
				stale = append(stale, staleRoute{s.ID, r.modRev, r})
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
		if have[id] || r == nil || r.gen > genBefore {
			continue
		}
		if r.Epoch != epoch {
			if r.Stored {
				continue // resumable anywhere (moves.go)
			}
			stale = append(stale, staleRoute{id, r.modRev, r})
		} else {
			ended = append(ended, staleRoute{id, r.modRev, r})
		}
	}
	cl.mu.RUnlock()
	for _, e := range ended {
		cl.dropOwnRoute(ctx, e.id, e.modRev)
	}
	if len(stale) > 0 {
		if err := cl.markLost(ctx, self, stale, "the node restarted", time.Now(), 0); err != nil {
			cl.log.Warn("cluster: sync: routes of an earlier epoch", "err", err) // the next round tries again
		}
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

// adoptable reports whether another node may adopt this node's stored sandboxes now: while
// it is drained, and for a while after.
func (cl *Cluster) adoptable() bool {
	if cl.draining(cl.cfg.NodeID) {
		cl.drainedAt.Store(time.Now().UnixNano())
		return true
	}
	at := cl.drainedAt.Load()
	return at != 0 && time.Since(time.Unix(0, at)) < 2*cl.cfg.TTL
}

// refreshStored reads again the routes of the local sandboxes this node stored: while it is
// drained another node may adopt them (moves.go), and nothing tells this node but the route.
func (cl *Cluster) refreshStored(ctx context.Context, local []LocalSandbox) {
	var ids []string
	for _, s := range local {
		if r := cl.route(s.ID); r != nil && r.Stored {
			ids = append(ids, s.ID)
		}
	}
	for len(ids) > 0 {
		batch := ids[:min(len(ids), maxTxnOps)]
		ids = ids[len(batch):]
		ops := make([]clientv3.Op, 0, len(batch))
		for _, id := range batch {
			ops = append(ops, clientv3.OpGet(cl.key("sandboxes", id)))
		}
		t, err := cl.c.Txn(ctx).Then(ops...).Commit()
		if err != nil {
			return
		}
		for i, id := range batch {
			var r *Route
			if kvs := t.Responses[i].GetResponseRange().Kvs; len(kvs) > 0 {
				r = &Route{}
				if json.Unmarshal(kvs[0].Value, r) != nil {
					continue
				}
				r.modRev = kvs[0].ModRevision
			}
			cl.setRoute(id, r)
		}
	}
}

type staleRoute struct {
	id     string
	modRev int64
	r      *Route
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

// nodeDied runs when a node's record goes (its lease expired or was revoked). Its sandboxes
// are lost from that moment (Locate derives it from their routes' epoch). One live node
// takes the cleaning up of that epoch (a create-if-absent key under its own lease): it records
// the node down and replaces the dead epoch's routes by lost records. A reaper that meets an
// etcd error lets the job go and tries again soon (so that another node may take it
// meanwhile); the others look again a TTL later, until the job is done, and take it over if
// the reaper died too (its claim went with its lease).
func (cl *Cluster) nodeDied(ctx context.Context, d deadNode, at time.Time) {
	if d.id == cl.cfg.NodeID {
		return
	}
	cl.wg.Add(1)
	go func() {
		defer cl.wg.Done()
		log := cl.log.With("lost_node", d.id)
		var lease clientv3.LeaseID // the reaping's records', kept across attempts
		retry := min(100*time.Millisecond, cl.cfg.TTL)
		for {
			wait := cl.cfg.TTL
			actx, cancel := cl.opCtx(ctx, reapTimeout*cl.cfg.OpTimeout)
			state, err := cl.claimReaping(actx, d)
			switch {
			case err != nil:
				log.Warn("cluster: reap: claim", "err", err)
				wait = retry
			case state == reapDone:
				cancel()
				return
			case state == reapClaimed:
				if err = cl.reap(actx, d, at, &lease); err == nil {
					cancel()
					return
				}
				log.Warn("cluster: reap: letting the job go, to try again", "err", err, "retry_in", retry)
				cl.releaseReaping(actx, d)
				wait = retry
			}
			cancel()
			if err != nil {
				retry = min(2*retry, cl.cfg.TTL)
			}
			if !sleep(ctx, wait) {
				return
			}
		}
	}()
}

// reapTimeout bounds an attempt at reaping a dead node, in OpTimeouts: a reaper stuck on etcd
// lets the job go (its claim is released, or goes with its lease) rather than hold it.
const reapTimeout = 4

type reapState int

const (
	reapHeld    reapState = iota // another node reaps that epoch, or this one cannot now
	reapClaimed                  // this node reaps it
	reapDone                     // reaped
)

func (cl *Cluster) reapingKey(d deadNode) string {
	return cl.key("reaping", d.id, strconv.FormatInt(d.epoch, 16))
}

// claimReaping takes the reaping of d (or finds that it is done, or held by another node). A
// claim of this node's found there is this node's: an earlier attempt committed it and lost
// the answer.
func (cl *Cluster) claimReaping(ctx context.Context, d deadNode) (reapState, error) {
	epoch := cl.epoch.Load()
	if epoch == 0 {
		return reapHeld, nil // fenced: the others reap
	}
	k := cl.reapingKey(d)
	r, err := cl.c.Txn(ctx).If(clientv3.Compare(clientv3.Version(k), "=", 0)).
		Then(clientv3.OpPut(k, cl.cfg.NodeID, clientv3.WithLease(clientv3.LeaseID(epoch)))).
		Else(clientv3.OpGet(k)).Commit()
	if err != nil {
		return reapHeld, err
	}
	if r.Succeeded {
		return reapClaimed, nil
	}
	for _, kv := range r.Responses[0].GetResponseRange().Kvs {
		switch {
		case string(kv.Value) == reapingDone:
			return reapDone, nil
		case string(kv.Value) == cl.cfg.NodeID && kv.Lease == epoch:
			return reapClaimed, nil
		}
	}
	return reapHeld, nil
}

// reapingDone is the value of a reaping key once its job is done.
const reapingDone = "done"

// releaseReaping lets the reaping of d go if this node holds it. A release that fails leaves
// the claim to this node's next attempt (claimReaping finds it its own), or to its lease.
func (cl *Cluster) releaseReaping(ctx context.Context, d deadNode) {
	k := cl.reapingKey(d)
	_, _ = cl.c.Txn(ctx).If(clientv3.Compare(clientv3.Value(k), "=", cl.cfg.NodeID)).Then(clientv3.OpDelete(k)).Commit()
}

// reap records a dead node down and replaces the routes of its dead epoch (found by one paged
// read of the routes) by lost records. Its capacity went with its lease. Done, the reaping
// key stays (under a LostTTL lease) so that no other node reaps that epoch again. Every step
// can be done again: a failed attempt is retried whole. *lease is the records' lease (granted
// when 0; cleared on an error, as it may be what failed).
func (cl *Cluster) reap(ctx context.Context, d deadNode, at time.Time, lease *clientv3.LeaseID) (err error) {
	node := d.id
	defer func() {
		if err != nil {
			*lease = 0
		}
	}()
	if *lease == 0 {
		l, err := cl.c.Grant(ctx, int64(cl.cfg.LostTTL/time.Second))
		if err != nil {
			return fmt.Errorf("grant: %w", err)
		}
		*lease = l.ID
	}
	cl.mu.RLock()
	n := cl.nodes[node]
	cl.mu.RUnlock()
	if n == nil {
		// Even if a down record of an earlier death is cached: this death's time is recorded.
		b, _ := json.Marshal(at.UTC())
		if _, err := cl.c.Txn(ctx).If(clientv3.Compare(clientv3.Version(cl.key("nodes", node)), "=", 0)).
			Then(clientv3.OpPut(cl.key("down", node), string(b), clientv3.WithLease(*lease))).Commit(); err != nil {
			return fmt.Errorf("record the node down: %w", err)
		}
	}
	var rs []staleRoute
	if err := cl.scanRoutes(ctx, func(id string, r *Route) {
		// A stored paused sandbox is not lost: another node resumes it (moves.go).
		if r.Node == node && !r.Stored && (n == nil || r.Epoch != n.Epoch) {
			rs = append(rs, staleRoute{id, r.modRev, r})
		}
	}); err != nil {
		return fmt.Errorf("read routes: %w", err)
	}
	if len(rs) > 0 {
		cl.log.Warn("cluster: node lost: recording its sandboxes lost", "lost_node", node, "sandboxes", len(rs))
		if err := cl.markLost(ctx, node, rs, "its node stopped answering", at, *lease); err != nil {
			return err
		}
	}
	if _, err := cl.c.Put(ctx, cl.reapingKey(d), reapingDone, clientv3.WithLease(*lease)); err != nil {
		return fmt.Errorf("mark the reaping done: %w", err)
	}
	return nil
}

// markLost replaces routes (unchanged since read) by lost records, in batches, under lease
// (granted when 0). An error leaves the routes not done yet as they were: the caller tries
// again (the routes it replaced are gone, or changed: their transaction compares).
func (cl *Cluster) markLost(ctx context.Context, node string, rs []staleRoute, reason string, at time.Time, lease clientv3.LeaseID) error {
	if lease == 0 {
		l, err := cl.c.Grant(ctx, int64(cl.cfg.LostTTL/time.Second))
		if err != nil {
			return fmt.Errorf("mark lost: grant: %w", err)
		}
		lease = l.ID
	}
	record := func(s staleRoute) string {
		lr := Lost{Node: node, At: at.UTC(), Reason: reason}
		if r := s.r; r != nil {
			lr.TemplateID, lr.CPU, lr.MemoryMB, lr.Since, lr.Team = r.TemplateID, r.CPU, r.MemoryMB, r.Since, r.Team
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
			ops = append(ops, clientv3.OpDelete(cl.key("sandboxes", r.id)), clientv3.OpPut(cl.key("lost", r.id), record(r), clientv3.WithLease(lease)))
		}
		resp, err := cl.c.Txn(ctx).If(cmps...).Then(ops...).Commit()
		if err != nil {
			return fmt.Errorf("mark lost: %w", err)
		}
		if !resp.Succeeded && n > 1 {
			// One of them changed: one by one.
			for _, r := range rs[:n] {
				if _, err := cl.c.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(cl.key("sandboxes", r.id)), "=", r.modRev)).
					Then(clientv3.OpDelete(cl.key("sandboxes", r.id)), clientv3.OpPut(cl.key("lost", r.id), record(r), clientv3.WithLease(lease))).Commit(); err != nil {
					return fmt.Errorf("mark lost: %w", err)
				}
			}
		}
		for _, r := range rs[:n] {
			cl.setRoute(r.id, nil) // lost, or changed meanwhile: read again when met
		}
		rs = rs[n:]
	}
	return nil
}
