// Package cli is the `ember` command line: `ember serve` runs the daemon; every other command
// (sandbox, template, keys) talks to a daemon through its HTTP API, like any E2B client. Each
// command has --json; tables go to a terminal; exit codes are trustworthy (exec returns the
// command's exit code).
package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/daemon"
	"github.com/ember-sandbox/ember/internal/layerfs"
)

// ExitError carries a specific exit code out of a command.
type ExitError struct{ Code int }

func (e *ExitError) Error() string { return fmt.Sprintf("exit status %d", e.Code) }

type globals struct {
	url    string
	key    string
	asJSON bool
}

// Main runs the CLI and returns the process exit code.
func Main(args []string) int {
	g := &globals{}
	root := &cobra.Command{
		Use:           "ember",
		Short:         "ember runs isolated Linux sandboxes (gVisor) behind an E2B-compatible API",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.PersistentFlags().StringVar(&g.url, "url", envOr("EMBER_URL", "http://127.0.0.1:3000"), "daemon URL ($EMBER_URL)")
	root.PersistentFlags().StringVar(&g.key, "api-key", "", "API key (default: $E2B_API_KEY, else <data-dir>/api-key of a local daemon)")
	root.PersistentFlags().BoolVar(&g.asJSON, "json", false, "print JSON")
	root.AddCommand(serveCmd(), sandboxCmd(g), templateCmd(g), poolCmd(g), keysCmd(g), teamCmd(g), nodeCmd(g), clusterCmd(g))
	root.SetArgs(args)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := root.ExecuteContext(ctx); err != nil {
		if ee, ok := err.(*ExitError); ok {
			return ee.Code
		}
		fmt.Fprintln(os.Stderr, "error:", err)
		return 1
	}
	return 0
}

func envOr(k, d string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return d
}

func (g *globals) client() *client {
	key := g.key
	if key == "" {
		// Read here, not as the flag's default: --help must never print a key.
		key = os.Getenv("E2B_API_KEY")
	}
	if key == "" {
		// A local daemon's key: $EMBER_DATA_DIR, then ./data (`make run`), then the default dir.
		for _, p := range []string{os.Getenv("EMBER_DATA_DIR"), "data", defaultDataDir()} {
			if p == "" {
				continue
			}
			if b, err := os.ReadFile(filepath.Join(p, "api-key")); err == nil {
				key = strings.TrimSpace(string(b))
				break
			}
		}
	}
	return &client{base: strings.TrimRight(g.url, "/"), key: key, http: &http.Client{}}
}

func defaultDataDir() string {
	if os.Geteuid() == 0 {
		return "/var/lib/ember"
	}
	return filepath.Join(os.TempDir(), "ember")
}

func exeDir() string {
	p, err := os.Executable()
	if err != nil {
		return "."
	}
	return filepath.Dir(p)
}

func splitList(v string) []string {
	if v == "" {
		return nil
	}
	return strings.Split(v, ",")
}

// findBinary looks for a helper binary next to ember, then in the repo cache, then PATH.
func findBinary(name string) string {
	for _, p := range []string{filepath.Join(exeDir(), name), filepath.Join(exeDir(), "..", ".cache", "bin", name)} {
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	return name
}

func serveCmd() *cobra.Command {
	cfg := daemon.Config{}
	var templates, layerFSSize string
	var verbose bool
	c := &cobra.Command{
		Use:   "serve",
		Short: "Run the ember daemon (E2B control API + sandbox plane on one port)",
		RunE: func(cmd *cobra.Command, _ []string) error {
			if os.Geteuid() != 0 {
				return fmt.Errorf("ember serve needs root (network namespaces, runsc)")
			}
			if templates != "" {
				cfg.Templates = strings.Split(templates, ",")
			}
			size, err := layerfs.ParseSize(layerFSSize)
			if err != nil {
				return err
			}
			cfg.LayerFSSize = size
			level := new(slogLevel)
			if verbose {
				*level = -4
			}
			cfg.Logger = newLogger(os.Stderr, level)
			cfg.Out = os.Stdout
			return daemon.Serve(cmd.Context(), cfg)
		},
	}
	f := c.Flags()
	f.StringVar(&cfg.Listen, "listen", "127.0.0.1:3000", "address to listen on")
	f.StringVar(&cfg.MetricsListen, "metrics-listen", "", "also serve Prometheus /metrics without an API key on this address (on --listen, /metrics needs the API key)")
	f.StringVar(&cfg.DataDir, "data-dir", envOr("EMBER_DATA_DIR", defaultDataDir()), "data directory ($EMBER_DATA_DIR)")
	f.StringVar(&cfg.LayerFS, "layer-fs", envOr("EMBER_LAYER_FS", layerfs.ModeAuto), "filesystem of the data directory ($EMBER_LAYER_FS): auto = where it cannot clone files (ext4), a sparse btrfs image <data-dir>/"+layerfs.ImageName+" loop-mounted over it, so snapshots, forks and checkpoints clone layers in O(1); host = the data directory's own; btrfs = the image always (new data directory)")
	f.StringVar(&layerFSSize, "layer-fs-size", os.Getenv("EMBER_LAYER_FS_SIZE"), "size of the btrfs image (sparse: it takes what is written), e.g. 500G ($EMBER_LAYER_FS_SIZE); default the space free on the host filesystem when it is made; a larger size grows the image at the next mount")
	f.StringVar(&cfg.CacheDir, "cache-dir", os.Getenv("EMBER_CACHE_DIR"), "build cache (debootstrap); default <data-dir>/cache")
	f.StringVar(&cfg.Runsc, "runsc", envOr("EMBER_RUNSC", findBinary("runsc")), "runsc binary ($EMBER_RUNSC)")
	f.StringVar(&cfg.Envd, "envd", envOr("EMBER_ENVD", findBinary("envd")), "envd binary put into templates")
	f.StringVar(&cfg.Domain, "domain", "", "sandbox domain for host routing <port>-<id>.<domain> (default localhost:<listen port>, or localhost:<tls port> with --tls-listen); may carry a port, which the SDK then uses")
	f.StringVar(&cfg.TLSListen, "tls-listen", "", "also serve HTTPS on this address (E2B Mode B: https://<port>-<id>.<domain>; the SDK implies 443 unless --domain has a port)")
	f.StringVar(&cfg.TLSCert, "tls-cert", "", "PEM certificate for *.<domain> (with --tls-key); default: issued by ember's local CA, <data-dir>/tls/ca.pem")
	f.StringVar(&cfg.TLSKey, "tls-key", "", "PEM private key of --tls-cert")
	f.IntVar(&cfg.PoolSize, "pool-size", 2, "restored sandboxes kept ready per template at least (0 disables the pool); it grows with the create rate")
	f.IntVar(&cfg.PoolMax, "pool-max", 64, "restored sandboxes kept ready per template at most (an explicit `ember pool warm` may ask for more)")
	f.IntVar(&cfg.PoolMemoryMB, "pool-memory-mb", 0, "memory all warm pools together may use (MiB; 0 = an eighth of the host's memory), each instance counted at its measured idle cost")
	f.DurationVar(&cfg.PoolDecay, "pool-decay", 30*time.Second, "how fast the pools forget demand: the observed create rate fades with this time constant, the largest recent burst halves every period")
	f.IntVar(&cfg.PoolRefillWeight, "pool-refill-weight", 0, "CPU weight of restored-pool refills against the sandboxes' 100 (cgroup v2 units; 0 = 10; -1 = the sandboxes' weight)")
	f.IntVar(&cfg.PoolRefills, "pool-refills", 0, "pool refills run at once while no create is in flight (0 = the number of CPUs)")
	f.IntVar(&cfg.PrestartSize, "prestart-size", 1, "pre-started instances (created ahead, restored into on a pool miss) kept per template at least; they grow with the misses")
	f.IntVar(&cfg.PrestartMax, "prestart-max", 8, "pre-started instances kept per template at most (0 disables them)")
	f.StringVar(&cfg.PauseMode, "pause-mode", "hot", "how a memory pause pauses: hot (frozen in place, its state written to disk in the background; resume thaws it) or checkpoint (checkpointed and its instance ended; resume restores it)")
	f.IntVar(&cfg.PausedMemoryMB, "paused-memory-mb", 0, "memory the sandboxes paused in memory may hold (MiB; 0 = a quarter of the host's memory; -1 = none stays once its state is on disk); over it the least recently paused go to disk")
	f.DurationVar(&cfg.HotPauseMax, "hot-pause-max", 10*time.Minute, "how long a sandbox stays paused in memory before it goes to disk")
	f.IntVar(&cfg.SlotPoolSize, "slot-pool-size", daemon.DefaultSlotPoolSize, "network slots made ahead of need (0 disables)")
	f.IntVar(&cfg.MaxSandboxes, "max-sandboxes", 500, "running sandboxes this node holds at most (pool instances included); a create over it waits in a fair admission queue for up to its X-Ember-Queue-Timeout (seconds, default 5), then answers 429 with Retry-After")
	f.IntVar(&cfg.MaxStarting, "max-starting", 0, "instances booting or restoring at once at most (0 = no bound); more wait their turn")
	f.IntVar(&cfg.MaxQueued, "max-queued", 1000, "creates waiting for room at most (the admission queue's bound); one more answers 429 with Retry-After at once")
	f.IntVar(&cfg.MaxBuilds, "max-builds", 2, "concurrent template builds at most")
	f.IntVar(&cfg.VolumeSizeMB, "volume-size-mb", 1024, "disk limit of each new volume (MiB; a sparse ext4 image: a write past it fails with ENOSPC)")
	f.StringVar(&cfg.VolumeLimitDir, "volume-limit-dir", os.Getenv("EMBER_VOLUME_LIMIT_DIR"), "cluster mode with S3, on the S3 server's host only (versitygw posix, run with --disableotmp): the directory <bucket>/<prefix>volumes of its backend; this node then holds every volume's disk limit there (an image per volume), so a write past it fails (EIO at close/fsync) on every node ($EMBER_VOLUME_LIMIT_DIR)")
	f.IntVar(&cfg.DiskMB, "disk-mb", 2048, "disk of a sandbox's writable layer unless its template says otherwise, and of build sandboxes and template warm-ups (MiB; a write past it fails with ENOSPC inside)")
	f.IntVar(&cfg.MaxConns, "max-connections", 8192, "concurrent client connections at most")
	f.StringVar(&templates, "templates", "base", "templates to build at start if missing (comma-separated, empty for none)")
	f.StringVar(&cfg.CIDR, "cidr", os.Getenv("EMBER_CIDR"), "network for sandbox slots ($EMBER_CIDR; default 10.11.0.0/16)")
	f.StringVar(&cfg.NodeID, "node-id", os.Getenv("EMBER_NODE_ID"), "node id; node-local names (netns, nftables table, cgroups) derive from it, so several nodes can share a host ($EMBER_NODE_ID)")
	f.StringSliceVar(&cfg.EtcdEndpoints, "etcd-endpoints", splitList(os.Getenv("EMBER_ETCD_ENDPOINTS")), "cluster mode: etcd client URLs (comma-separated; $EMBER_ETCD_ENDPOINTS); needs --node-id. Empty = a single node")
	f.StringVar(&cfg.AdvertiseURL, "advertise-url", os.Getenv("EMBER_ADVERTISE_URL"), "cluster mode: the URL other nodes reach this one at (default http://<listen>)")
	f.DurationVar(&cfg.ClusterTTL, "cluster-ttl", 10*time.Second, "cluster mode: the node's lease; cut off from etcd this long, it fences itself (kills its sandboxes)")
	f.DurationVar(&cfg.ClusterQuorumGrace, "cluster-quorum-grace", cluster.DefaultQuorumGrace, "cluster mode: while etcd has no quorum (a member answers \"no leader\"), how long past its TTL a node keeps its sandboxes before it fences")
	f.StringVar(&cfg.ClusterSecretFile, "cluster-secret-file", os.Getenv("EMBER_CLUSTER_SECRET_FILE"), "cluster mode: a file whose contents (16 bytes or more, the same on every node) sign the requests between nodes ($EMBER_CLUSTER_SECRET_FILE); empty = a secret the cluster keeps in etcd")
	f.StringVar(&cfg.EtcdCA, "etcd-ca", os.Getenv("EMBER_ETCD_CA"), "cluster mode: PEM CA that signed etcd's certificate ($EMBER_ETCD_CA; ember cluster certs)")
	f.StringVar(&cfg.EtcdCert, "etcd-cert", os.Getenv("EMBER_ETCD_CERT"), "cluster mode: this node's PEM client certificate for etcd ($EMBER_ETCD_CERT)")
	f.StringVar(&cfg.EtcdKey, "etcd-key", os.Getenv("EMBER_ETCD_KEY"), "cluster mode: the PEM key of --etcd-cert ($EMBER_ETCD_KEY)")
	f.BoolVar(&cfg.EtcdInsecure, "etcd-insecure", false, "cluster mode: join an etcd that cannot be authenticated (plain http, no client certificate auth) and keep its secrets unsealed without --cluster-key-file: anyone who reaches etcd then controls the cluster")
	f.StringVar(&cfg.ClusterKeyFile, "cluster-key-file", os.Getenv("EMBER_CLUSTER_KEY_FILE"), "cluster mode: the cluster sealing key (64 hex digits, the same file on every node; ember cluster certs makes it): seals the secrets ember keeps in etcd ($EMBER_CLUSTER_KEY_FILE)")
	f.StringVar(&cfg.Mirror, "mirror", "", "Debian mirror for template builds")
	f.StringSliceVar(&cfg.RegistryAllow, "registry-allow", splitList(os.Getenv("EMBER_REGISTRY_ALLOW")), "an image registry (host:port, or a host: any port) that builds may pull from although it is on a loopback, private, link-local or metadata address (repeatable; $EMBER_REGISTRY_ALLOW, comma-separated); others on such addresses are refused")
	f.StringVar(&cfg.S3.Endpoint, "s3-endpoint", os.Getenv("EMBER_S3_ENDPOINT"), "S3-compatible endpoint for snapshots (host:port); empty = local directory")
	f.StringVar(&cfg.S3.Bucket, "s3-bucket", envOr("EMBER_S3_BUCKET", "ember"), "S3 bucket")
	f.StringVar(&cfg.S3.AccessKey, "s3-access-key", os.Getenv("EMBER_S3_ACCESS_KEY"), "S3 access key")
	f.StringVar(&cfg.S3.SecretKey, "s3-secret-key", os.Getenv("EMBER_S3_SECRET_KEY"), "S3 secret key")
	f.StringVar(&cfg.SnapshotKeyFile, "snapshot-key", os.Getenv("EMBER_SNAPSHOT_KEY"), "key signing stored images (default: a single node's <data-dir>/snapshot-key, created if missing; a cluster's own, kept sealed in etcd)")
	f.BoolVar(&verbose, "verbose", false, "debug logs")
	return c
}

// ---- output helpers ----

func isTTY() bool { return term.IsTerminal(int(os.Stdout.Fd())) }

func printJSON(v any) error {
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func table(header []string, rows [][]string) {
	w := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, strings.Join(header, "\t"))
	for _, r := range rows {
		fmt.Fprintln(w, strings.Join(r, "\t"))
	}
	w.Flush()
}

func str(v any) string {
	switch x := v.(type) {
	case nil:
		return ""
	case string:
		return x
	case float64:
		return fmt.Sprint(int64(x))
	case map[string]any:
		keys := make([]string, 0, len(x))
		for k := range x {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		parts := make([]string, len(keys))
		for i, k := range keys {
			parts[i] = k + "=" + str(x[k])
		}
		return strings.Join(parts, ",")
	case []any:
		parts := make([]string, len(x))
		for i, e := range x {
			parts[i] = str(e)
		}
		return strings.Join(parts, ",")
	default:
		return fmt.Sprint(x)
	}
}

func parseKV(list []string) (map[string]string, error) {
	if len(list) == 0 {
		return nil, nil
	}
	m := map[string]string{}
	for _, kv := range list {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("%q: want KEY=VALUE", kv)
		}
		m[k] = v
	}
	return m, nil
}
