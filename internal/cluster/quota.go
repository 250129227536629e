package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/errdefs"
)

// Team quotas across the cluster, in blocks (as placement hands out room, placement.go). A
// node serves a team's creates from a block of the team's quota it holds: quota/<team>/<node>,
// written under the node's lease, records how much of the team's quota the node may hold: running
// sandboxes, their vCPUs and MiB of memory, MiB of paused sandboxes' disk and builds at once
// (everything a node holds itself; templates' disk is not in blocks: see blockPart). A create the node's block covers costs etcd nothing. One that
// it does not grows the block in one transaction: the team's blocks are read (one range read),
// and the node's is rewritten only if no block of the team changed since (a prefix compare), so
// the blocks together never exceed the quota. A block is grown by more than the create needs
// when the team creates fast here (never by more than a quarter of what the team has left, so
// a nearly spent quota is shared one create at a time); the node lowers it to what it holds
// once the team goes idle here; a dead node's blocks go with its lease. No node watches
// another's blocks: the work per create is O(1), whatever the number of nodes.

// QuotaHeld reports what the node holds now of the quotas of every team that has a quota
// counted in blocks (its sandboxes, builds and the changes being admitted), by team, in the
// quota's units. A team left out has its blocks lowered to nothing.
type QuotaHeld func(ctx context.Context) (map[string]auth.Quota, error)

// QuotaBlocks is this node's blocks of the teams' quotas.
type QuotaBlocks struct {
	cl   *Cluster
	held QuotaHeld

	mu     sync.Mutex
	teams  map[string]*teamBlock
	raised time.Time // the last raise (tend's goroutine only)
}

type teamBlock struct {
	mu     sync.Mutex // one grant at a time per team
	have   auth.Quota // as written under epoch
	epoch  int64
	used   time.Time   // the last create it served
	looked time.Time   // the last time an idle block was compared with what the node holds
	recent []time.Time // creates within blockDemandWindow
}

// quotaIdle: a block unused for this long is lowered to what the node holds.
const quotaIdle = blockIdle

// NewQuotaBlocks returns the node's quota blocks; held reads what the node holds of a team's
// quota (what an idle block is lowered to, and what a block is raised to when it holds less).
// It raises blocks and gives idle ones back until the cluster closes.
func (cl *Cluster) NewQuotaBlocks(held QuotaHeld) *QuotaBlocks {
	qb := &QuotaBlocks{cl: cl, held: held, teams: map[string]*teamBlock{}}
	cl.wg.Add(1)
	go func() {
		defer cl.wg.Done()
		every(cl.bgCtx, quotaIdle/4, qb.tend)
	}()
	return qb
}

// blockPart is the part of a quota counted across the cluster in blocks: all but templates'
// disk, which every node counts from the cluster's templates (the same on every node: blocks
// of it would count a template once per node).
func blockPart(q auth.Quota) auth.Quota {
	return auth.Quota{Sandboxes: q.Sandboxes, CPUs: q.CPUs, MemoryMB: q.MemoryMB, PausedDiskMB: q.PausedDiskMB, Builds: q.Builds}
}

// dims are a block's dimensions, in order.
func dims(q auth.Quota) [5]int {
	return [5]int{q.Sandboxes, q.CPUs, q.MemoryMB, q.PausedDiskMB, q.Builds}
}

func fromDims(d [5]int) auth.Quota {
	return auth.Quota{Sandboxes: d[0], CPUs: d[1], MemoryMB: d[2], PausedDiskMB: d[3], Builds: d[4]}
}

// zipQuota is f over a and b, dimension by dimension.
func zipQuota(a, b auth.Quota, f func(a, b int) int) auth.Quota {
	da, db := dims(a), dims(b)
	var out [5]int
	for i := range out {
		out[i] = f(da[i], db[i])
	}
	return fromDims(out)
}

func addQuota(a, b auth.Quota, k int) auth.Quota {
	return zipQuota(a, b, func(x, y int) int { return x + k*y })
}

// covers: have is at least need in every dimension limit bounds.
func covers(limit, have, need auth.Quota) bool {
	l, h, n := dims(limit), dims(have), dims(need)
	for i := range l {
		if l[i] > 0 && h[i] < n[i] {
			return false
		}
	}
	return true
}

