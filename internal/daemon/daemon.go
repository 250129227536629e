// Package daemon wires ember's parts into the `ember serve` process: the metadata store, API
// keys, the gVisor driver, network slots, the template builder, the snapshot store, the sandbox
// Manager and the HTTP edge. It owns process lifetime (start-up, signals, ordered shutdown) and
// nothing else; every decision lives in the domain packages.
package daemon

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"golang.org/x/net/netutil"

	"github.com/ember-sandbox/ember/internal/api"
	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/cluster/edge"
	"github.com/ember-sandbox/ember/internal/codeinterp"
	"github.com/ember-sandbox/ember/internal/datadir"
	"github.com/ember-sandbox/ember/internal/egress"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/layerfs"
	"github.com/ember-sandbox/ember/internal/metrics"
	"github.com/ember-sandbox/ember/internal/network"
	"github.com/ember-sandbox/ember/internal/quota"
	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/runtime/gvisor"
	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/secret"
	"github.com/ember-sandbox/ember/internal/snapshot"
	"github.com/ember-sandbox/ember/internal/snapshot/local"
	snaps3 "github.com/ember-sandbox/ember/internal/snapshot/s3"
	"github.com/ember-sandbox/ember/internal/store"
	"github.com/ember-sandbox/ember/internal/template"
	"github.com/ember-sandbox/ember/internal/template/build"
	"github.com/ember-sandbox/ember/internal/tlsca"
	"github.com/ember-sandbox/ember/internal/volume"
)

// Config of the daemon.
type Config struct {
	Listen  string // 127.0.0.1:3000
	DataDir string
	// LayerFS is the data directory's filesystem (layerfs.Mode*): "auto" (default) mounts a
	// btrfs image over it when its own filesystem cannot clone files (ext4), so that captures
	// of sandbox layers are O(1); "host" keeps the host's; "btrfs" always uses the image.
	// LayerFSSize is the image's size in bytes (sparse; 0 = the host filesystem's size).
	LayerFS     string
	LayerFSSize int64
	CacheDir    string // debootstrap cache; default <DataDir>/cache
	Runsc       string
	Envd        string // envd binary copied into templates
	Domain      string
	// TLSListen, if set, is a second listener serving the same handler over HTTPS (E2B's Mode B:
	// the SDK builds https://<port>-<id>.<domain>). TLSCert/TLSKey are the operator's PEM pair;
	// without them ember's local CA under <DataDir>/tls issues a certificate for *.<domain>.
	TLSListen, TLSCert, TLSKey string
	PoolSize                   int
	// PoolMax and PoolMemoryMB bound the warm pools, PoolRefills their concurrent refills
	// (0 = the Manager's defaults).
	PoolMax, PoolMemoryMB, PoolRefills int
	// PoolDecay is how fast the pools forget demand (0 = the Manager's default, 30 s);
	// PoolRefillWeight the refills' CPU weight (0 = default 10, -1 = the sandboxes' 100).
	PoolDecay        time.Duration
	PoolRefillWeight int
	// PrestartSize and PrestartMax bound the pre-started instances per template (0 = none).
	PrestartSize, PrestartMax int
	// PauseMode ("hot" or "checkpoint"), PausedMemoryMB and HotPauseMax: how memory pauses
	// pause and how long sandboxes stay paused in memory (sandbox.Config; 0 = its defaults).
	PauseMode      string
	PausedMemoryMB int
	HotPauseMax    time.Duration
	// SentryGCPercent and GoferGCPercent are the Go GC percent (GOGC) of each sandbox's sentry and
	// gofer processes (gvisor.Config.SentryGC, GoferGC); 0 = Go's own (100). No flag sets them:
	// BenchmarkIdleMemory measured 25 against 100 and an idle sandbox was no smaller (its
	// sentry's heap is live data), so they are there for that A/B.
	SentryGCPercent, GoferGCPercent int
	// SlotPoolSize is the number of network slots made ahead of need (-1 = DefaultSlotPoolSize).
	SlotPoolSize int
	// MaxSandboxes and MaxBuilds cap what this node runs at once (0 = the Manager's defaults);
	// MaxConns caps concurrent client connections (0 = 8192).
	MaxSandboxes, MaxBuilds, MaxConns int
	// MaxQueued bounds the creates waiting for room in the admission queue (0 = 1000).
	MaxQueued int
	// MaxStarting bounds the instances booting or restoring at once (0 = no bound).
	MaxStarting int
	// DiskMB is the default disk of a sandbox's writable layer, and the disk of build
	// sandboxes and template warm-ups (0 = the Manager's default, 2048).
	DiskMB int
	// VolumeSizeMB is each new volume's disk limit (0 = volume.DefaultSizeMB).
	VolumeSizeMB int
	// VolumeLimitDir: in a cluster with S3, this node runs on the S3 server's host (versitygw
	// posix, --disableotmp) and holds the volumes' disk limits in this directory of its
	// backend, <bucket>/<prefix>volumes (volume.Config.LimitDir).
	VolumeLimitDir string
	// Templates built at start-up when missing (e.g. "base").
	Templates []string
	// Snapshot store: local directory by default; S3 when S3.Endpoint is set.
	S3 snaps3.Config
	// SnapshotKeyFile holds the key that signs snapshot manifests (default
	// <DataDir>/snapshot-key, created on first start); the nodes of a cluster share one.
	SnapshotKeyFile string
	// NodeID names this node. Every node-local name (netns and veth prefix, nftables table,
	// interface group, cgroup parent) is derived from it, so several nodes can share one host.
	// Empty = the single-node defaults.
	NodeID string
	// EtcdEndpoints, when set, make this node one of a cluster (internal/cluster): membership
	// under a lease of ClusterTTL (default 10 s), placement, routing and API keys in etcd.
	// AdvertiseURL is the URL the other nodes reach this one at (default http://<Listen>).
	EtcdEndpoints []string
	AdvertiseURL  string
	ClusterTTL    time.Duration
	// ClusterQuorumGrace: how long a node keeps its sandboxes past its TTL while etcd has no
	// leader (cluster.Config.QuorumGrace).
	ClusterQuorumGrace time.Duration
	// ClusterSecretFile holds the secret that signs requests between nodes (empty = the
	// cluster's own, kept in etcd).
	ClusterSecretFile string
	// EtcdCA, EtcdCert and EtcdKey: the CA that signed etcd's certificate, and this node's
	// client certificate and key (PEM; `ember cluster certs`). EtcdInsecure allows plain http
	// endpoints, an etcd without client certificate auth, and no ClusterKeyFile.
	EtcdCA, EtcdCert, EtcdKey string
	EtcdInsecure              bool
	// ClusterKeyFile holds the cluster sealing key (64 hex digits, the same on every node): the
	// secrets ember keeps in etcd are sealed with it (cluster.SealKey).
	ClusterKeyFile string
	// Network CIDR for sandbox slots.
	CIDR   string
	Mirror string
	// RegistryAllow lists the image registries (host[:port]; a host alone: any port) that may
	// be on a loopback, private, link-local or metadata address (image.Resolver.Allow).
	RegistryAllow []string
	Logger        *slog.Logger
	// Out receives the lines a user reads: the API key on first start, template build progress.
	Out io.Writer

	// MetricsListen, if set, is a listener serving only GET /metrics, without an API key (for
	// a scraper on a private network). /metrics on Listen needs the API key.
	MetricsListen string

	// layerFS is the data directory's layer filesystem when Serve chose it already (before
	// it wrote the TLS CA there); nil: Open chooses it.
	layerFS *layerfs.Result
}

