package sandbox

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ember-sandbox/ember/internal/admission"
	"github.com/ember-sandbox/ember/internal/datadir"
	"github.com/ember-sandbox/ember/internal/envdclient"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/overlayfs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

// Slot is a network slot as the Manager needs it.
type Slot struct {
	Index     int
	NetNSPath string
	GuestIP   netip.Addr
}

// Network hands out single-use network slots (internal/network implements it).
type Network interface {
	Acquire(ctx context.Context, egress Egress) (Slot, error)
	Adopt(index int, egress Egress) (Slot, error)
	Release(ctx context.Context, index int) error
	Reconcile(ctx context.Context, keep []int) error
}

// Store persists records (internal/store implements it).
type Store interface {
	PutSandbox(ctx context.Context, sb *Sandbox) error
	GetSandbox(ctx context.Context, id string) (*Sandbox, error)
	DeleteSandbox(ctx context.Context, id string) error
	ListSandboxes(ctx context.Context) ([]*Sandbox, error)
	PutTemplate(ctx context.Context, t *Template) error
	GetTemplate(ctx context.Context, id string) (*Template, error)
	DeleteTemplate(ctx context.Context, id string) error
	ListTemplates(ctx context.Context) ([]*Template, error)
	// Step checkpoints (checkpoints.go).
	PutCheckpoint(ctx context.Context, c *Checkpoint) error
	DeleteCheckpoint(ctx context.Context, sandboxID, id string) error
	ListCheckpoints(ctx context.Context, sandboxID string) ([]*Checkpoint, error)
}

// RootFSBuilder writes template root filesystems (internal/template implements it).
type RootFSBuilder interface {
	// BuildRootFS writes the rootfs req asks for (a Debian suite, an image, ...) to dest and
	// returns what the source says about running it (an image's config).
	BuildRootFS(ctx context.Context, req BuildRequest, dest string, progress func(string)) (RootFSInfo, error)
}

// RootFSInfo is what a rootfs source says about running it.
type RootFSInfo struct {
	Env      map[string]string // default environment of every process
	User     string            // default user ("" = "user")
	Workdir  string            // default working directory ("" = the user's home)
	StartCmd string            // start command when the build request gives none
	// Lowers are the read-only layers (top first) the rootfs written to dest stacks on; empty
	// when dest is the whole rootfs.
	Lowers []string
}

// LayerCollector is a RootFSBuilder that keeps shared layers (optional): CollectLayers removes
// those not in keep (every directory a template's or sandbox's stack names) and returns what it
// removed. The Manager calls it only while no build is in flight.
type LayerCollector interface {
	CollectLayers(ctx context.Context, keep []string) ([]string, error)
}

// ImageStore keeps checkpoint images of named snapshots durably (internal/snapshot).
// Optional: without it, snapshot images stay in the data directory only.
type ImageStore interface {
	Save(ctx context.Context, id, srcDir string) error
	// Exists reports whether stored image id is complete in the store.
	Exists(ctx context.Context, id string) (bool, error)
	// Adopt marks dir, a node-local copy of the image stored as id (the capture it was saved
	// from), as a complete and verified copy, so Fetch into dir loads nothing.
	Adopt(ctx context.Context, id, dir string) error
	// Collect removes stored data no image uses any more (the chunks of deleted or abandoned
	// uploads) where that is safe; a store shared with other nodes may leave it for later.
	Collect(ctx context.Context) error
	// Fetch makes destDir a complete, verified copy of stored image id, loading it only if it
	// is not one already; concurrent Fetches of one destination share one load. unpack turns
	// the stored files (srcDir) into the image (dstDir, which it creates).
	Fetch(ctx context.Context, id, destDir string, unpack func(ctx context.Context, srcDir, dstDir string) error) error
	Delete(ctx context.Context, id string) error
}