// Cover makes this node's block of team's quota (limit) cover need, what the node holds with
// the change being admitted (more). ok false: the other nodes' blocks (others) leave too little
// of the quota, and the change is over it.
func (qb *QuotaBlocks) Cover(ctx context.Context, team string, limit, need, more auth.Quota) (others auth.Quota, ok bool, err error) {
	limit, need, more = blockPart(limit), blockPart(need), blockPart(more)
	if limit == (auth.Quota{}) {
		return auth.Quota{}, true, nil
	}
	tb := qb.block(team)
	tb.mu.Lock()
	defer tb.mu.Unlock()
	now := time.Now()
	tb.recent, tb.used = noteDemand(tb.recent, now), now
	epoch := qb.cl.epoch.Load()
	if epoch == 0 {
		return auth.Quota{}, false, fmt.Errorf("this node is cut off from the cluster: %w", errdefs.ErrUnavailable)
	}
	if tb.epoch == epoch && covers(limit, tb.have, need) {
		return auth.Quota{}, true, nil
	}
	ctx, done := qb.cl.opCtx(ctx, qb.cl.cfg.OpTimeout)
	defer done()
	prefix := qb.cl.key("quota", team) + "/"
	mine := prefix + qb.cl.cfg.NodeID
	for attempt := 0; attempt < 16; attempt++ {
		resp, err := qb.cl.c.Get(ctx, prefix, clientv3.WithPrefix())
		if err != nil {
			return auth.Quota{}, false, fmt.Errorf("etcd: read quota blocks: %w", errdefs.ErrUnavailable)
		}
		others = auth.Quota{}
		for _, kv := range resp.Kvs {
			if string(kv.Key) == mine {
				continue
			}
			var b auth.Quota
			if json.Unmarshal(kv.Value, &b) == nil {
				others = addQuota(others, b, 1)
			}
		}
		if !covers(limit, addQuota(limit, others, -1), need) {
			return others, false, nil
		}
		want := qb.size(tb, limit, others, need, more)
		if tb.epoch == epoch {
			// Never lower a block here: a concurrent admission it covers may have asked first.
			want = zipQuota(want, tb.have, func(a, b int) int { return max(a, b) })
		}
		b, _ := json.Marshal(want)
		t, err := qb.cl.c.Txn(ctx).
			If(clientv3.Compare(clientv3.ModRevision(prefix), "<", resp.Header.Revision+1).WithPrefix()).
			Then(clientv3.OpPut(mine, string(b), clientv3.WithLease(clientv3.LeaseID(epoch)))).Commit()
		if err != nil {
			return auth.Quota{}, false, fmt.Errorf("etcd: grow quota block: %w", errdefs.ErrUnavailable)
		}
		if t.Succeeded {
			tb.have, tb.epoch = want, epoch
			return others, true, nil
		}
		// Another node's block changed: read them again.
		sleep(ctx, time.Millisecond*time.Duration(attempt+1))
	}
	return auth.Quota{}, false, fmt.Errorf("quota blocks of team %s kept changing: %w", team, errdefs.ErrUnavailable)
}

// size is the block to hold: need, and room for the creates the team is likely to make here
// before the block goes idle, within a quarter of what the quota has left.
func (qb *QuotaBlocks) size(tb *teamBlock, limit, others, need, more auth.Quota) auth.Quota {
	k := min(MaxBlockUnits, len(tb.recent)*int(quotaIdle)/int(blockDemandWindow)) - 1
	l, o, n, m := dims(limit), dims(others), dims(need), dims(more)
	for i := range l {
		if l[i] > 0 && m[i] > 0 {
			k = min(k, (l[i]-o[i]-n[i])/(4*m[i]))
		}
	}
	if k <= 0 {
		return need
	}
	return addQuota(need, more, k)
}

func (qb *QuotaBlocks) block(team string) *teamBlock {
	qb.mu.Lock()
	defer qb.mu.Unlock()
	tb := qb.teams[team]
	if tb == nil {
		tb = &teamBlock{}
		qb.teams[team] = tb
	}
	return tb
}

