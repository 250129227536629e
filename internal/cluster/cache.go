package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// What a node watches, and what it does not. Every node watches the records that change with
// membership, not with sandboxes: nodes/, drain/, down/, apikeys/ and templates/. A create or
// a kill writes none of them, so the watch events an operation costs do not grow with the
// number of nodes (issue 21). Routes (sandboxes/<sid>) are not watched: a node knows its own
// (it writes them, and reads them once at start), and an edge that meets a sandbox it does
// not know reads its route once and keeps it, until the node answers "not here" (Locate with
// fresh). Allocations (alloc/<id>) are not watched either: the reconcile's read refreshes them
// every SyncInterval, and placement reads a node's again when it loses a race on it.
var watchedKinds = []string{"nodes", "drain", "down", "apikeys", "templates"}

// maxRemoteRoutes bounds the routes of other nodes an edge keeps (past it, it forgets them
// and reads them again as it meets them).
const maxRemoteRoutes = 100_000

// load reads the watched records and the allocations into fresh caches (kinds: all watched
// ones when empty) and returns the revision read.
func (cl *Cluster) load(ctx context.Context, kinds ...string) (int64, error) {
	if len(kinds) == 0 {
		kinds = append(kinds, watchedKinds...)
		kinds = append(kinds, "alloc")
	}
	ops := make([]clientv3.Op, 0, len(kinds))
	for _, k := range kinds {
		ops = append(ops, clientv3.OpGet(cl.key(k)+"/", clientv3.WithPrefix()))
	}
	r, err := cl.c.Txn(ctx).Then(ops...).Commit()
	if err != nil {
		return 0, err
	}
	cl.mu.Lock()
	defer cl.mu.Unlock()
	if cl.routes == nil {
		cl.routes = map[string]*Route{}
		cl.byNode = map[string]map[string]struct{}{}
		cl.watchRev = map[string]int64{}
	}
	for i, k := range kinds {
		switch k {
		case "nodes":
			cl.nodes = map[string]*NodeInfo{}
		case "alloc":
			cl.allocs = map[string]allocEntry{}
		case "drain":
			cl.drains = map[string]bool{}
		case "apikeys":
			cl.keys = map[string][]byte{}
		case "down":
			cl.down = map[string]time.Time{}
		case "templates":
			cl.templates = map[string]*SharedTemplate{}
		}
		for _, kv := range r.Responses[i].GetResponseRange().Kvs {
			cl.applyPut(kv)
		}
		if k != "alloc" {
			cl.watchRev[k] = r.Header.Revision
		}
	}
	return r.Header.Revision, nil
}

// loadOwnRoutes reads the routes of this node (any epoch) into the cache: a node that
// restarts finds what the cluster thinks it holds. One paged range read of every route, once.
func (cl *Cluster) loadOwnRoutes(ctx context.Context) error {
	from, end := cl.key("sandboxes")+"/", clientv3.GetPrefixRangeEnd(cl.key("sandboxes")+"/")
	for {
		r, err := cl.c.Get(ctx, from, clientv3.WithRange(end), clientv3.WithLimit(1000))
		if err != nil {
			return err
		}
		cl.mu.Lock()
		for _, kv := range r.Kvs {
			var rt Route
			if json.Unmarshal(kv.Value, &rt) == nil && rt.Node == cl.cfg.NodeID {
				rt.modRev = kv.ModRevision
				cl.putRoute(strings.TrimPrefix(string(kv.Key), cl.key("sandboxes")+"/"), &rt)
			}
		}
		cl.mu.Unlock()
		if !r.More || len(r.Kvs) == 0 {
			return nil
		}
		from = string(r.Kvs[len(r.Kvs)-1].Key) + "\x00"
	}
}

// watch feeds the caches of the watched kinds from etcd, one watch per kind on one stream,
// reloading a kind when its watch falls behind a compaction.
func (cl *Cluster) watch(ctx context.Context, rev int64) {
	done := make(chan struct{})
	for _, k := range watchedKinds {
		go func() {
			defer func() { done <- struct{}{} }()
			cl.watchKind(ctx, k, rev)
		}()
	}
	for range watchedKinds {
		<-done
	}
}

