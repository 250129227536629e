// Package bench measures ember on this machine and prints comparable figures (medians and p99,
// with ratios against baselines measured in the same run). Benchmarks, never timed assertions:
// the machines are shared and noisy. Run with `make bench` / `make bench-basic` (root, runsc).
package bench

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/daemon"
	"github.com/ember-sandbox/ember/internal/envdclient"
	"github.com/ember-sandbox/ember/internal/layerfs"
	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/testutil"
	testnode "github.com/ember-sandbox/ember/internal/testutil/node"
)

// node is an in-process ember node serving its API on loopback.
type node struct {
	*testnode.Node
	url, key, dataDir string
}

var (
	nodeOnce sync.Once
	theNode  *node
	nodeErr  error
)

func getNode(b *testing.B, poolSize int) *node {
	b.Helper()
	testutil.RequireRoot(b)
	runsc := testutil.Runsc(b)
	nodeOnce.Do(func() { theNode, nodeErr = startNode(runsc, poolSize, nil) })
	if nodeErr != nil {
		b.Fatal(nodeErr)
	}
	return theNode
}

// startNode starts a node; mod, if set, changes its configuration (a second node needs a node id
// and CIDR of its own).
func startNode(runsc string, poolSize int, mod func(*daemon.Config)) (*node, error) {
	tmp, err := os.MkdirTemp("", "ember-bench-")
	if err != nil {
		return nil, err
	}
	bins, err := testnode.Build(tmp, false)
	if err != nil {
		return nil, err
	}
	dataDir := filepath.Join(tmp, "data")
	// The data dir on the host filesystem, as `make run` has it: where that cannot clone files
	// (ext4), ember mounts its btrfs image over the data dir (--layer-fs=auto).
	// EMBER_BENCH_LAYER_FS=host: the host filesystem as it is (captures copy on ext4).
	layerMode := os.Getenv("EMBER_BENCH_LAYER_FS")
	cfg := daemon.Config{
		DataDir: dataDir, CacheDir: testnode.CacheDir(), Runsc: runsc, Envd: bins.Envd, PoolSize: poolSize, SlotPoolSize: atoiOr(os.Getenv("EMBER_BENCH_SLOT_POOL"), -1), // -1: the default
		PrestartSize: 1, PrestartMax: 8, // ember serve's defaults
		// EMBER_BENCH_POOL_REFILL_WEIGHT=-1: refills at the sandboxes' CPU weight (an A/B of it).
		PoolRefillWeight: atoiOr(os.Getenv("EMBER_BENCH_POOL_REFILL_WEIGHT"), 0),
		// Names and addresses of its own, so a benchmark never meets a daemon on this host.
		NodeID: envOr("EMBER_BENCH_NODE", "bench"), CIDR: envOr("EMBER_BENCH_CIDR", "10.240.0.0/16"),
		LayerFS:   layerMode,
		Templates: []string{"base"},
		Logger:    benchLogger(),
		Out:       os.Stderr,
	}
	if mod != nil {
		mod(&cfg)
	}
	n, err := testnode.Start(context.Background(), cfg)
	if err != nil {
		return nil, err
	}
	layerFS = describeLayerFS(n.LayerFS, tmp)
	return &node{Node: n, url: n.URL, key: n.Key, dataDir: dataDir}, nil
}

type hdr struct{ id, token string }

func (h hdr) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("E2b-Sandbox-Id", h.id)
	r.Header.Set("E2b-Sandbox-Port", strconv.Itoa(envdclient.Port))
	r.Header.Set("X-Access-Token", h.token)
	return http.DefaultTransport.RoundTrip(r)
}