// Config of a Manager.
type Config struct {
	DataDir  string
	Driver   runtime.Driver
	Network  Network
	Store    Store
	Builder  RootFSBuilder
	Images   ImageStore // optional
	Logger   *slog.Logger
	EnvdPath string // envd inside the rootfs
	// EgressCA is the PEM certificate of the node's egress CA, installed in sandboxes with
	// network rules (egressca.go).
	EgressCA []byte
	// VolumeDir, when set, is the host directory of volume id on this node, used at every
	// launch instead of the HostDir a sandbox recorded (a cluster's volumes are at a path of
	// each node's own: a fork child or a paused sandbox moved from another node mounts them
	// here). Nil: the recorded HostDir.
	VolumeDir func(id string) string
	// EnvdTimeout bounds the wait for envd after a boot or restore.
	EnvdTimeout time.Duration
	// PoolSize is the least number of restored, unassigned sandboxes kept per template
	// (0 disables the pool). The pool grows above it with demand (the observed create rate
	// times the time a refill takes, and the bursts seen lately: poolsize.go), up to PoolMax
	// per template and PoolMemoryMB in all.
	PoolSize int
	// PoolMax bounds one template's pool (default 64). PoolMemoryMB bounds the memory all pool
	// instances may use (default an eighth of the host's memory), each counted at its measured
	// idle cost, or at PoolInstanceMB (default 32) until one is measured.
	PoolMax, PoolMemoryMB, PoolInstanceMB int
	// PoolRefills bounds the pool refills run at once while no create is in flight (default
	// the number of CPUs; one while creates are in flight).
	PoolRefills int
	// PoolRefillWeight is the CPU weight restored-pool refills run at against the node's
	// sandboxes (cgroup v2 units; sandboxes have 100; default 10; -1 = the sandboxes' weight,
	// restored in one step). A lowered instance gets the normal weight when a create takes it.
	PoolRefillWeight int
	// PrestartSize is the least number of pre-started instances (created by the runtime with a
	// template image's layer and a network slot, restored into on demand) kept per template;
	// PrestartMax bounds them per template (0 disables them, as does a driver without
	// runtime.Prestarter). They follow the rate of creates the restored pool cannot serve and
	// share PoolMemoryMB, counted at PrestartInstanceMB each (default 16).
	PrestartSize, PrestartMax, PrestartInstanceMB int
	// PoolDecay is how fast the observed create rate fades when creates stop (default 30 s).
	PoolDecay time.Duration
	// Default resources of a sandbox.
	CPUCount int
	MemoryMB int
	DiskMB   int
	// MaxSandboxes caps the running sandboxes (pool instances included) of this node
	// (default 500). A create over it whose context carries an admission.Ticket waits in the
	// node's fair admission queue for its ticket's time (admit); other launches (forks,
	// resumes, the pools) and creates whose wait passes fail with ErrExhausted (429).
	MaxSandboxes int
	// MaxQueued bounds the creates waiting for room (default admission.DefaultMaxWaiters).
	MaxQueued int
	// MaxStarting, when set, bounds the instances being booted or restored at once, up to
	// envd's answer to /init (0: no bound). Pre-starts and running instances do not count.
	// Measured on 2 cores with 100 creates at once, a bound of 8 did not raise the throughput
	// (the restores are not CPU-bound alone), so the default stays unbounded.
	MaxStarting int
	// DrainTimeout bounds how long Close waits for operations in flight before it cancels them
	// (default 10 s).
	DrainTimeout time.Duration
	// TombstoneTTL is how long a sandbox that ended stays known, so that calls to it say why it
	// is gone (default 10 minutes).
	TombstoneTTL time.Duration
	// Dial reaches envd inside sandboxes (default: a net.Dialer). Tests over fake drivers set it.
	Dial func(ctx context.Context, network, addr string) (net.Conn, error)
	// Fail, when set, is asked at named points of a launch whether to fail there (tests).
	Fail func(point string) error
	// Observer is told the duration and outcome of every lifecycle stage (metrics); nil = none.
	Observer Observer
	// UploadRetryDelay is the wait before the first retry of a failed snapshot upload (default
	// 2 s; it doubles for each further attempt, UploadAttempts in all, default 3).
	UploadRetryDelay time.Duration
	UploadAttempts   int
	// Listeners are told every lifecycle event (events.go); Manager.Listen adds more.
	Listeners []Listener
	// StorePauses: a memory pause answers once its image is in the image store too
	// (EventStored), so that another node can resume the sandbox (cluster mode); only once a
	// listener is there to record it.
	StorePauses bool
	// PauseMode is how a memory pause pauses (hotpause.go): PauseHot (default) freezes the
	// sandbox in place and keeps its instance; PauseCheckpoint checkpoints it and ends its
	// instance (every pause before).
	PauseMode string
	// PausedMemoryMB bounds the memory of the sandboxes paused in memory (default a quarter of
	// the host's memory; negative: none stays in memory once its state is on disk). Over it, the
	// least recently paused are demoted to disk first.
	PausedMemoryMB int
	// HotPauseMax is how long a sandbox stays paused in memory before it is demoted to disk
	// (default 10 minutes).
	HotPauseMax time.Duration
	// PausedReduceAfter is how long a sandbox stays paused in memory, its state on disk, before
	// its instance gives back the memory it no longer uses (0 = DefaultPausedReduceAfter).
	PausedReduceAfter time.Duration
}

