package bench

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
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
	"github.com/ember-sandbox/ember/internal/testutil"
	testnode "github.com/ember-sandbox/ember/internal/testutil/node"
)

// BenchmarkAdmissionBurst (issue 19): N creates at once through the API against a node whose
// capacity (--max-sandboxes) is C, each sandbox killed after a short life so that the room it
// frees goes to the creates waiting in the admission queue. Every create must either run (201)
// or get a 429 with Retry-After: no 5xx, no other answer. After the kill of everything the node
// holds what it held before the burst: its network namespaces, cgroups and runsc processes are
// counted. It prints the queued wait (X-Ember-Queue-Wait) of the creates that ran, p50/p99, the
// answer time, and the 429 count.
//
// Its default size runs on a loaded 2-core host: 40 creates, capacity 8. The figure is
// EMBER_BENCH_ADMIT_CREATES=1000 EMBER_BENCH_ADMIT_CAPACITY=200. EMBER_BENCH_ADMIT_WAIT (seconds,
// default 120) is each create's queue timeout, EMBER_BENCH_ADMIT_HOLD (a Go duration, default
// 1s) each sandbox's life. Its node is its own: EMBER_BENCH_NODE with "q" appended, and
// EMBER_BENCH_ADMIT_CIDR (default 10.241.0.0/16).
func BenchmarkAdmissionBurst(b *testing.B) {
	testutil.RequireRoot(b)
	runsc := testutil.Runsc(b)
	creates := atoiOr(os.Getenv("EMBER_BENCH_ADMIT_CREATES"), 40)
	capacity := atoiOr(os.Getenv("EMBER_BENCH_ADMIT_CAPACITY"), 8)
	wait := envOr("EMBER_BENCH_ADMIT_WAIT", "120")
	hold, err := time.ParseDuration(envOr("EMBER_BENCH_ADMIT_HOLD", "1s"))
	if err != nil {
		b.Fatal(err)
	}
	nodeID := envOr("EMBER_BENCH_NODE", "bench") + "q"
	n, err := startNode(runsc, 0, func(c *daemon.Config) {
		c.NodeID, c.CIDR = nodeID, envOr("EMBER_BENCH_ADMIT_CIDR", "10.241.0.0/16")
		c.MaxSandboxes = capacity
		c.MaxQueued = creates
		c.PrestartSize, c.PrestartMax = 0, 0 // every instance is a create's: capacity is the creates'
	})
	if err != nil {
		b.Fatal(err)
	}
	defer func() {
		n.Close()
		testnode.RemoveDataDir(n.dataDir)
	}()
	fmt.Printf("\n== ember admission queue: %d creates at once, capacity %d, queue timeout %ss, each sandbox lives %s (load %s) ==\n",
		creates, capacity, wait, hold, loadAvg())
	before := hostHeld(nodeID, n.dataDir)
	fmt.Printf("  before: %s\n", before)

	type answer struct {
		status     int
		retryAfter string
		queued     time.Duration
		took       time.Duration
		body       string
	}
	answers := make([]answer, creates)
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: creates}}
	var running, peak int
	var mu sync.Mutex
	var wg sync.WaitGroup
	start := make(chan struct{})
	t0 := time.Now()
	for i := range answers {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			<-start
			req, _ := http.NewRequest("POST", n.url+"/sandboxes", strings.NewReader(`{"templateID":"base","timeout":300}`))
			req.Header.Set("X-API-Key", n.key)
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("X-Ember-Queue-Timeout", wait)
			t := time.Now()
			resp, err := client.Do(req)
			a := &answers[i]
			a.took = time.Since(t)
			if err != nil {
				a.body = err.Error()
				return
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			a.status, a.retryAfter, a.body = resp.StatusCode, resp.Header.Get("Retry-After"), string(body)
			if s, err := strconv.ParseFloat(resp.Header.Get("X-Ember-Queue-Wait"), 64); err == nil {
				a.queued = time.Duration(s * float64(time.Second))
			}
			if resp.StatusCode != http.StatusCreated {
				return
			}
			var sb struct {
				SandboxID string `json:"sandboxID"`
			}
			json.Unmarshal(body, &sb)
			mu.Lock()
			running++
			peak = max(peak, running)
			mu.Unlock()
			time.Sleep(hold)
			mu.Lock()
			running--
			mu.Unlock()
			del, _ := http.NewRequest("DELETE", n.url+"/sandboxes/"+sb.SandboxID, nil)
			del.Header.Set("X-API-Key", n.key)
			if resp, err := client.Do(del); err == nil {
				resp.Body.Close()
				if resp.StatusCode != http.StatusNoContent {
					b.Errorf("kill %s: %d", sb.SandboxID, resp.StatusCode)
				}
			}
		}(i)
	}
	close(start)
	wg.Wait()
	total := time.Since(t0)

	var queued, took dist
	statuses := map[int]int{}
	refused, badRetry, waitedAtAll := 0, 0, 0
	for _, a := range answers {
		statuses[a.status]++
		switch a.status {
		case http.StatusCreated:
			queued = append(queued, a.queued)
			took = append(took, a.took)
			if a.queued > 10*time.Millisecond {
				waitedAtAll++
			}
		case http.StatusTooManyRequests:
			refused++
			if _, err := strconv.Atoi(a.retryAfter); err != nil {
				badRetry++
			}
		default:
			b.Errorf("a create answered %d (want 201 or 429): %s", a.status, strings.TrimSpace(a.body))
		}
	}
	if badRetry > 0 {
		b.Errorf("%d 429s without an integer Retry-After", badRetry)
	}
	if peak > capacity {
		b.Errorf("%d sandboxes ran at once, over the capacity of %d", peak, capacity)
	}
	codes := make([]int, 0, len(statuses))
	for c := range statuses {
		codes = append(codes, c)
	}
	sort.Ints(codes)
	var parts []string
	for _, c := range codes {
		parts = append(parts, fmt.Sprintf("%d×%d", statuses[c], c))
	}
	fmt.Printf("  answers: %s in %s; %d ran (%d after waiting in the queue), at most %d at once; 429s: %d\n",
		strings.Join(parts, " "), total.Round(100*time.Millisecond), len(queued), waitedAtAll, peak, refused)
	report(b, "admission: queued wait of the creates that ran", queued)
	report(b, "admission: answer time of the creates that ran", took)
	b.ReportMetric(float64(refused), "429s")

	// Nothing held by a create that ran and was killed, or that gave up.
	var after heldCounts
	deadline := time.Now().Add(60 * time.Second)
	for {
		after = hostHeld(nodeID, n.dataDir)
		if after.le(before) || time.Now().After(deadline) {
			break
		}
		time.Sleep(500 * time.Millisecond)
	}
	fmt.Printf("  after the kill of everything: %s\n", after)
	if !after.le(before) {
		b.Errorf("the node holds more than before the burst: %s, before %s", after, before)
	}
	fmt.Printf("host load after: %s\n", loadAvg())
}

