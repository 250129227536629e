package cluster

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// The health of the cluster store, as this node sees it, and the fencing rule it decides.
//
// A node that cannot renew its lease for a whole TTL fences itself (kills its sandboxes):
// the cluster will expire its lease and mark them lost. That is only true while etcd has a
// leader: an expiry is a write the leader proposes, and a newly elected leader extends every
// lease (by its election timeout plus the lease's TTL) before it expires any. So:
//
//   - etcd answers with a leader, or does not answer at all (the node is cut off, or every
//     member is down): fence a TTL after the last renewal sent, as before. A node cut off from
//     a healthy majority cannot tell a dead etcd from a partition, and the majority expires it.
//   - a member answers but has no leader ("no leader", or a write timed out for lack of a
//     quorum): no lease can expire now, so the node keeps its sandboxes past the TTL, up to
//     QuorumGrace after its last renewal. When a leader is back its lease is still there and
//     nothing happens; if the lease is gone after all, the node fences then (every sandbox of
//     that epoch is marked lost or will be), and its reconcile kills whatever the cluster
//     marked lost or routed elsewhere.
//
// The one case the rule does not see: a node partitioned together with a minority member,
// away from a healthy majority. The member says "no leader", the majority expires the node
// and marks its running sandboxes lost. They run on, unreachable through other edges (their
// routes are lost records), until the node reconnects or the grace ends, and are killed then.
// No sandbox ever runs twice: a running sandbox's state lives only on its node, so the cluster
// never starts it elsewhere, and nothing can be claimed here without a quorum.
//
// Meanwhile control calls answer 503 (Available), and the sandbox plane goes on from the
// routing caches.

// DefaultQuorumGrace is how long a node keeps its sandboxes while etcd has no leader.
const DefaultQuorumGrace = 10 * time.Minute

type storeState int

const (
	storeOK          storeState = iota
	storeNoQuorum               // a member answers, but has no leader or cannot commit
	storeUnreachable            // no member answers
)

type storeHealth struct {
	mu     sync.Mutex
	state  storeState
	since  time.Time // when state began
	lastOK time.Time // the last round trip that etcd committed or answered with a leader
	// noLeader is when a member last answered that it has no leader (or could not commit).
	noLeader time.Time
	cause    string
}

// classify tells an etcd error from a member without a leader apart from one from no member.
func classify(err error) storeState {
	switch {
	case err == nil:
		return storeOK
	case errors.Is(err, rpctypes.ErrNoLeader), errors.Is(err, rpctypes.ErrTimeout),
		errors.Is(err, rpctypes.ErrTimeoutDueToLeaderFail), errors.Is(err, rpctypes.ErrTimeoutDueToConnectionLost),
		errors.Is(err, rpctypes.ErrLeaderChanged), errors.Is(err, rpctypes.ErrNotCapable):
		return storeNoQuorum
	default:
		return storeUnreachable
	}
}

// noteStore records the outcome of one round trip to etcd.
func (cl *Cluster) noteStore(err error) {
	st := classify(err)
	if st == storeUnreachable && errors.Is(err, rpctypes.ErrLeaseNotFound) {
		st = storeOK // answered with a leader
	}
	h := &cl.health
	now := time.Now()
	h.mu.Lock()
	prev := h.state
	if st != prev {
		h.state, h.since = st, now
	}
	if st == storeNoQuorum {
		h.noLeader = now
	}
	if st == storeOK {
		h.lastOK = now
	} else {
		h.cause = err.Error()
	}
	cause := h.cause
	h.mu.Unlock()
	switch {
	case st == prev:
	case st == storeOK:
		cl.log.Warn("cluster: etcd answers again with a leader: control calls are served again")
	case st == storeNoQuorum:
		cl.log.Error("cluster: etcd has no quorum: control calls answer 503, running sandboxes keep serving", "cause", cause)
	default:
		cl.log.Error("cluster: etcd unreachable: control calls answer 503", "cause", cause)
	}
}

// Available says whether control calls can be served: nil while etcd answers with a leader,
// else an ErrUnavailable error naming the cause.
func (cl *Cluster) Available() error {
	h := &cl.health
	h.mu.Lock()
	st, since, cause := h.state, h.since, h.cause
	h.mu.Unlock()
	switch st {
	case storeNoQuorum:
		return fmt.Errorf("the cluster store (etcd) has no quorum since %s (%s): control calls are refused until a majority of its members is back; running sandboxes keep serving: %w",
			since.UTC().Format(time.RFC3339), cause, errdefs.ErrUnavailable)
	case storeUnreachable:
		return fmt.Errorf("the cluster store (etcd) is unreachable from node %s since %s (%s): control calls are refused until it answers: %w",
			cl.cfg.NodeID, since.UTC().Format(time.RFC3339), cause, errdefs.ErrUnavailable)
	}
	return nil
}

// holdWithoutQuorum reports whether a node whose renewal is overdue keeps its sandboxes: a
// member said lately that it has no leader (or, holding already, some member answered within
// a TTL: once a leader is back, the node holds until its own renewal answers, which says
// whether its lease survived), and the grace since the last renewal is not over.
func (cl *Cluster) holdWithoutQuorum(lastRenewal time.Time, holding bool) bool {
	h := &cl.health
	h.mu.Lock()
	defer h.mu.Unlock()
	if time.Since(lastRenewal) >= cl.cfg.QuorumGrace {
		return false
	}
	if holding {
		return time.Since(h.noLeader) < cl.cfg.TTL || time.Since(h.lastOK) < cl.cfg.TTL
	}
	return h.state != storeOK && time.Since(h.noLeader) < 2*cl.cfg.ProbeInterval+cl.cfg.ProbeTimeout
}

// probeLoop checks etcd every ProbeInterval in which no other round trip succeeded: one
// linearizable read that a member without a leader refuses at once. It is a transaction: the
// client retries a plain read refused for want of a leader until its deadline, which would
// hide the answer.
func (cl *Cluster) probeLoop(ctx context.Context) {
	for sleep(ctx, cl.cfg.ProbeInterval) {
		h := &cl.health
		h.mu.Lock()
		fresh := h.state == storeOK && time.Since(h.lastOK) < cl.cfg.ProbeInterval
		h.mu.Unlock()
		if fresh {
			continue
		}
		pctx, cancel := context.WithTimeout(clientv3.WithRequireLeader(ctx), cl.cfg.ProbeTimeout)
		_, err := cl.c.Txn(pctx).Then(clientv3.OpGet(cl.key("nodes", cl.cfg.NodeID), clientv3.WithCountOnly())).Commit()
		cancel()
		if ctx.Err() != nil {
			return
		}
		if errors.Is(err, context.DeadlineExceeded) {
			err = fmt.Errorf("no member answered within %v", cl.cfg.ProbeTimeout)
		}
		cl.noteStore(err)
	}
}

// opCtx bounds a control call's round trips to etcd, and has a member without a leader refuse
// them at once instead of queueing them.
func (cl *Cluster) opCtx(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(clientv3.WithRequireLeader(ctx), d)
}