// run runs a command line in a sandbox through the API's sandbox plane and returns stdout.
func (n *node) run(sb *sandbox.Sandbox, cmdline string) (string, error) {
	c := envdclient.New(&http.Client{Transport: hdr{sb.ID, sb.AccessToken}}, n.url, "")
	var out strings.Builder
	res, err := c.Run(context.Background(), envdclient.Command{Line: cmdline}, envdclient.Output{Stdout: func(b []byte) { out.Write(b) }})
	if err != nil && !errors.Is(err, envdclient.ErrNoEnd) {
		return out.String(), err
	}
	if res.ExitCode != 0 {
		return out.String(), fmt.Errorf("exit %d", res.ExitCode)
	}
	return out.String(), nil
}

// dist is a set of durations.
type dist []time.Duration

func (d dist) pct(p float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := append(dist(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	i := int(p*float64(len(s)-1) + 0.5)
	return s[i]
}

func ms(d time.Duration) string {
	return strconv.FormatFloat(float64(d.Microseconds())/1000, 'f', 1, 64)
}

// report prints one line of figures and records them as benchmark metrics.
func report(b *testing.B, name string, d dist) {
	b.Helper()
	fmt.Printf("%-44s n=%-3d p50=%8s ms  p99=%8s ms\n", name, len(d), ms(d.pct(0.5)), ms(d.pct(0.99)))
	b.ReportMetric(float64(d.pct(0.5).Microseconds())/1000, strings.ReplaceAll(name, " ", "_")+"_p50_ms")
	recordDist(name, d)
}

// memOfProcs sums PSS and private memory (KiB) of the processes whose cmdline contains substr.
func memOfProcs(substr string) (pssKiB, privKiB int64, count int) {
	procs, _ := filepath.Glob("/proc/[0-9]*")
	for _, p := range procs {
		cl, err := os.ReadFile(p + "/cmdline")
		if err != nil || !strings.Contains(string(cl), substr) {
			continue
		}
		data, err := os.ReadFile(p + "/smaps_rollup")
		if err != nil {
			continue
		}
		count++
		for _, line := range strings.Split(string(data), "\n") {
			f := strings.Fields(line)
			if len(f) < 2 {
				continue
			}
			v, _ := strconv.ParseInt(f[1], 10, 64)
			switch f[0] {
			case "Pss:":
				pssKiB += v
			case "Private_Clean:", "Private_Dirty:":
				privKiB += v
			}
		}
	}
	return
}

// memAvailableKiB reads MemAvailable.
func memAvailableKiB() int64 {
	data, _ := os.ReadFile("/proc/meminfo")
	for _, line := range strings.Split(string(data), "\n") {
		if strings.HasPrefix(line, "MemAvailable:") {
			v, _ := strconv.ParseInt(strings.Fields(line)[1], 10, 64)
			return v
		}
	}
	return 0
}

func TestMain(m *testing.M) {
	code := m.Run()
	printTargets()
	if theNode != nil {
		theNode.Close()
		testnode.RemoveDataDir(theNode.dataDir)
		// A node that shuts down keeps its firewall table for the next start; this one has none.
		if names, err := daemon.NodeNames(envOr("EMBER_BENCH_NODE", "bench")); err == nil {
			exec.Command("nft", "delete", "table", "inet", names.Table).Run()
		}
	}
	os.Exit(code)
}

// layerFS names the filesystem that holds the sandboxes' writable layers in this run.
var layerFS string

// describeLayerFS names what holds a node's data dir (under hostDir) for the figures' headers.
func describeLayerFS(r layerfs.Result, hostDir string) string {
	if r.FS == "btrfs" {
		return "btrfs image loop-mounted over the data dir on " + layerfs.FSType(hostDir) + " (--layer-fs=auto, ember's default)"
	}
	return "the host filesystem (" + layerfs.FSType(hostDir) + ", --layer-fs=" + map[bool]string{true: "host", false: "auto"}[r.Action == "host"] + ")"
}

// envOr is the environment variable's value, or def when it is unset (EMBER_BENCH_NODE and
// EMBER_BENCH_CIDR let two benchmark runs share a host).
func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// atoiOr is s as a number, or def.
func atoiOr(s string, def int) int {
	if v, err := strconv.Atoi(s); err == nil {
		return v
	}
	return def
}