// Node is a running ember node.
type Node struct {
	Manager *sandbox.Manager
	// Builds runs the node's template builds (internal/template/build).
	Builds  *build.Manager
	Driver  runtime.Driver
	Keys    *auth.Keys
	Store   *store.Store
	Handler http.Handler
	Metrics *metrics.Metrics
	// LayerFS says what holds the data directory (a loop-mounted btrfs image, or the host's).
	LayerFS layerfs.Result
	// Cluster is this node's membership (nil for a single node).
	Cluster *cluster.Cluster
	net     *network.Manager
	egress  *egress.Proxy

	moves   *cluster.Moves // stored paused sandboxes (cluster mode with S3)
	volumes *volume.Manager
	// startup builds the start-up templates (nil: none left to build, or built by open).
	startup func(context.Context) error
}

// DefaultSlotPoolSize is how many network slots a node keeps made ahead of need.
const DefaultSlotPoolSize = 16

// Open assembles a node from cfg, its start-up templates built: everything but the listener.
func Open(ctx context.Context, cfg Config) (*Node, error) {
	n, err := open(ctx, cfg)
	if err != nil {
		return nil, err
	}
	if n.startup != nil {
		if err := n.startup(ctx); err != nil {
			n.Close()
			return nil, err
		}
	}
	return n, nil
}