// heldCounts is what a node holds on the host.
type heldCounts struct{ netns, cgroups, procs int }

func (h heldCounts) String() string {
	return fmt.Sprintf("%d network namespaces, %d sandbox cgroups, %d runsc processes", h.netns, h.cgroups, h.procs)
}

func (h heldCounts) le(o heldCounts) bool {
	return h.netns <= o.netns && h.cgroups <= o.cgroups && h.procs <= o.procs
}

// hostHeld counts node's network namespaces (named e<node>x-*), its sandboxes' cgroups (under
// ember-<node> in any hierarchy) and the runsc processes of its data dir.
func hostHeld(node, dataDir string) heldCounts {
	var h heldCounts
	out, _ := exec.Command("ip", "netns", "list").Output()
	for _, l := range strings.Split(string(out), "\n") {
		if f := strings.Fields(l); len(f) > 0 && strings.HasPrefix(f[0], "e"+node+"x-") {
			h.netns++
		}
	}
	for _, pat := range []string{"/sys/fs/cgroup/*/ember-%s/*", "/sys/fs/cgroup/ember-%s/*"} {
		dirs, _ := filepath.Glob(fmt.Sprintf(pat, node))
		for _, d := range dirs {
			if fi, err := os.Stat(d); err == nil && fi.IsDir() {
				h.cgroups++
			}
		}
	}
	files, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, f := range files {
		if b, err := os.ReadFile(f); err == nil && bytes.Contains(b, []byte(dataDir)) && bytes.Contains(b, []byte("runsc")) {
			h.procs++
		}
	}
	return h
}