// Manager owns every sandbox on this node. It implements Service.
type Manager struct {
	cfg    Config
	log    *slog.Logger
	client *http.Client
	// initClient sends envd's /init (envdinit.go) for launches outside the guest transports.
	initClient *http.Client
	guestT     *guestTransports
	// guest sends requests through the sandboxes' own transports (guestT): the connections it
	// leaves idle serve the sandbox's next requests.
	guest *http.Client

	mu   sync.Mutex
	live map[string]*entry // sandboxes by id: running, paused, and recently ended (tombstones)

	// ls are the lifecycle listeners (events.go); lmu serialises their changes.
	ls  atomic.Pointer[[]Listener]
	lmu sync.Mutex

	pool      *pool // restored sandboxes waiting for an assignment
	prestarts *pool // pre-started instances waiting for a restore into them
	// firstReqs: sandboxes created lately whose first request has not finished; refills wait
	// for them (firstreq.go).
	firstReqs firstRequests
	// resumePre counts the instances pre-started for the resume of a paused sandbox
	// (entry.pre), which share the pools' memory budget.
	resumePre atomic.Int32
	preOf     map[string]string // sandbox id -> template id of each entry.pre (under mu)
	faults    *faults
	names     map[string]bool // template and snapshot names being written (reserveName)
	// gcMu serialises layer collections with the start of builds; gcBuilds counts the builds
	// in flight, gcPending a collection asked for while there were some (layers.go).
	gcMu      sync.Mutex
	gcBuilds  int
	gcPending bool
	// builtins builds the node's built-in templates on first use (SetBuiltins).
	builtins atomic.Pointer[Builtins]
	// instances are the running instances (sandboxes, pool, warm-ups, launches in flight),
	// counted against MaxSandboxes.
	instances map[string]bool
	// admission is the queue of creates waiting for room under MaxSandboxes (launch.go).
	admission *admission.Queue
	// starting holds a token per instance being booted or restored (launch.go, MaxStarting);
	// nil: no bound.
	starting chan struct{}
	// uploads are the snapshot uploads in flight, by snapshot id (snapupload.go).
	uploads    map[string]*upload
	collectDue bool // a snapshot was deleted: collect unused chunks once no upload runs

	// bg is the context of background work (pool, watchers, reaper); Close cancels it.
	bg       context.Context
	cancelBG context.CancelFunc
	stop     chan struct{}
	wg       sync.WaitGroup

	// Operations in flight (ops) and the context that aborts them once Close's drain bound
	// passes.
	opMu     sync.RWMutex
	closing  bool
	inflight atomic.Int32
	ops      sync.WaitGroup
	abort    context.Context
	abortFn  context.CancelFunc

	// forkCopies: forks copy the source's layer into each child (ForkCopiesLayers).
	forkCopies atomic.Bool
	// noStandby: no rollback standbys are built (CheckpointStandby); standbyMB is the memory
	// the standbys hold, in the pools' budget (standby.go).
	noStandby atomic.Bool
	standbyMB atomic.Int64

	// tierKick wakes the tier loop (hotpause.go) after a sandbox was paused in memory.
	tierKick chan struct{}
}