// open assembles a node from cfg; its start-up templates are built by n.startup (startup.go).
func open(ctx context.Context, cfg Config) (*Node, error) {
	cfg.defaults()
	lfs := cfg.layerFS
	if lfs == nil {
		r, err := setupDataDir(cfg)
		if err != nil {
			return nil, err
		}
		lfs = &r
	}
	st, err := store.Open(datadir.DB(cfg.DataDir))
	if err != nil {
		return nil, err
	}
	ok := false
	defer func() {
		if !ok {
			st.Close()
		}
	}()
	keys := auth.NewKeys(st)
	if len(cfg.EtcdEndpoints) == 0 {
		if err := ensureKey(ctx, cfg, keys); err != nil {
			return nil, err
		}
	}
	// --allow-suid: sudo works for the default user, as in E2B's base template (the ID elevation stays
	// inside the sandbox's own kernel).
	names, err := NodeNames(cfg.NodeID)
	if err != nil {
		return nil, err
	}
	drv, err := gvisor.New(gvisor.Config{Runsc: cfg.Runsc, Root: datadir.Runsc(cfg.DataDir), FailedLogDir: datadir.FailedLogs(cfg.DataDir), CgroupParent: names.CgroupParent,
		ExtraFlags: []string{"--allow-suid"}, SandboxLogs: os.Getenv("EMBER_RUNSC_LOGS") == "1", Logger: cfg.Logger,
		RunscCLI:      os.Getenv("EMBER_RUNSC_CLI") == "1",
		LayerIdentity: sandbox.LayerIdentity(cfg.DataDir),
		SentryGC:      gvisor.GCConfig{Percent: cfg.SentryGCPercent}, GoferGC: gvisor.GCConfig{Percent: cfg.GoferGCPercent}})
	if err != nil {
		return nil, err
	}
	// Pre-made slots take the netlink work (netns, veth, nftables: 5 ms quiet, 100+ ms for the
	// last of 16 made at once) off the create path, and off a fork's children: as many as one
	// fork into 16 takes (an idle slot is a netns and a veth pair, no process).
	if cfg.SlotPoolSize < 0 {
		cfg.SlotPoolSize = DefaultSlotPoolSize
	}
	secrets, err := secret.Open(st, datadir.SecretsKey(cfg.DataDir), cfg.Logger)
	if err != nil {
		return nil, err
	}
	var nm *network.Manager
	px, pxPort, egressCA, err := startEgressProxy(cfg, names.Table, secrets, func(a netip.Addr) bool { return nm.IsAlwaysDenied(a) })
	if err != nil {
		return nil, err
	}
	defer func() {
		if !ok {
			px.Close()
		}
	}()
	ncfg := network.Config{PoolSize: cfg.SlotPoolSize, Logger: cfg.Logger, ProxyPort: pxPort,
		NamePrefix: names.NetPrefix, Table: names.Table, InternetGroup: names.InternetGroup, HostMark: names.HostMark}
	if cfg.CIDR != "" {
		p, err := parsePrefix(cfg.CIDR)
		if err != nil {
			return nil, err
		}
		ncfg.CIDR = p
	}
	nm, err = network.New(ncfg)
	if err != nil {
		return nil, err
	}
	if err := nm.Init(ctx); err != nil {
		return nil, fmt.Errorf("network: %w", err)
	}
	// Cluster mode: etcd first, authenticated; the snapshot signing key is the cluster's.
	var etcd *clientv3.Client
	var seal *cluster.SealKey
	var snapKey []byte
	etcdOwned := false                        // by the cluster, once joined
	etcdCounters := cluster.NewEtcdCounters() // its requests, in /metrics
	if len(cfg.EtcdEndpoints) > 0 {
		if etcd, seal, err = dialEtcdCounted(ctx, cfg, etcdCounters); err != nil {
			return nil, err
		}
		defer func() {
			if !ok && !etcdOwned {
				etcd.Close()
			}
		}()
		if snapKey, err = clusterSnapshotKey(ctx, cfg, etcd, seal); err != nil {
			return nil, err
		}
	}
	images, err := openImages(cfg, snapKey)
	if err != nil {
		return nil, err
	}
	met := metrics.New()
	var volumeDir func(string) string
	if sharedVolumes(cfg) {
		// A cluster's volumes are at this node's own path (a sandbox made on another node
		// records that node's).
		dir := volume.SharedDir(s3fsConfig(cfg), sharedVolumesMount(cfg))
		volumeDir = func(id string) string { return filepath.Join(dir, id) }
	}
	rootfs := &builderAdapter{dataDir: cfg.DataDir, allow: cfg.RegistryAllow, b: &template.Builder{CacheDir: filepath.Join(cfg.CacheDir, "debootstrap"), EnvdPath: cfg.Envd, Mirror: cfg.Mirror, Suite: "bookworm"}}
	mgr, err := sandbox.New(ctx, sandbox.Config{
		VolumeDir:    volumeDir,
		Observer:     met,
		DataDir:      cfg.DataDir,
		Driver:       drv,
		Network:      &netAdapter{m: nm, px: px, slots: map[int]*network.Slot{}},
		EgressCA:     egressCA,
		Store:        st,
		Builder:      rootfs,
		Images:       images,
		Logger:       cfg.Logger,
		Dial:         network.MarkedDialer(names.HostMark).DialContext,
		PoolSize:     cfg.PoolSize,
		PoolMax:      cfg.PoolMax,
		PoolMemoryMB: cfg.PoolMemoryMB,
		PrestartSize: cfg.PrestartSize,
		PrestartMax:  cfg.PrestartMax,
		// Memory pauses: in place (hot) and for how long, or by a checkpoint.
		PauseMode: cfg.PauseMode, PausedMemoryMB: cfg.PausedMemoryMB, HotPauseMax: cfg.HotPauseMax,
		MaxSandboxes: cfg.MaxSandboxes,
		MaxQueued:    cfg.MaxQueued,
		MaxStarting:  cfg.MaxStarting,
		DiskMB:       cfg.DiskMB,
		// How the pools size themselves and refill.
		PoolRefills: cfg.PoolRefills, PoolDecay: cfg.PoolDecay, PoolRefillWeight: cfg.PoolRefillWeight,
		// Cluster mode with a shared image store: a pause is resumable on any node.
		StorePauses: len(cfg.EtcdEndpoints) > 0 && cfg.S3.Endpoint != "",
	})
	if err != nil {
		return nil, err
	}
	// Templates built on first use: E2B's Code Interpreter (from base, on this mirror).
	builtins := map[string]build.BuiltinTemplate{codeinterp.TemplateName: codeinterp.Template(cfg.Mirror, "bookworm")}
	builds, err := build.New(build.Config{DataDir: cfg.DataDir, Driver: drv, Store: st, Builder: rootfs, Logger: cfg.Logger, MaxBuilds: cfg.MaxBuilds,
		Builtins: builtins,
	}, mgr.BuildHost())
	if err != nil {
		mgr.Close()
		return nil, err
	}
	mgr.SetBuiltins(builds)
	shareTemplates := len(cfg.EtcdEndpoints) > 0 && cfg.S3.Endpoint != ""
	envdSum := envdDigest(cfg.Envd)
	// The start-up templates (cluster mode with a shared image store: after joining, the
	// cluster's build if it has one; startTemplates) are built once the node is open
	// (n.startup: by Open, or by Serve while the API already serves).
	var starting *startup
	if !shareTemplates {
		starting = newStartup(withBase(cfg.Templates, builds.IsBuiltin))
	}
	met.SetSource(mgr)
	acfg := api.Config{Domain: cfg.Domain, Metrics: met.Handler(), Builds: builds}
	if starting != nil {
		acfg.Startup = starting
	}
	var cl *cluster.Cluster
	// quotaSrc is what the teams' quotas count: this node's sandboxes and builds, and the
	// templates it lists (the cluster's when it shares them).
	var quotaSrc quota.Source = mgr
	var moves *cluster.Moves
	if len(cfg.EtcdEndpoints) > 0 {
		if cl, err = openCluster(ctx, cfg, etcd, etcdCounters, seal, mgr, builtins, met.PlacementRetry); err != nil {
			mgr.Close()
			return nil, err
		}
		etcdOwned = true
		// The cluster's keys: one made on any node works on every node.
		keys = auth.NewKeys(cl.Keys())
		// And its secrets: one made through any node resolves at every node's egress.
		if err := secrets.UseCluster(ctx, cl); err != nil {
			cl.Close()
			mgr.Close()
			return nil, fmt.Errorf("secrets: %w", err)
		}
		if err := ensureKey(ctx, cfg, keys); err != nil {
			cl.Close()
			mgr.Close()
			return nil, err
		}
		acfg.Cluster = cl
		met.SetStore(cl)
		var tpls *cluster.Templates
		if shareTemplates {
			tpls = cluster.NewTemplates(cl, mgr)
			quotaSrc = edge.ShareTemplates(mgr, tpls) // the cluster's templates count once
			if err := startTemplates(ctx, cfg, mgr, builds, tpls); err != nil {
				cl.Close()
				mgr.Close()
				return nil, err
			}
			acfg.Templates = tpls
			moves = cluster.NewMoves(cl, mgr)
			acfg.Mover = moves
			acfg.Forker = mgr
		}
		// From now on the cluster follows every change of this node's sandboxes and templates
		// (what changed before, the cluster's sync loop reconciles).
		mgr.Listen(cluster.NewEvents(cl, moves, tpls))
	}
	acfg.Secrets = secrets
	if acfg.Volumes, err = openVolumes(ctx, cfg, st, cl); err != nil {
		if cl != nil {
			cl.Close()
		}
		mgr.Close()
		return nil, err
	}
	_, _, diskMB := mgr.TemplateResources(&sandbox.Template{})
	acfg.Quotas = quota.New(quotaSrc, builds, keys, diskMB) // the teams' quotas, counted on this node
	if cl != nil {
		// ... and all but templates' disk across the cluster, in blocks (cluster/quota.go).
		acfg.Quotas.SetBlocks(cl.NewQuotaBlocks(acfg.Quotas.Held))
	}
	met.SetTeams(acfg.Quotas)
	h := api.New(acfg, mgr, keys, cfg.Logger)
	ok = true
	n := &Node{Manager: mgr, Builds: builds, Driver: drv, Keys: keys, Store: st, Handler: h, Metrics: met, LayerFS: *lfs, Cluster: cl, net: nm, egress: px, moves: moves, volumes: acfg.Volumes}
	if starting != nil {
		n.startup = func(ctx context.Context) error {
			return starting.run(func(name string) error { return buildStartTemplate(ctx, cfg, n, name, envdSum) })
		}
	}
	return n, nil
}

