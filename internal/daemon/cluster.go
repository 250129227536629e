package daemon

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	goruntime "runtime"
	"strconv"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/datadir"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/layerfs"
	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/template/build"
)

// openCluster joins the cluster at cfg.EtcdEndpoints.
func openCluster(ctx context.Context, cfg Config, c *clientv3.Client, counters *cluster.EtcdCounters, seal *cluster.SealKey, mgr *sandbox.Manager, builtins map[string]build.BuiltinTemplate, onRetry func()) (*cluster.Cluster, error) {
	if cfg.NodeID == "" {
		return nil, fmt.Errorf("etcd-endpoints: cluster mode needs --node-id: %w", errdefs.ErrInvalid)
	}
	adv := cfg.AdvertiseURL
	if adv == "" {
		host, _, err := net.SplitHostPort(cfg.Listen)
		if ip := net.ParseIP(host); err != nil || host == "" || (ip != nil && ip.IsUnspecified()) {
			return nil, fmt.Errorf("advertise-url: --listen %s names no address other nodes can reach: set --advertise-url: %w", cfg.Listen, errdefs.ErrInvalid)
		}
		adv = "http://" + cfg.Listen
	}
	var secret []byte
	if cfg.ClusterSecretFile != "" {
		b, err := os.ReadFile(cfg.ClusterSecretFile)
		if err != nil {
			return nil, fmt.Errorf("cluster-secret-file: %w: %w", err, errdefs.ErrInvalid)
		}
		if secret = []byte(strings.TrimSpace(string(b))); len(secret) < 16 {
			return nil, fmt.Errorf("cluster-secret-file: %s holds %d bytes, 16 or more needed: %w", cfg.ClusterSecretFile, len(secret), errdefs.ErrInvalid)
		}
	}
	// The built-in templates this node builds on first use: a create of one that no node has
	// yet is placed on a node that builds it.
	sizes := map[string]cluster.TemplateSize{}
	for name, def := range builtins {
		sizes[name] = cluster.TemplateSize{CPU: def.CPUCount, MemoryMB: def.MemoryMB}
	}
	slots := cfg.MaxSandboxes
	if slots <= 0 {
		slots = 500
	}
	cl, err := cluster.New(ctx, cluster.Config{
		Client: c, NodeID: cfg.NodeID, URL: strings.TrimSuffix(adv, "/"), TTL: cfg.ClusterTTL,
		Capacity: cluster.Capacity{CPU: goruntime.NumCPU(), MemoryMB: memTotalMB(), Slots: slots, DiskFreeMB: diskFreeMB(cfg.DataDir)},
		Runsc:    runscVersion(cfg.Runsc), CPUClass: cluster.CPUClass(),
		Local:            cluster.ManagerLocal(mgr),
		Builtins:         sizes,
		LeaseFile:        datadir.ClusterLease(cfg.DataDir),
		Logger:           cfg.Logger,
		Secret:           secret,
		SealKey:          seal,
		QuorumGrace:      cfg.ClusterQuorumGrace,
		OwnClient:        true,
		Counters:         counters,
		OnPlacementRetry: onRetry,
		OnFence: func(reason string) {
			fmt.Fprintf(cfg.Out, "FENCED: %s: this node's sandboxes were killed; it rejoins under a new epoch when etcd answers\n", reason)
		},
	})
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(cfg.Out, "cluster: node %s joined (%s, advertised %s)\n", cfg.NodeID, strings.Join(cfg.EtcdEndpoints, ","), adv)
	return cl, nil
}

func memTotalMB() int64 {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "MemTotal:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return kb / 1024
		}
	}
	return 0
}

// diskFreeMB is the space left in the data dir (on ember's btrfs image: also bounded by its
// host filesystem, which the sparse image shares).
func diskFreeMB(dir string) int64 {
	return layerfs.AvailBytes(dir) / (1 << 20)
}

func runscVersion(bin string) string {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, bin, "--version").Output()
	if err != nil {
		return ""
	}
	line, _, _ := strings.Cut(string(out), "\n")
	return strings.TrimSpace(strings.TrimPrefix(line, "runsc version"))
}

// startTemplates, in cluster mode with a shared image store, gives the node the start-up
// templates: the cluster's build of each, loaded from the store, or (the first node to start)
// its own build, registered for the others. From then on every template that becomes ready
// here is shared with the cluster (cluster.Events).
func startTemplates(ctx context.Context, cfg Config, mgr *sandbox.Manager, builds *build.Manager, tpls *cluster.Templates) error {
	for _, name := range withBase(cfg.Templates, builds.IsBuiltin) {
		t0 := time.Now()
		if err := tpls.Ensure(ctx, name); err != nil {
			return fmt.Errorf("template %q: %w", name, err)
		}
		local, err := mgr.GetTemplate(ctx, name)
		if err == nil && !local.Stale() {
			if _, err := tpls.Share(ctx, name, true); err != nil {
				return fmt.Errorf("share template %q: %w", name, err)
			}
			fmt.Fprintf(cfg.Out, "Template %q: the cluster's build %s (%s)\n", name, local.BuildID, time.Since(t0).Round(time.Millisecond))
			continue
		}
		fmt.Fprintf(cfg.Out, "Building template %q (the cluster has none)...\n", name)
		progress := func(line string) { fmt.Fprintln(cfg.Out, "  "+line) }
		if builds.IsBuiltin(name) {
			// A built-in template is a step build of its definition, not a rootfs of its name.
			_, err = builds.EnsureBuiltin(ctx, name, progress)
		} else {
			_, err = builds.BuildTemplate(ctx, sandbox.BuildRequest{Name: name}, progress)
		}
		if err != nil {
			return fmt.Errorf("build template %q: %w", name, err)
		}
		// Registered unless a node starting at the same time registered its build first: then
		// that one is loaded, and every node runs the same build. A stale record is replaced.
		stale := false
		if st, err := tpls.Shared(ctx, name); err == nil && st != nil {
			stale = st.Portable.Template.Stale()
		}
		won, err := tpls.Share(ctx, name, !stale)
		if err != nil {
			return fmt.Errorf("share template %q: %w", name, err)
		}
		if err := tpls.Ensure(ctx, name); err != nil {
			return fmt.Errorf("template %q: %w", name, err)
		}
		fmt.Fprintf(cfg.Out, "Template %q shared: build %s of node %s (%s)\n", name, won.BuildID, won.Node, time.Since(t0).Round(time.Millisecond))
	}
	return nil
}