// entry is the in-memory state of one sandbox; mu serialises lifecycle operations on it.
type entry struct {
	mu sync.Mutex
	sb *Sandbox
	// pre is, for a paused sandbox, an instance pre-started with its pause image's layer
	// (moved in; a discard gives it back) for its resume to restore into (prestart.go).
	pre *Placement
	// released, after a pause, is closed once the paused instance is torn down and its layer is
	// in the pause image (nil when nothing is pending); see settleLocked.
	released chan struct{}
	// standby is an instance restored ahead from the sandbox's head checkpoint and frozen, for
	// a rollback to swap in; standbyGen counts what makes a standby being built stale, and
	// standbyStop/standbyDone cancel and wait for the one being built, of checkpoint
	// standbyCkpt. smu guards them (standby.go): the build never takes mu.
	smu         sync.Mutex
	standby     *standby
	standbyGen  uint64
	standbyStop context.CancelFunc
	standbyDone chan struct{}
	standbyCkpt string
	// hot is set while the sandbox is paused in memory: its instance frozen (hotpause.go).
	hot *hotState
}

var idRe = regexp.MustCompile(`^[a-z0-9]{1,64}$`)
var nameRe = regexp.MustCompile(`^[a-z0-9][a-z0-9_.-]{0,62}$`)