// buildStartTemplate builds start-up template name when it is missing, stale, or built with
// another envd.
func buildStartTemplate(ctx context.Context, cfg Config, n *Node, name, envdSum string) error {
	builds, st := n.Builds, n.Store
	if builds.IsBuiltin(name) {
		// A step build: cached by step, so an unchanged template is not built again.
		fmt.Fprintf(cfg.Out, "Template %q (built in; built when its definition changed)...\n", name)
		if _, err := builds.EnsureBuiltin(ctx, name, func(line string) { fmt.Fprintln(cfg.Out, "  "+line) }); err != nil {
			return fmt.Errorf("build template %q: %w", name, err)
		}
		return nil
	}
	what := "first start only"
	if t, err := st.GetTemplate(ctx, name); err == nil {
		switch {
		case t.Stale():
			// Its checkpoint would not restore under this version: build it again.
			what = "it was built by an older ember"
		case envdChanged(cfg.DataDir, name, t.BuildID, envdSum):
			// Its checkpoint holds another envd (envdstamp.go).
			what = "envd changed since it was built"
		default:
			return nil
		}
	}
	fmt.Fprintf(cfg.Out, "Building template %q (%s)...\n", name, what)
	tpl, err := builds.BuildTemplate(ctx, sandbox.BuildRequest{Name: name}, func(line string) { fmt.Fprintln(cfg.Out, "  "+line) })
	if err != nil {
		return fmt.Errorf("build template %q: %w", name, err)
	}
	if err := stampEnvd(cfg.DataDir, name, tpl.BuildID, envdSum); err != nil {
		cfg.Logger.Warn("envd stamp", "template", name, "err", err)
	}
	return nil
}

