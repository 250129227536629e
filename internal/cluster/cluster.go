package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// Local is this node's view of its own sandboxes, given by the daemon.
type Local interface {
	// Sandboxes lists the sandboxes the node holds (running or paused).
	Sandboxes(ctx context.Context) ([]LocalSandbox, error)
	// Templates lists the templates the node can start, with their sizes.
	Templates(ctx context.Context) (map[string]TemplateSize, error)
	// Kill ends one sandbox at once (fencing, or a sandbox the cluster has moved or lost).
	Kill(ctx context.Context, id string) error
}

// Config of a cluster member.
type Config struct {
	Client *clientv3.Client
	Prefix string // default "/ember/"
	NodeID string
	URL    string // advertised base URL (http://host:port) other nodes proxy to
	// TTL of the node's lease (default 10 s): a node that cannot renew it for a whole TTL
	// fences itself, and the others mark its sandboxes lost once etcd expires it.
	TTL      time.Duration
	Capacity Capacity
	Runsc    string
	CPUClass string
	Local    Local
	// Builtins are the built-in templates this node builds on first use (NodeInfo.Builtins).
	Builtins map[string]TemplateSize
	// SyncInterval is how often the node reconciles its routes and allocation with what it
	// holds (default 2 s).
	SyncInterval time.Duration
	// LeaseFile keeps the lease id across a restart: a node back within its TTL keeps its
	// epoch (and its sandboxes). Empty = a new epoch at each start.
	LeaseFile string
	// OnFence runs after the node fenced itself and killed its sandboxes (may be nil).
	OnFence func(reason string)
	// OnPlacementRetry runs each time a create is placed again (a lost reservation race or a
	// node that refused it); may be nil. The daemon counts it in /metrics.
	OnPlacementRetry func()
	// LostTTL is how long lost sandboxes and dead nodes are remembered (default 24 h).
	LostTTL time.Duration
	Logger  *slog.Logger
	// MinDiskFreeMB is the free disk below which a node takes no new sandboxes (default 256).
	MinDiskFreeMB int64
	// OwnClient: Close closes Client too.
	OwnClient bool
	// QuorumGrace is how long a node keeps its sandboxes past its TTL while an etcd member
	// answers that it has no leader (no lease can expire then; quorum.go). Default 10 min.
	QuorumGrace time.Duration
	// ProbeInterval and ProbeTimeout: how often and how patiently the node checks that etcd
	// has a leader when nothing else told it lately (defaults 1 s and 1 s).
	ProbeInterval, ProbeTimeout time.Duration
	// Secret signs the requests between nodes (16 bytes or more; empty = the cluster's own,
	// made by the first node and kept in etcd: secret.go).
	Secret []byte
	// SealKey seals the records that hold secrets (seal.go); nil = plain (--etcd-insecure).
	SealKey *SealKey
	// OpTimeout bounds each etcd round trip of a control call (default 5 s): without a
	// leader, a write can wait on etcd much longer.
	OpTimeout time.Duration
	// Counters counts the requests of Client (its DialOptions on the client), for /metrics;
	// may be nil.
	Counters *EtcdCounters
}

// Cluster is this node's membership in the cluster and its caches of the others.
type Cluster struct {
	cfg Config
	c   *clientv3.Client
	log *slog.Logger
	p   string // prefix

	epoch  atomic.Int64 // current lease; 0 while fenced or not yet registered
	fenced atomic.Bool

	mu     sync.RWMutex
	nodes  map[string]*NodeInfo
	allocs map[string]allocEntry
	drains map[string]bool
	// routes holds this node's routes (it writes them) and those of other nodes' sandboxes
	// it looked up (cache.go); byNode indexes them by node.
	routes   map[string]*Route
	byNode   map[string]map[string]struct{}
	routeGen uint64            // counts the routes cached: Route.gen
	keys     map[string][]byte // apikeys/<id> → JSON
	down     map[string]time.Time
	watchRev map[string]int64 // by watched kind: the last revision its cache reflects
	// adopting holds the stored sandboxes this node is adopting: imported here, their route
	// not yet taken over (moves.go), which the reconcile must not kill meanwhile.
	adopting map[string]bool

	watchEvents atomic.Int64

	templates map[string]*SharedTemplate // templates/<id>: the cluster's templates (templates.go)

	drainedAt atomic.Int64 // unix ns: the last time this node was seen drained (adoptable, sync.go)

	kick      chan struct{}
	closeOnce sync.Once
	bgCtx     context.Context // the node's loops run until Close ends it
	cancel    context.CancelFunc
	wg        sync.WaitGroup

	pool         blockPool // placement.go
	placeRetries atomic.Int64
	fences       atomic.Int64

	health storeHealth
	secret []byte
}