// New creates a Manager and reconciles what the store says with what really runs.
func New(ctx context.Context, cfg Config) (*Manager, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.EnvdTimeout == 0 {
		cfg.EnvdTimeout = 20 * time.Second
	}
	if cfg.EnvdPath == "" {
		cfg.EnvdPath = "/usr/local/bin/envd"
	}
	if cfg.CPUCount == 0 {
		cfg.CPUCount = 2
	}
	if cfg.MemoryMB == 0 {
		cfg.MemoryMB = 1024
	}
	if cfg.DiskMB == 0 {
		cfg.DiskMB = 2048
	}
	if cfg.PoolDecay == 0 {
		cfg.PoolDecay = 30 * time.Second
	}
	if cfg.PoolMax == 0 {
		cfg.PoolMax = 64
	}
	if cfg.PoolMemoryMB == 0 {
		cfg.PoolMemoryMB = defaultPoolMemoryMB()
	}
	if cfg.PoolInstanceMB == 0 {
		cfg.PoolInstanceMB = 32
	}
	if cfg.PrestartInstanceMB == 0 {
		cfg.PrestartInstanceMB = 16
	}
	if cfg.PrestartMax > 0 && cfg.PrestartSize > cfg.PrestartMax {
		cfg.PrestartMax = cfg.PrestartSize
	}
	if cfg.MaxSandboxes == 0 {
		cfg.MaxSandboxes = 500
	}
	if cfg.DrainTimeout == 0 {
		cfg.DrainTimeout = 10 * time.Second
	}
	if cfg.TombstoneTTL == 0 {
		cfg.TombstoneTTL = 10 * time.Minute
	}
	if cfg.Observer == nil {
		cfg.Observer = nopObserver{}
	}
	if cfg.UploadRetryDelay == 0 {
		cfg.UploadRetryDelay = 2 * time.Second
	}
	if cfg.UploadAttempts == 0 {
		cfg.UploadAttempts = 3
	}
	switch cfg.PauseMode {
	case "":
		cfg.PauseMode = PauseHot
	case PauseHot, PauseCheckpoint:
	default:
		return nil, fmt.Errorf("pause mode %q: want %q or %q: %w", cfg.PauseMode, PauseHot, PauseCheckpoint, errdefs.ErrInvalid)
	}
	if cfg.PausedMemoryMB == 0 {
		cfg.PausedMemoryMB = 2 * defaultPoolMemoryMB() // an eighth of the host's, twice
	}
	if cfg.PausedReduceAfter <= 0 {
		cfg.PausedReduceAfter = DefaultPausedReduceAfter
	}
	if cfg.HotPauseMax == 0 {
		cfg.HotPauseMax = 10 * time.Minute
	}
	// The data directory holds every sandbox's files and memory images: root only.
	if err := os.MkdirAll(cfg.DataDir, 0o700); err != nil {
		return nil, err
	}
	if err := os.Chmod(cfg.DataDir, 0o700); err != nil {
		return nil, err
	}
	for _, d := range []string{datadir.Sandboxes(cfg.DataDir), datadir.Templates(cfg.DataDir), datadir.Images(cfg.DataDir)} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, err
		}
	}
	if cfg.Dial == nil {
		cfg.Dial = (&net.Dialer{Timeout: 3 * time.Second, KeepAlive: 30 * time.Second}).DialContext
	}
	m := &Manager{
		cfg: cfg,
		log: cfg.Logger,
		// envd health and /init calls: no keep-alive, so a connection to a slot's address never
		// outlives the sandbox that had it (slots and their addresses are reused).
		client: &http.Client{Transport: &http.Transport{DialContext: cfg.Dial, DisableKeepAlives: true}},
		// /init: connection failures marked, so they can be retried (envdinit.go).
		initClient: &http.Client{Transport: &http.Transport{DialContext: markDials(cfg.Dial), DisableKeepAlives: true}},
		guestT:     newGuestTransports(launchDials(cfg.Dial), envdclient.Port),
		live:       map[string]*entry{},
		stop:       make(chan struct{}),
		faults:     &faults{fail: cfg.Fail},
		instances:  map[string]bool{},
		admission:  admission.New(admission.Options{MaxWaiters: cfg.MaxQueued}),
		preOf:      map[string]string{},
		uploads:    map[string]*upload{},
		tierKick:   make(chan struct{}, 1),
	}
	m.guest = &http.Client{Transport: m.guestT}
	if cfg.MaxStarting > 0 {
		m.starting = make(chan struct{}, cfg.MaxStarting)
	}
	if len(cfg.Listeners) > 0 {
		ls := append([]Listener(nil), cfg.Listeners...)
		m.ls.Store(&ls)
	}
	// Step layers a crash left staged (never committed under their key).
	staged, _ := filepath.Glob(filepath.Join(datadir.Layers(cfg.DataDir), ".tmp-step-*"))
	for _, d := range staged {
		overlayfs.RemoveTree(d, overlayfs.DetachMounts)
	}
	m.sweepTemporaries()
	// Rootfs trees a crash left half composed, and template directories left empty by a first
	// build that never finished.
	halves, _ := filepath.Glob(filepath.Join(datadir.Templates(cfg.DataDir), "*", "rootfs-*.tmp"))
	for _, d := range halves {
		overlayfs.RemoveTree(d, overlayfs.DetachMounts)
	}
	if dirs, err := os.ReadDir(datadir.Templates(cfg.DataDir)); err == nil {
		for _, d := range dirs {
			os.Remove(filepath.Join(datadir.Templates(cfg.DataDir), d.Name())) // only when empty
		}
	}
	m.bg, m.cancelBG = context.WithCancel(context.Background())
	m.abort, m.abortFn = context.WithCancel(context.Background())
	m.pool, m.prestarts = newPool(m, kindRestored), newPool(m, kindPrestarted)
	m.pool.other, m.prestarts.other = m.prestarts, m.pool
	if err := m.reconcile(ctx); err != nil {
		m.cancelBG()
		m.wg.Wait()
		return nil, fmt.Errorf("reconcile: %w", err)
	}
	if err := m.reconcileCheckpoints(ctx); err != nil { // checkpoints.go
		m.cancelBG()
		m.wg.Wait()
		return nil, fmt.Errorf("reconcile checkpoints: %w", err)
	}
	m.collectLayers(ctx, "start")
	m.wg.Add(1)
	go m.reaper()
	m.wg.Add(1)
	go m.tierLoop()
	m.pool.start()
	m.prestarts.start()
	return m, nil
}