// Held returns the block this node holds of team's quota (for tests and /metrics).
func (qb *QuotaBlocks) Held(team string) auth.Quota {
	tb := qb.block(team)
	tb.mu.Lock()
	defer tb.mu.Unlock()
	if tb.epoch != qb.cl.epoch.Load() {
		return auth.Quota{}
	}
	return tb.have
}

// tend raises the blocks to what the node holds (once a quotaIdle) and lowers the idle ones.
func (qb *QuotaBlocks) tend(ctx context.Context) {
	if time.Since(qb.raised) >= quotaIdle {
		qb.raised = time.Now()
		if held, err := qb.held(ctx); err == nil {
			for team, h := range held {
				qb.raise(ctx, team, blockPart(h))
			}
		}
	}
	qb.returnIdle(ctx)
}

// raise makes team's block cover h, what the node holds of the team already: sandboxes (or
// builds, paused disk) it held before the team had a quota, or before the quota was lowered,
// which no Cover asked a block for. The other nodes' Covers count them from then on. Such a
// block may take the team's blocks past the quota: the other nodes then refuse the team
// until it is back under it.
func (qb *QuotaBlocks) raise(ctx context.Context, team string, h auth.Quota) {
	if h == (auth.Quota{}) {
		return
	}
	tb := qb.block(team)
	tb.mu.Lock()
	defer tb.mu.Unlock()
	epoch := qb.cl.epoch.Load()
	if epoch == 0 {
		return
	}
	have := tb.have
	if tb.epoch != epoch {
		have = auth.Quota{}
	}
	want := zipQuota(have, h, func(a, b int) int { return max(a, b) })
	if tb.epoch == epoch && want == tb.have {
		return
	}
	ctx, done := qb.cl.opCtx(ctx, qb.cl.cfg.OpTimeout)
	defer done()
	b, _ := json.Marshal(want)
	// Raising to what the node holds needs no compare: it claims nothing not already used.
	if _, err := qb.cl.c.Put(ctx, qb.cl.key("quota", team, qb.cl.cfg.NodeID), string(b), clientv3.WithLease(clientv3.LeaseID(epoch))); err != nil {
		return
	}
	tb.have, tb.epoch = want, epoch
}

// returnIdle lowers the blocks of teams idle here to what the node holds of them (the block
// is deleted when that is nothing), each looked at once a quotaIdle at most: one count of
// what the node holds serves every team.
func (qb *QuotaBlocks) returnIdle(ctx context.Context) {
	qb.mu.Lock()
	var idle []string
	for team, tb := range qb.teams {
		tb.mu.Lock()
		if time.Since(tb.used) > quotaIdle && time.Since(tb.looked) > quotaIdle && tb.have != (auth.Quota{}) {
			idle = append(idle, team)
		}
		tb.mu.Unlock()
	}
	qb.mu.Unlock()
	if len(idle) == 0 {
		return
	}
	held, err := qb.held(ctx)
	if err != nil {
		return
	}
	for _, team := range idle {
		qb.lower(ctx, team, held)
	}
}

// lower lowers team's block to held[team], unless the team created here since held was read
// (its block then still covers the creates it admitted).
func (qb *QuotaBlocks) lower(ctx context.Context, team string, held map[string]auth.Quota) {
	tb := qb.block(team)
	tb.mu.Lock()
	defer tb.mu.Unlock()
	if time.Since(tb.used) <= quotaIdle {
		return
	}
	epoch := qb.cl.epoch.Load()
	if tb.epoch != epoch {
		tb.have, tb.epoch = auth.Quota{}, 0 // gone with the node's former lease
		return
	}
	tb.looked = time.Now()
	want := zipQuota(blockPart(held[team]), tb.have, func(a, b int) int { return min(a, b) })
	if want == tb.have {
		return
	}
	ctx, done := qb.cl.opCtx(ctx, qb.cl.cfg.OpTimeout)
	defer done()
	mine := qb.cl.key("quota", team, qb.cl.cfg.NodeID)
	op := clientv3.OpDelete(mine)
	if want != (auth.Quota{}) {
		b, _ := json.Marshal(want)
		op = clientv3.OpPut(mine, string(b), clientv3.WithLease(clientv3.LeaseID(epoch)))
	}
	// Lowering a block never takes the team past its quota: no compare needed.
	if _, err := qb.cl.c.Do(ctx, op); err != nil {
		return
	}
	tb.have = want
}
