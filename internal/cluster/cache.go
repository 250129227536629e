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

// load reads everything under the prefix into fresh caches and returns the revision read.
func (cl *Cluster) load(ctx context.Context) (int64, error) {
	r, err := cl.c.Get(ctx, cl.p, clientv3.WithPrefix())
	if err != nil {
		return 0, err
	}
	cl.mu.Lock()
	defer cl.mu.Unlock()
	cl.nodes = map[string]*NodeInfo{}
	cl.allocs = map[string]allocEntry{}
	cl.drains = map[string]bool{}
	cl.routes = map[string]*Route{}
	cl.byNode = map[string]map[string]struct{}{}
	cl.keys = map[string][]byte{}
	cl.down = map[string]time.Time{}
	cl.templates = map[string]*SharedTemplate{}
	for _, kv := range r.Kvs {
		cl.applyPut(kv)
	}
	cl.rev = r.Header.Revision
	cl.revCond.Broadcast()
	return r.Header.Revision, nil
}

// watch feeds the caches from etcd, reloading them when the watch falls behind a compaction.
func (cl *Cluster) watch(ctx context.Context, rev int64) {
	for ctx.Err() == nil {
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		ch := cl.c.Watch(wctx, cl.p, clientv3.WithPrefix(), clientv3.WithRev(rev+1), clientv3.WithPrevKV())
		for resp := range ch {
			if err := resp.Err(); err != nil {
				if errors.Is(err, rpctypes.ErrCompacted) {
					cl.log.Warn("cluster: watch compacted: reloading the caches")
					if r, err := cl.load(ctx); err == nil {
						rev = r
					}
				}
				break
			}
			cl.mu.Lock()
			var died []deadNode
			for _, ev := range resp.Events {
				if ev.Type == mvccpb.PUT {
					cl.applyPut(ev.Kv)
				} else if id, ok := strings.CutPrefix(string(ev.Kv.Key), cl.p+"nodes/"); ok {
					delete(cl.nodes, id)
					d := deadNode{id: id}
					if ev.PrevKv != nil {
						d.epoch = ev.PrevKv.Lease
					}
					died = append(died, d)
				} else {
					cl.applyDelete(string(ev.Kv.Key))
				}
			}
			if resp.Header.Revision > cl.rev {
				cl.rev = resp.Header.Revision
			}
			rev = cl.rev
			cl.revCond.Broadcast()
			cl.mu.Unlock()
			for _, d := range died {
				cl.nodeDied(ctx, d, time.Now())
			}
		}
		cancel()
		sleep(ctx, 100*time.Millisecond)
	}
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
	case "sandboxes":
		var r Route
		if json.Unmarshal(kv.Value, &r) == nil {
			r.modRev = kv.ModRevision
			if old := cl.routes[rest]; old != nil && old.Node != r.Node {
				delete(cl.byNode[old.Node], rest)
			}
			cl.routes[rest] = &r
			if cl.byNode[r.Node] == nil {
				cl.byNode[r.Node] = map[string]struct{}{}
			}
			cl.byNode[r.Node][rest] = struct{}{}
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
	case "alloc":
		delete(cl.allocs, rest)
	case "drain":
		delete(cl.drains, rest)
	case "sandboxes":
		if old := cl.routes[rest]; old != nil {
			delete(cl.byNode[old.Node], rest)
		}
		delete(cl.routes, rest)
	case "apikeys":
		delete(cl.keys, rest)
	case "templates":
		cl.applyTemplate(rest, nil)
	case "down":
		delete(cl.down, rest)
	}
}

// Revision is the etcd revision the caches reflect.
func (cl *Cluster) Revision() int64 {
	cl.mu.RLock()
	defer cl.mu.RUnlock()
	return cl.rev
}

// WaitRevision blocks until the caches reflect rev (or ctx ends).
func (cl *Cluster) WaitRevision(ctx context.Context, rev int64) error {
	stop := context.AfterFunc(ctx, func() {
		cl.mu.Lock()
		cl.revCond.Broadcast()
		cl.mu.Unlock()
	})
	defer stop()
	cl.mu.RLock()
	defer cl.mu.RUnlock()
	for cl.rev < rev {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		cl.revCond.Wait()
	}
	return nil
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