// Close stops the Manager gracefully: no new operations are accepted, those in flight get
// DrainTimeout to finish (then they are cancelled and roll back), background work stops,
// unassigned pool instances are destroyed, and running and paused sandboxes are left for the
// next start to adopt.
func (m *Manager) Close() {
	m.opMu.Lock()
	m.closing = true
	m.opMu.Unlock()
	drained := make(chan struct{})
	go func() { m.ops.Wait(); close(drained) }()
	select {
	case <-drained:
	case <-time.After(m.cfg.DrainTimeout):
		m.log.Warn("shutdown: operations still in flight after the drain bound; cancelling them", "bound", m.cfg.DrainTimeout)
		m.abortFn()
		<-drained
	}
	close(m.stop)
	m.cancelBG()
	pooled := m.pool.close() + m.prestarts.close()
	m.wg.Wait()
	pooled += m.dropAllPre()
	pooled += m.dropAllStandbys() // standby.go
	m.abortFn()
	m.closeForkLayers()
	running, paused := 0, 0
	m.mu.Lock()
	for _, e := range m.live {
		switch e.sb.State {
		case StateRunning:
			running++
		case StatePaused:
			paused++
		}
	}
	m.mu.Unlock()
	m.log.Info("shutdown: left sandboxes for the next start", "running", running, "paused", paused, "pool_instances_destroyed", pooled)
}

// busy reports whether a create or other operation is in flight.
func (m *Manager) busy() bool {
	return m.inflight.Load() > 0
}

// op registers an operation in flight. It fails once Close has begun; the returned context is
// cancelled when Close gives up waiting. Call done when the operation ends.
func (m *Manager) op(ctx context.Context) (context.Context, func(), error) {
	m.opMu.RLock()
	if m.closing {
		m.opMu.RUnlock()
		return nil, nil, fmt.Errorf("ember is shutting down: %w", errdefs.ErrUnavailable)
	}
	m.ops.Add(1)
	m.inflight.Add(1)
	m.opMu.RUnlock()
	ctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(m.abort, cancel)
	return ctx, func() {
		stop()
		cancel()
		m.inflight.Add(-1)
		m.ops.Done()
	}, nil
}

func randomHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

const idAlphabet = "abcdefghijklmnopqrstuvwxyz0123456789"

// newID returns a 20-character sandbox id of [a-z0-9] starting with a letter.
func newID() string {
	b := make([]byte, 20)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	for i := range b {
		b[i] = idAlphabet[int(b[i])%len(idAlphabet)]
	}
	b[0] = idAlphabet[int(b[0])%26]
	return string(b)
}

// instanceID names a runtime instance: the 20-char sandbox id plus a generation, fixed length.
func instanceID(sandboxID string) string { return sandboxID + "-" + randomHex(2) }

func (m *Manager) sandboxDir(id string) string {
	return datadir.Sandbox(m.cfg.DataDir, id)
}
func (m *Manager) layersDir() string { return datadir.Layers(m.cfg.DataDir) }
func (m *Manager) importDir() string { return datadir.Imports(m.cfg.DataDir) }

func copyMap(in map[string]string) map[string]string {
	if in == nil {
		return nil
	}
	out := make(map[string]string, len(in))
	for k, v := range in {
		out[k] = v
	}
	return out
}

func (m *Manager) logger(id string) *slog.Logger { return m.log.With("sandbox_id", id) }

// ---- lookup ----