func (cl *Cluster) watchKind(ctx context.Context, kind string, rev int64) {
	for ctx.Err() == nil {
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		ch := cl.c.Watch(wctx, cl.key(kind)+"/", clientv3.WithPrefix(), clientv3.WithRev(rev+1), clientv3.WithPrevKV())
		for resp := range ch {
			if err := resp.Err(); err != nil {
				if errors.Is(err, rpctypes.ErrCompacted) {
					cl.log.Warn("cluster: watch compacted: reloading the cache", "kind", kind)
					before := cl.nodeEpochs()
					if r, err := cl.load(ctx, kind); err == nil {
						rev = r
						// A node that died in the events compacted away is reaped all the same.
						if kind == "nodes" {
							for _, d := range cl.diedSince(before) {
								cl.nodeDied(ctx, d, time.Now())
							}
						}
					}
				}
				break
			}
			cl.watchEvents.Add(int64(len(resp.Events)))
			// A node that joins is placeable as soon as it is seen: its allocation is read
			// before its record is applied (allocations are not watched).
			var joined []string
			cl.mu.RLock()
			for _, ev := range resp.Events {
				if id, ok := strings.CutPrefix(string(ev.Kv.Key), cl.p+"nodes/"); ok && ev.Type == mvccpb.PUT {
					if n := cl.nodes[id]; n == nil || n.Epoch != ev.Kv.Lease {
						joined = append(joined, id)
					}
				}
			}
			cl.mu.RUnlock()
			if len(joined) > 0 {
				cl.readAllocs(ctx, joined)
			}
			cl.mu.Lock()
			var died []deadNode
			now := time.Now()
			for _, ev := range resp.Events {
				if ev.Type == mvccpb.PUT {
					cl.applyPut(ev.Kv)
				} else if id, ok := strings.CutPrefix(string(ev.Kv.Key), cl.p+"nodes/"); ok {
					delete(cl.nodes, id)
					// Lost from this moment, as its sandboxes are (Locate): the reaper's down
					// record, which other nodes load, follows.
					cl.down[id] = now
					d := deadNode{id: id}
					if ev.PrevKv != nil {
						d.epoch = ev.PrevKv.Lease
					}
					died = append(died, d)
				} else {
					cl.applyDelete(string(ev.Kv.Key))
				}
			}
			if resp.Header.Revision > cl.watchRev[kind] {
				cl.watchRev[kind] = resp.Header.Revision
			}
			rev = cl.watchRev[kind]
			cl.mu.Unlock()
			for _, d := range died {
				cl.nodeDied(ctx, d, now)
			}
		}
		cancel()
		sleep(ctx, 100*time.Millisecond)
	}
}

// nodeEpochs returns the epoch of every live node in the cache.
func (cl *Cluster) nodeEpochs() map[string]int64 {
	cl.mu.RLock()
	defer cl.mu.RUnlock()
	out := make(map[string]int64, len(cl.nodes))
	for id, n := range cl.nodes {
		out[id] = n.Epoch
	}
	return out
}

// diedSince returns the nodes of before (nodeEpochs) whose epoch is no longer live in the
// cache, and notes those gone lost (as the watch does).
func (cl *Cluster) diedSince(before map[string]int64) []deadNode {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	var out []deadNode
	for id, epoch := range before {
		n := cl.nodes[id]
		if n != nil && n.Epoch == epoch {
			continue
		}
		out = append(out, deadNode{id: id, epoch: epoch})
		if _, down := cl.down[id]; n == nil && !down {
			cl.down[id] = time.Now()
		}
	}
	return out
}

// applyPut and applyDelete update the caches; the caller holds mu.
func (cl *Cluster) applyPut(kv *mvccpb.KeyValue) {
	k := strings.TrimPrefix(string(kv.Key), cl.p)
	kind, rest, _ := strings.Cut(k, "/")
	switch kind {
	case "nodes":
		var n NodeInfo
		if json.Unmarshal(kv.Value, &n) == nil {
			n.Epoch = kv.Lease
			cl.nodes[rest] = &n
			delete(cl.down, rest)
		}
	case "alloc":
		var a Alloc
		// Never older than what placement noted from its own transactions.
		if e, ok := cl.allocs[rest]; (!ok || e.modRev <= kv.ModRevision) && json.Unmarshal(kv.Value, &a) == nil {
			cl.allocs[rest] = allocEntry{a: a, modRev: kv.ModRevision}
		}
	case "drain":
		cl.drains[rest] = true
		if rest == cl.cfg.NodeID {
			cl.drainedAt.Store(time.Now().UnixNano())
		}
	case "apikeys":
		cl.keys[rest] = kv.Value
	case "templates":
		cl.applyTemplate(rest, kv.Value)
	case "down":
		var at time.Time
		if json.Unmarshal(kv.Value, &at) == nil {
			cl.down[rest] = at
		}
	}
}