type allocEntry struct {
	a      Alloc
	modRev int64
}

// New connects the node to the cluster: it loads the caches, registers the node under a lease
// and starts its renewal, the watch and the reconcile loop. Close leaves the cluster.
func New(ctx context.Context, cfg Config) (*Cluster, error) {
	if cfg.Prefix == "" {
		cfg.Prefix = "/ember/"
	}
	if cfg.TTL <= 0 {
		cfg.TTL = 10 * time.Second
	}
	if cfg.SyncInterval <= 0 {
		cfg.SyncInterval = 2 * time.Second
	}
	if cfg.LostTTL <= 0 {
		cfg.LostTTL = 24 * time.Hour
	}
	if cfg.QuorumGrace <= 0 {
		cfg.QuorumGrace = DefaultQuorumGrace
	}
	if cfg.ProbeInterval <= 0 {
		cfg.ProbeInterval = time.Second
	}
	if cfg.OpTimeout <= 0 {
		cfg.OpTimeout = 5 * time.Second
	}
	if cfg.ProbeTimeout <= 0 {
		cfg.ProbeTimeout = time.Second
	}
	if cfg.MinDiskFreeMB == 0 {
		cfg.MinDiskFreeMB = 256
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.NodeID == "" || cfg.Client == nil || cfg.Local == nil {
		return nil, fmt.Errorf("cluster: node id, etcd client and local view are required: %w", errdefs.ErrInvalid)
	}
	cl := &Cluster{cfg: cfg, c: cfg.Client, p: cfg.Prefix, log: cfg.Logger.With("node_id", cfg.NodeID),
		kick: make(chan struct{}, 1)}
	rev, err := cl.load(ctx)
	if err != nil {
		return nil, fmt.Errorf("etcd: %w", err)
	}
	if err := cl.loadOwnRoutes(ctx); err != nil {
		return nil, fmt.Errorf("etcd: %w", err)
	}
	if err := cl.loadSecret(ctx); err != nil {
		return nil, fmt.Errorf("etcd: cluster secret: %w", err)
	}
	if err := cl.register(ctx); err != nil {
		return nil, fmt.Errorf("etcd: register node: %w", err)
	}
	bg, cancel := context.WithCancel(context.Background())
	cl.bgCtx, cl.cancel = bg, cancel
	cl.health.lastOK = time.Now()
	cl.wg.Add(5)
	// The watch first: the first reconcile claims routes and waits for the caches to see
	// them (a node that held unrouted sandboxes once waited here until ctx ended).
	go func() { defer cl.wg.Done(); cl.watch(bg, rev) }()
	go func() { defer cl.wg.Done(); cl.renew(bg) }()
	go func() { defer cl.wg.Done(); cl.probeLoop(bg) }()
	go func() { defer cl.wg.Done(); cl.placementLoop(bg) }()
	// The first reconcile before serving: sandboxes the cluster marked lost or moved while this
	// node was away are killed, not resurrected.
	cl.sync(ctx)
	go func() { defer cl.wg.Done(); cl.syncLoop(bg) }()
	return cl, nil
}

// Close stops the node's loops. The lease is left to expire unless Leave is called first (a
// restart within the TTL keeps the node's epoch through LeaseFile).
func (cl *Cluster) Close() {
	cl.cancel()
	cl.wg.Wait()
	if cl.cfg.OwnClient {
		cl.closeOnce.Do(func() { cl.c.Close() })
	}
}

// Leave revokes the node's lease: the node is gone at once (its sandboxes are reported lost).
func (cl *Cluster) Leave(ctx context.Context) error {
	if e := cl.epoch.Load(); e != 0 {
		_, err := cl.c.Revoke(ctx, clientv3.LeaseID(e))
		return err
	}
	return nil
}

// NodeID is this node's id.
func (cl *Cluster) NodeID() string { return cl.cfg.NodeID }

// Epoch is this node's current lease (0 while fenced).
func (cl *Cluster) Epoch() int64 { return cl.epoch.Load() }

// Fenced reports whether the node is cut off (it has killed its sandboxes and serves none).
func (cl *Cluster) Fenced() bool { return cl.fenced.Load() }

// Fences counts the times this node fenced itself.
func (cl *Cluster) Fences() int64 { return cl.fences.Load() }

// PlacementRetries counts placements that had to try again (a lost race or a refusal).
func (cl *Cluster) PlacementRetries() int64 { return cl.placeRetries.Load() }

// placementRetried counts one placement retry.
func (cl *Cluster) placementRetried() {
	cl.placeRetries.Add(1)
	if f := cl.cfg.OnPlacementRetry; f != nil {
		f()
	}
}

func (cl *Cluster) key(parts ...string) string { return cl.p + strings.Join(parts, "/") }

// --- liveness ---

func (cl *Cluster) register(ctx context.Context) error {
	var lease clientv3.LeaseID
	if cl.cfg.LeaseFile != "" {
		if b, err := os.ReadFile(cl.cfg.LeaseFile); err == nil {
			if id, err := strconv.ParseInt(strings.TrimSpace(string(b)), 16, 64); err == nil {
				kctx, cancel := context.WithTimeout(ctx, cl.cfg.TTL/3)
				_, err := cl.c.KeepAliveOnce(kctx, clientv3.LeaseID(id))
				cancel()
				if err == nil {
					lease = clientv3.LeaseID(id)
					cl.log.Info("cluster: kept the node's epoch across the restart", "epoch", fmt.Sprintf("%x", id))
				}
			}
		}
	}
	if lease == 0 {
		g, err := cl.c.Grant(ctx, int64((cl.cfg.TTL+time.Second-1)/time.Second))
		if err != nil {
			return err
		}
		lease = g.ID
	}
	info, err := cl.info(ctx)
	if err != nil {
		return err
	}
	b, _ := json.Marshal(info)
	// alloc/<id> starts from nothing: the reconcile right after fills it in.
	ab, _ := json.Marshal(Alloc{})
	_, err = cl.c.Txn(ctx).If(clientv3.Compare(clientv3.LeaseValue(cl.key("alloc", cl.cfg.NodeID)), "=", lease)).
		Then(clientv3.OpPut(cl.key("nodes", cl.cfg.NodeID), string(b), clientv3.WithLease(lease))).
		Else(clientv3.OpPut(cl.key("nodes", cl.cfg.NodeID), string(b), clientv3.WithLease(lease)),
			clientv3.OpPut(cl.key("alloc", cl.cfg.NodeID), string(ab), clientv3.WithLease(lease))).Commit()
	if err != nil {
		return err
	}
	if cl.cfg.LeaseFile != "" {
		_ = os.WriteFile(cl.cfg.LeaseFile, []byte(fmt.Sprintf("%x\n", int64(lease))), 0o600)
	}
	cl.epoch.Store(int64(lease))
	cl.fenced.Store(false)
	cl.log.Info("cluster: node registered", "epoch", fmt.Sprintf("%x", int64(lease)), "ttl", cl.cfg.TTL)
	return nil
}

func (cl *Cluster) info(ctx context.Context) (*NodeInfo, error) {
	tpls, err := cl.cfg.Local.Templates(ctx)
	if err != nil {
		return nil, err
	}
	return &NodeInfo{ID: cl.cfg.NodeID, URL: cl.cfg.URL, Capacity: cl.cfg.Capacity, Runsc: cl.cfg.Runsc,
		CPUClass: cl.cfg.CPUClass, Templates: tpls, Builtins: cl.cfg.Builtins, Started: time.Now().UTC()}, nil
}

// renew keeps the lease alive. The fencing deadline is a TTL after the moment the last
// successful renewal was sent: etcd received it later, so its expiry is never before ours.
func (cl *Cluster) renew(ctx context.Context) {
	for ctx.Err() == nil {
		lease := clientv3.LeaseID(cl.epoch.Load())
		if lease == 0 {
			// Fenced: come back under a new epoch once etcd answers.
			rctx, cancel := context.WithTimeout(ctx, cl.cfg.TTL)
			err := cl.register(rctx)
			cancel()
			if err != nil {
				if !sleep(ctx, cl.cfg.TTL/5) {
					return
				}
				continue
			}
			cl.kickSync()
			continue
		}
		lastOK, holding := time.Now(), false
		for ctx.Err() == nil {
			// A slow answer still counts from when it was sent: wait for it up to a quarter TTL
			// (then try again, up to the deadline).
			deadline := lastOK.Add(cl.cfg.TTL)
			if time.Now().After(deadline) && cl.holdWithoutQuorum(lastOK, holding) {
				// etcd has no leader, so no lease can expire: keep the sandboxes (quorum.go).
				if !holding {
					holding = true
					cl.log.Warn("cluster: lease renewal overdue, but etcd has no leader: keeping this node's sandboxes", "grace", cl.cfg.QuorumGrace)
				}
				deadline = time.Now().Add(cl.cfg.ProbeInterval)
			}
			step := time.Until(deadline)
			if step <= 0 {
				cl.fence(ctx, "the node could not renew its lease for "+time.Since(lastOK).Round(time.Millisecond).String())
				break
			}
			sent := time.Now()
			// Short attempts: one sent to a leader that has just died hangs, and only a fresh
			// one hears "no leader" from a member that noticed.
			kctx, cancel := context.WithTimeout(clientv3.WithRequireLeader(ctx), min(step, max(cl.cfg.TTL/4, 100*time.Millisecond)))
			_, err := cl.c.KeepAliveOnce(kctx, lease)
			cancel()
			if ctx.Err() == nil {
				cl.noteStore(err)
			}
			if err == nil {
				holding = false
				lastOK = sent
				if !sleep(ctx, time.Until(sent.Add(cl.cfg.TTL/3))) {
					return
				}
				continue
			}
			if errors.Is(err, rpctypes.ErrLeaseNotFound) {
				cl.fence(ctx, "the node's lease expired")
				break
			}
			if ctx.Err() != nil {
				return
			}
			// Unreachable: try again soon, until the deadline.
			sleep(ctx, min(200*time.Millisecond, time.Until(deadline)))
		}
	}
}

// fence stops the node serving: its epoch is over, so every sandbox it holds is killed (the
// cluster will mark them lost, or has already, and may have placed their ids elsewhere).
func (cl *Cluster) fence(ctx context.Context, reason string) {
	old := cl.epoch.Swap(0)
	cl.fenced.Store(true)
	cl.fences.Add(1)
	cl.log.Error("cluster: fenced: killing every sandbox of this node", "reason", reason, "epoch", fmt.Sprintf("%x", old))
	if cl.cfg.LeaseFile != "" {
		_ = os.Remove(cl.cfg.LeaseFile)
	}
	sbxs, err := cl.cfg.Local.Sandboxes(ctx)
	if err != nil {
		cl.log.Error("cluster: fence: list sandboxes", "err", err)
	}
	for _, s := range sbxs {
		if err := cl.cfg.Local.Kill(ctx, s.ID); err != nil {
			cl.log.Error("cluster: fence: kill", "sandbox_id", s.ID, "err", err)
		}
	}
	if cl.cfg.OnFence != nil {
		cl.cfg.OnFence(reason)
	}
}

func sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

func (cl *Cluster) kickSync() {
	select {
	case cl.kick <- struct{}{}:
	default:
	}
}
