package cluster

import (
	"context"
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