// withBase puts base first in names when a built-in template (built from base) is named
// without it.
func withBase(names []string, builtin func(string) bool) []string {
	if slices.Contains(names, "base") || !slices.ContainsFunc(names, builtin) {
		return names
	}
	return append([]string{"base"}, names...)
}

func ensureKey(ctx context.Context, cfg Config, keys *auth.Keys) error {
	plain, created, err := keys.EnsureInitialKey(ctx, cfg.DataDir)
	if err != nil {
		return fmt.Errorf("api key: %w", err)
	}
	if created {
		fmt.Fprintf(cfg.Out, "Created API key (shown once; also in %s):\n  %s\n", datadir.APIKey(cfg.DataDir), plain)
	}
	return nil
}

// Close stops background work. Running sandboxes keep running and are re-adopted by the next
// start on the same data directory.
func (n *Node) Close() {
	n.volumes.Close()
	if n.moves != nil {
		n.moves.Close()
	}
	if n.Cluster != nil {
		n.Cluster.Close()
	}
	n.Builds.Close()
	n.Manager.Close()
	n.egress.Close()
	n.net.Close(context.Background())
	n.Store.Close()
}

// defaults fills in the fields of cfg left empty that have a default.
func (cfg *Config) defaults() {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Out == nil {
		cfg.Out = io.Discard
	}
	if cfg.CacheDir == "" {
		cfg.CacheDir = datadir.Cache(cfg.DataDir)
	}
	if cfg.Mirror == "" {
		cfg.Mirror = "http://deb.debian.org/debian"
	}
}

// setupDataDir creates the data directory and chooses its layer filesystem. It runs before
// anything is written there: a btrfs image is mounted over the data directory only while it
// is empty (layerfs.Setup), so whatever writes into it first (the TLS CA) comes after.
func setupDataDir(cfg Config) (layerfs.Result, error) {
	// Every sandbox's files and memory images live under the data directory: root only.
	if err := os.MkdirAll(cfg.DataDir, 0o700); err != nil {
		return layerfs.Result{}, err
	}
	if err := os.Chmod(cfg.DataDir, 0o700); err != nil {
		return layerfs.Result{}, err
	}
	lfs, err := layerfs.Setup(layerfs.Config{DataDir: cfg.DataDir, Mode: cfg.LayerFS, Size: cfg.LayerFSSize})
	if err != nil {
		return layerfs.Result{}, err
	}
	cfg.Logger.Info(lfs.String(), "layer_fs", lfs.FS, "action", lfs.Action, "image", lfs.Image, "device", lfs.Device, "size", lfs.Size)
	fmt.Fprintln(cfg.Out, strings.ToUpper(lfs.String()[:1])+lfs.String()[1:])
	return lfs, nil
}