func (m *Manager) entry(id string) (*entry, error) {
	if !idRe.MatchString(id) {
		return nil, fmt.Errorf("sandbox %q: %w", id, errdefs.ErrNotFound)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	e, ok := m.live[id]
	if !ok {
		return nil, fmt.Errorf("sandbox %q: %w", id, errdefs.ErrNotFound)
	}
	return e, nil
}

// GoneError is the error for calls to a sandbox that ended: it says why and when. It is an
// errdefs.ErrNotFound.
type GoneError struct {
	ID     string
	Reason string // EndKilled, EndTimeout, runtime.ExitOOM, ...
	At     time.Time
}

func (e *GoneError) Error() string {
	return fmt.Sprintf("sandbox %q is not running: %s at %s", e.ID, e.Reason, e.At.Format(time.RFC3339))
}

// Is makes a GoneError an errdefs.ErrNotFound.
func (e *GoneError) Is(target error) bool { return target == errdefs.ErrNotFound }

func goneErr(sb *Sandbox) error {
	reason := sb.EndReason
	if reason == "" {
		reason = EndKilled
	}
	return &GoneError{ID: sb.ID, Reason: reason, At: sb.EndedAt}
}

// runningLocked returns nil if e's sandbox runs, else the error a caller gets.
func runningLocked(e *entry) error {
	switch e.sb.State {
	case StateRunning:
		return nil
	case StateKilled:
		return goneErr(e.sb)
	}
	return fmt.Errorf("sandbox %q is %s: %w", e.sb.ID, e.sb.State, errdefs.ErrConflict)
}

func (m *Manager) snapshotOf(e *entry) *Sandbox {
	c := *e.sb
	c.Metadata = copyMap(e.sb.Metadata)
	c.EnvVars = copyMap(e.sb.EnvVars)
	return &c
}

// Get returns a sandbox. A sandbox that ended answers ErrNotFound with the reason.
func (m *Manager) Get(ctx context.Context, id string) (*Sandbox, error) {
	e, err := m.entry(id)
	if err != nil {
		return nil, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.sb.State == StateKilled {
		return nil, goneErr(e.sb)
	}
	return m.snapshotOf(e), nil
}

// ---- guest access, metrics ----

// GuestURL returns the base URL of a port inside a running sandbox.
func (m *Manager) GuestURL(ctx context.Context, id string, port int) (string, error) {
	if port <= 0 || port > 65535 {
		return "", fmt.Errorf("port %d: %w", port, errdefs.ErrInvalid)
	}
	e, err := m.entry(id)
	if err != nil {
		return "", err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.sb.State == StatePaused && e.sb.AutoResume && !e.sb.PausedFilesOnly && mayWake(ctx, e.sb) {
		// Traffic wakes a sandbox created with autoResume.
		ctx, done, err := m.op(ctx)
		if err != nil {
			return "", err
		}
		defer done()
		timeout := e.sb.Timeout
		if timeout <= 0 {
			timeout = DefaultTimeout
		}
		if err := m.resumeLocked(ctx, e, timeout, false); err != nil {
			return "", err
		}
	}
	if err := runningLocked(e); err != nil {
		return "", err
	}
	scheme := "http://"
	if e.sb.Network != nil && slices.Contains(e.sb.Network.HTTPSPorts, port) {
		scheme = "https://" // network.httpsPorts: the guest's port serves TLS (guest.go)
	}
	return scheme + net.JoinHostPort(e.sb.Runtime.GuestIP, strconv.Itoa(port)), nil
}

// GuestTransport is the transport for requests into sandboxes.
func (m *Manager) GuestTransport() http.RoundTripper { return m.guestT }

// Metrics returns the current resource usage of a running sandbox.
func (m *Manager) Metrics(ctx context.Context, id string) ([]Metric, error) {
	e, err := m.entry(id)
	if err != nil {
		return nil, err
	}
	e.mu.Lock()
	sb := m.snapshotOf(e)
	e.mu.Unlock()
	switch sb.State {
	case StateKilled:
		return nil, goneErr(sb)
	case StatePaused:
		return []Metric{}, nil
	}
	st, err := m.cfg.Driver.Stats(ctx, sb.Runtime.InstanceID)
	if err != nil {
		return nil, err
	}
	pct := 0.0
	if el := time.Since(sb.StartedAt); el > 0 && sb.CPUCount > 0 {
		pct = 100 * float64(st.CPUUsage) / float64(el) / float64(sb.CPUCount)
	}
	total := st.MemoryLimit
	if total == 0 {
		total = uint64(sb.MemoryMB) << 20
	}
	return []Metric{{
		Timestamp:  st.Timestamp,
		CPUCount:   sb.CPUCount,
		CPUUsedPct: pct,
		MemUsed:    st.MemoryBytes,
		MemTotal:   total,
		DiskTotal:  uint64(sb.DiskSizeMB) << 20,
	}}, nil
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