func (cl *Cluster) applyDelete(key string) {
	k := strings.TrimPrefix(key, cl.p)
	kind, rest, _ := strings.Cut(k, "/")
	switch kind {
	case "drain":
		delete(cl.drains, rest)
		if rest == cl.cfg.NodeID {
			cl.drainedAt.Store(time.Now().UnixNano()) // adoptable a while more (sync.go)
		}
	case "apikeys":
		delete(cl.keys, rest)
	case "templates":
		cl.applyTemplate(rest, nil)
	case "down":
		delete(cl.down, rest)
	}
}

// refreshAllocs replaces the cached allocations by those read (the reconcile's read).
func (cl *Cluster) refreshAllocs(kvs []*mvccpb.KeyValue) {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	seen := make(map[string]bool, len(kvs))
	for _, kv := range kvs {
		seen[strings.TrimPrefix(string(kv.Key), cl.key("alloc")+"/")] = true
		cl.applyPut(kv)
	}
	for id := range cl.allocs {
		if !seen[id] {
			delete(cl.allocs, id)
		}
	}
}

// readAllocs reads the allocations of nodes into the cache.
func (cl *Cluster) readAllocs(ctx context.Context, nodes []string) {
	ops := make([]clientv3.Op, 0, len(nodes))
	for _, id := range nodes {
		ops = append(ops, clientv3.OpGet(cl.key("alloc", id)))
	}
	t, err := cl.c.Txn(ctx).Then(ops...).Commit()
	if err != nil {
		return
	}
	cl.mu.Lock()
	defer cl.mu.Unlock()
	for _, r := range t.Responses {
		for _, kv := range r.GetResponseRange().Kvs {
			cl.applyPut(kv)
		}
	}
}

// putRoute caches route r of sandbox id; the caller holds mu.
func (cl *Cluster) putRoute(id string, r *Route) {
	if old := cl.routes[id]; old != nil {
		delete(cl.byNode[old.Node], id)
	} else if r.Node != cl.cfg.NodeID && len(cl.routes) >= maxRemoteRoutes+len(cl.byNode[cl.cfg.NodeID]) {
		cl.forgetRemoteRoutes()
	}
	cl.routeGen++
	r.gen = cl.routeGen
	cl.routes[id] = r
	if cl.byNode[r.Node] == nil {
		cl.byNode[r.Node] = map[string]struct{}{}
	}
	cl.byNode[r.Node][id] = struct{}{}
}

// dropRoute forgets the route of sandbox id; the caller holds mu.
func (cl *Cluster) dropRoute(id string) {
	if old := cl.routes[id]; old != nil {
		delete(cl.byNode[old.Node], id)
	}
	delete(cl.routes, id)
}

// forgetRemoteRoutes drops the cached routes of other nodes; the caller holds mu.
func (cl *Cluster) forgetRemoteRoutes() {
	for node, ids := range cl.byNode {
		if node == cl.cfg.NodeID {
			continue
		}
		for id := range ids {
			delete(cl.routes, id)
		}
		delete(cl.byNode, node)
	}
}

// setRoute caches what this node wrote or read of sandbox id's route (nil: it has none).
func (cl *Cluster) setRoute(id string, r *Route) {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	if r == nil {
		cl.dropRoute(id)
		return
	}
	c := *r
	cl.putRoute(id, &c)
}

// Revision is the etcd revision the caches of the watched kinds all reflect.
func (cl *Cluster) Revision() int64 {
	cl.mu.RLock()
	defer cl.mu.RUnlock()
	return cl.minWatchRev()
}

func (cl *Cluster) minWatchRev() int64 {
	var m int64
	for i, k := range watchedKinds {
		if r := cl.watchRev[k]; i == 0 || r < m {
			m = r
		}
	}
	return m
}

// WaitRevision blocks until the caches of the watched kinds reflect rev (or ctx ends). A kind
// without events since is brought forward by a progress request on the watch stream.
func (cl *Cluster) WaitRevision(ctx context.Context, rev int64) error {
	for i := 0; ; i++ {
		cl.mu.RLock()
		ok := cl.minWatchRev() >= rev
		cl.mu.RUnlock()
		if ok {
			return nil
		}
		if i%10 == 0 {
			_ = cl.c.RequestProgress(clientv3.WithRequireLeader(ctx))
		}
		if !sleep(ctx, 10*time.Millisecond) {
			return ctx.Err()
		}
	}
}

func (cl *Cluster) route(id string) *Route {
	cl.mu.RLock()
	defer cl.mu.RUnlock()
	if r := cl.routes[id]; r != nil {
		c := *r
		return &c
	}
	return nil
}

func (cl *Cluster) node(id string) *NodeInfo {
	cl.mu.RLock()
	defer cl.mu.RUnlock()
	if n := cl.nodes[id]; n != nil {
		c := *n
		return &c
	}
	return nil
}