// Serve opens a node and serves the API on cfg.Listen until ctx is done.
func Serve(ctx context.Context, cfg Config) error {
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return err
	}
	if cfg.MaxConns <= 0 {
		cfg.MaxConns = 8192
	}
	ln = netutil.LimitListener(ln, cfg.MaxConns)
	defer ln.Close()
	var tlsLn net.Listener
	if cfg.TLSListen != "" {
		if tlsLn, err = net.Listen("tcp", cfg.TLSListen); err != nil {
			return err
		}
		tlsLn = netutil.LimitListener(tlsLn, cfg.MaxConns)
		defer tlsLn.Close()
	} else if cfg.TLSCert != "" || cfg.TLSKey != "" {
		return fmt.Errorf("tls-cert, tls-key: need --tls-listen: %w", errdefs.ErrInvalid)
	}
	if cfg.Domain == "" {
		// <port>-<id>.localhost:<port> reaches host routing without any DNS set-up. With TLS on,
		// the domain names the TLS port: the SDK's sandbox URLs are always https.
		cfg.Domain = "localhost:" + strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
		if tlsLn != nil {
			cfg.Domain = "localhost" + portSuffix(tlsLn.Addr().(*net.TCPAddr).Port)
		}
	}
	var metricsLn net.Listener
	if cfg.MetricsListen != "" {
		if metricsLn, err = net.Listen("tcp", cfg.MetricsListen); err != nil {
			return err
		}
		defer metricsLn.Close()
	}
	cfg.defaults()
	// The layer filesystem first: the local CA below is the first thing written into the
	// data directory (with it there, an empty one is not empty any more).
	lfs, err := setupDataDir(cfg)
	if err != nil {
		return err
	}
	cfg.layerFS = &lfs
	var tlsConf *tls.Config
	if tlsLn != nil {
		// Before Open: a bad certificate fails at once, not after a template build.
		if tlsConf, err = sandboxTLS(cfg, tlsLn.Addr().String()); err != nil {
			return err
		}
	}
	node, err := open(ctx, cfg)
	if err != nil {
		return err
	}
	defer node.Close()
	// The start-up templates build while the API serves: creates of one wait for it, /health
	// answers 503 until they are built, and a failed build stops the daemon as before.
	built := make(chan error, 1)
	if node.startup != nil {
		go func() { built <- node.startup(ctx) }()
	}
	// Bounds for slow or idle clients. No whole-request read or write timeout: sandbox-plane
	// streams (commands, watches, uploads) legitimately last as long as the sandbox.
	srv := &http.Server{
		Handler:           node.Handler,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
		MaxHeaderBytes:    64 << 10,
		ErrorLog:          slog.NewLogLogger(cfg.Logger.Handler(), slog.LevelWarn),
		TLSConfig:         tlsConf,
	}
	srv.Protocols = new(http.Protocols)
	srv.Protocols.SetHTTP1(true)
	srv.Protocols.SetHTTP2(true) // TLS listener, negotiated by ALPN
	srv.Protocols.SetUnencryptedHTTP2(true)
	fmt.Fprintf(cfg.Out, "ember listening on http://%s (data %s)\n", ln.Addr(), cfg.DataDir)
	cfg.Logger.Info("serving", "addr", ln.Addr().String(), "data_dir", cfg.DataDir, "domain", cfg.Domain)
	errc := make(chan error, 3)
	go func() { errc <- srv.Serve(ln) }()
	if tlsLn != nil {
		fmt.Fprintf(cfg.Out, "ember listening on https://%s (Mode B: E2B_DOMAIN=%s; hosts https://api.%[2]s, https://<port>-<id>.%[2]s)\n", tlsLn.Addr(), cfg.Domain)
		cfg.Logger.Info("serving tls", "addr", tlsLn.Addr().String(), "domain", cfg.Domain)
		go func() { errc <- srv.ServeTLS(tlsLn, "", "") }()
	}
	if metricsLn != nil {
		mux := http.NewServeMux()
		mux.Handle("GET /metrics", node.Metrics.Handler())
		fmt.Fprintf(cfg.Out, "ember metrics on http://%s/metrics (no API key)\n", metricsLn.Addr())
		msrv := serveMetrics(metricsLn, mux)
		defer msrv.Close()
	}
	select {
	case err := <-errc:
		return err
	case err := <-built:
		if err != nil && ctx.Err() == nil {
			return err
		}
		select {
		case err := <-errc:
			return err
		case <-ctx.Done():
		}
	case <-ctx.Done():
	}
	// Graceful stop: stop accepting, let requests in flight finish (bounded), then the Manager
	// drains its own operations, destroys the pool and leaves sandboxes for the next start.
	cfg.Logger.Info("shutdown: stopping the API")
	shutCtx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutCtx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	return nil
}

// sandboxTLS is the TLS configuration of the listener at addr: the operator's certificate, or
// one from the local CA under <DataDir>/tls (whose ca.pem is printed for clients to trust).
func sandboxTLS(cfg Config, addr string) (*tls.Config, error) {
	_, port, _ := net.SplitHostPort(addr)
	if _, dport, err := net.SplitHostPort(cfg.Domain); err == nil && dport != port {
		cfg.Logger.Warn("the domain's port is not the TLS port: sandbox URLs https://<port>-<id>."+cfg.Domain+" reach another port", "tls_listen", addr)
	} else if err != nil && port != "443" {
		cfg.Logger.Warn("the domain has no port, so the SDK connects to 443; forward 443 to the TLS listener or use --domain "+cfg.Domain+":"+port, "tls_listen", addr)
	}
	if cfg.TLSCert != "" || cfg.TLSKey != "" {
		f, err := tlsca.LoadFiles(cfg.TLSCert, cfg.TLSKey)
		if err != nil {
			return nil, err
		}
		if !tlsca.Covers(f.Leaf(), cfg.Domain) {
			cfg.Logger.Warn("the TLS certificate does not cover the sandbox hosts", "want", "*."+cfg.Domain, "dns_names", f.Leaf().DNSNames)
		}
		fmt.Fprintf(cfg.Out, "TLS certificate: %s (reloaded when it changes)\n", cfg.TLSCert)
		return tlsca.ServerConfig(f), nil
	}
	l, ch, err := tlsca.NewLocal(tlsca.Options{Dir: datadir.TLS(cfg.DataDir), Domain: cfg.Domain, IPs: tlsca.ListenIPs(addr)})
	if err != nil {
		return nil, err
	}
	if ch.NewCA {
		host, _ := tlsca.HostOf(cfg.Domain)
		fmt.Fprintf(cfg.Out, "Created a local CA for *.%s (clients must trust the new one)\n", host)
	}
	fmt.Fprintf(cfg.Out, "TLS CA: %s (trust it: NODE_EXTRA_CA_CERTS=%[1]s, SSL_CERT_FILE for Python, or the system store)\n", l.CAPath())
	return tlsca.ServerConfig(l), nil
}

func portSuffix(port int) string {
	if port == 443 {
		return ""
	}
	return ":" + strconv.Itoa(port)
}

// Names are the node-local names derived from a node id.
type Names struct {
	NetPrefix     string // netns "<prefix>-<i>", host veth "<prefix><i>h"
	Table         string // nftables table (inet)
	InternetGroup uint32 // interface group of slots allowed internet
	CgroupParent  string // cgroup under which runsc puts each instance
	HostMark      uint32 // SO_MARK of the daemon's sockets to slots (no other host process reaches them)
}

const defaultHostMark = 0x454d0000 // "EM" in the high half; the node's number in the low half

// Node ids have no 'x': it ends the node's name prefix, so no node's prefix is a prefix of
// another's interface names (nodes "c1" and "c11" would both name a veth "ec115h" otherwise).
var nodeIDRe = regexp.MustCompile(`^[a-wyz][a-wyz0-9]{0,5}$`)

// NodeNames derives the node-local names of node id ("" = the single-node defaults).
func NodeNames(id string) (Names, error) {
	if id == "" {
		return Names{NetPrefix: network.DefaultNamePrefix, Table: network.DefaultTable,
			InternetGroup: network.DefaultInternetGroup, CgroupParent: "ember", HostMark: defaultHostMark}, nil
	}
	if !nodeIDRe.MatchString(id) {
		return Names{}, fmt.Errorf("node_id %q: must be 1-6 lowercase letters (but x) and digits, starting with a letter: %w", id, errdefs.ErrInvalid)
	}
	if strings.HasPrefix(id, "mb") {
		// "e"+"mb..." would start with the single-node prefix "emb".
		return Names{}, fmt.Errorf("node_id %q: must not start with \"mb\": %w", id, errdefs.ErrInvalid)
	}
	h := fnv.New32a()
	h.Write([]byte(id))
	return Names{
		NetPrefix:     "e" + id + "x",
		Table:         "ember_" + id,
		InternetGroup: network.DefaultInternetGroup + 1 + h.Sum32()%0xffff,
		CgroupParent:  "ember-" + id,
		HostMark:      defaultHostMark + 1 + h.Sum32()%0xfffe,
	}, nil
}

// openImages opens the image store; key signs its manifests (nil: the --snapshot-key file).
func openImages(cfg Config, key []byte) (sandbox.ImageStore, error) {
	var backend snapshot.Backend
	if cfg.S3.Endpoint != "" {
		cfg.S3.PathStyle = true
		b, err := snaps3.New(cfg.S3)
		if err != nil {
			return nil, err
		}
		if err := b.EnsureBucket(context.Background()); err != nil {
			return nil, fmt.Errorf("s3: %w", err)
		}
		backend = b
	} else {
		b, err := local.New(datadir.Snapshots(cfg.DataDir))
		if err != nil {
			return nil, err
		}
		backend = b
	}
	// Manifests are signed with a key kept outside the bucket, so that write access to the
	// bucket alone cannot inject a snapshot. Nodes of one cluster share the key file.
	// A cluster shares one through etcd (clusterSnapshotKey) unless --snapshot-key says.
	if key == nil {
		keyFile := cfg.SnapshotKeyFile
		if keyFile == "" {
			keyFile = datadir.SnapshotKey(cfg.DataDir)
		}
		var err error
		if key, err = snapshot.LoadOrCreateKey(keyFile); err != nil {
			return nil, fmt.Errorf("snapshot key: %w", err)
		}
	}
	opts := []snapshot.Option{snapshot.WithSigningKey(key), snapshot.WithLogger(cfg.Logger)}
	if cfg.S3.Endpoint != "" {
		opts = append(opts, snapshot.WithCache(datadir.SnapshotCache(cfg.DataDir)))
	}
	return &imageAdapter{s: snapshot.New(backend, opts...), private: cfg.S3.Endpoint == ""}, nil
}

// The keyless --metrics-listen server: at most metricsMaxConns connections at once, each
// bounded by metricsTimeout (reading a request, writing an answer, idle between them).
var (
	metricsMaxConns = 16
	metricsTimeout  = 10 * time.Second
)

// serveMetrics serves h on ln in the background, bounded as above; Close stops it.
func serveMetrics(ln net.Listener, h http.Handler) *http.Server {
	srv := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: metricsTimeout,
		ReadTimeout:       metricsTimeout,
		WriteTimeout:      3 * metricsTimeout,
		IdleTimeout:       metricsTimeout,
		MaxHeaderBytes:    16 << 10,
	}
	go func() { _ = srv.Serve(netutil.LimitListener(ln, metricsMaxConns)) }()
	return srv
}

// sharedVolumes: in a cluster with an S3 store, volumes are in the bucket (openVolumes).
func sharedVolumes(cfg Config) bool { return len(cfg.EtcdEndpoints) > 0 && cfg.S3.Endpoint != "" }

// sharedVolumesMount is where this node mounts the cluster's bucket for the volumes.
func sharedVolumesMount(cfg Config) string { return filepath.Join(datadir.Volumes(cfg.DataDir), "s3") }

func s3fsConfig(cfg Config) volume.S3FS {
	return volume.S3FS{Endpoint: cfg.S3.Endpoint, TLS: cfg.S3.TLS, CAFile: cfg.S3.CAFile, Insecure: cfg.S3.InsecureSkipVerify,
		Bucket: cfg.S3.Bucket, Prefix: cfg.S3.Prefix, AccessKey: cfg.S3.AccessKey, SecretKey: cfg.S3.SecretKey, Region: cfg.S3.Region}
}

// openVolumes opens <data-dir>/volumes; a destroy is refused while a live or paused sandbox
// of the store mounts the volume. In a cluster with an S3 store (shared), volumes are
// directories of the bucket mounted with s3fs on every node and their records are in etcd
// (volume.MountShared): a destroy is refused while a sandbox on any node mounts the volume.
func openVolumes(ctx context.Context, cfg Config, st *store.Store, cl *cluster.Cluster) (*volume.Manager, error) {
	local := func(ctx context.Context, id string) ([]string, error) {
		sbs, err := st.ListSandboxes(ctx)
		if err != nil {
			return nil, err
		}
		var out []string
		for _, sb := range sbs {
			if (sb.State == sandbox.StateRunning || sb.State == sandbox.StatePaused) && sb.UsesVolume(id) {
				out = append(out, sb.ID)
			}
		}
		return out, nil
	}
	vcfg := volume.Config{
		Dir:    datadir.Volumes(cfg.DataDir),
		Store:  st,
		SizeMB: cfg.VolumeSizeMB,
		Logger: cfg.Logger,
		Users:  local,
	}
	if cfg.VolumeLimitDir != "" && !(sharedVolumes(cfg) && cl != nil) {
		return nil, errors.New("--volume-limit-dir: only for a cluster with S3 (--etcd-endpoints, --s3-endpoint)")
	}
	if sharedVolumes(cfg) && cl != nil {
		dir, err := volume.MountShared(ctx, s3fsConfig(cfg), sharedVolumesMount(cfg), cfg.DataDir)
		if err != nil {
			return nil, fmt.Errorf("volumes: %w", err)
		}
		vcfg.Shared, vcfg.Store, vcfg.LimitDir = dir, cl.Volumes(), cfg.VolumeLimitDir
		vcfg.Users = func(ctx context.Context, id string) ([]string, error) {
			out, err := local(ctx, id)
			if err != nil {
				return nil, err
			}
			users, err := cl.VolumeUsers(ctx, id)
			if err != nil {
				return nil, err
			}
			for _, sid := range users {
				if !slices.Contains(out, sid) {
					out = append(out, sid)
				}
			}
			return out, nil
		}
	}
	return volume.Open(ctx, vcfg)
}
