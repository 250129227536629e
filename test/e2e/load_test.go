package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestLoadHundredCreates (issue 7 item 8): 100 concurrent creates, each running `echo ok`
// through envd, then kill all. Every create succeeds or fails with a clear JSON error (no 5xx
// without a message, no hang: every request is bounded), and afterwards the daemon's runsc
// processes, its open fds (small tolerance), netns, veths, mounts and MemAvailable (tolerance)
// return to the baseline within 30 s. The wall time and creates/s are figures, not assertions.
// Bound: ~3 min (requests 2 min each at most). EMBER_LOAD_N changes the count, EMBER_LOAD_FLAGS
// adds daemon flags (e.g. "--max-starting 8").
func TestLoadHundredCreates(t *testing.T) {
	n := envInt("EMBER_LOAD_N", 100)
	d := lostNode(t, strings.Fields(os.Getenv("EMBER_LOAD_FLAGS"))...)
	d.waitInstances(t, crashPoolSize, 90*time.Second)
	base := d.settledUsage(t)
	t.Logf("baseline: %s", base)

	type outcome struct {
		id      string
		created time.Duration
		err     string // "" = created and `echo ok` printed ok
	}
	out := make([]outcome, n)
	start := time.Now()
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			t0 := time.Now()
			var s sbx
			code, body, err := d.call(2*time.Minute, "POST", "/v2/sandboxes", map[string]any{"templateID": "base", "timeout": 300}, &s)
			out[i].created = time.Since(t0)
			switch {
			case err != nil && code == 0:
				out[i].err = fmt.Sprintf("no answer: %v", err)
				return
			case code != 201:
				out[i].err = fmt.Sprintf("%d %s", code, body)
				if msg := jsonErrorMessage(body); msg == "" || msg == "internal error" || code < 400 {
					t.Errorf("create %d: %d %q is not a clear JSON error ({\"code\",\"message\"} saying what failed)", i, code, body)
				}
				return
			}
			out[i].id = s.SandboxID
			r, err := d.runFor(2*time.Minute, s, "echo ok")
			if err != nil || r.stdout != "ok\n" || r.exitCode != 0 {
				out[i].err = fmt.Sprintf("echo ok: %+v %v", r, err)
				t.Errorf("sandbox %d (%s) was created but `echo ok` fails: %+v %v\n%s", i, s.SandboxID, r, err, d.logLines(s.SandboxID, 20))
			}
		}(i)
	}
	wg.Wait()
	wall := time.Since(start)
	ok, failed := 0, map[string]int{}
	var lat []time.Duration
	for _, o := range out {
		if o.err == "" {
			ok++
			lat = append(lat, o.created)
		} else {
			k := o.err
			if len(k) > 120 {
				k = k[:120]
			}
			failed[k]++
		}
	}
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	p := func(q float64) time.Duration {
		if len(lat) == 0 {
			return 0
		}
		return lat[int(q*float64(len(lat)-1))].Round(time.Millisecond)
	}
	t.Logf("%d concurrent creates + `echo ok`: %d ok in %s (%.1f creates/s); create latency p50 %s p90 %s max %s", n, ok, wall.Round(time.Millisecond),
		float64(ok)/wall.Seconds(), p(0.5), p(0.9), p(1))
	for k, v := range failed {
		t.Logf("failed %d×: %s", v, k)
	}
	if len(failed) > 0 {
		t.Logf("daemon errors:\n%s", d.logLines("level=ERROR", 15))
	}
	peak := d.usage()
	t.Logf("at peak: %s", peak)

	t0 := time.Now()
	killed := 0
	var kw sync.WaitGroup
	sem := make(chan struct{}, 16)
	for _, o := range out {
		if o.id == "" {
			continue
		}
		kw.Add(1)
		killed++
		go func(id string) {
			defer kw.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			if code, body, err := d.call(2*time.Minute, "DELETE", "/sandboxes/"+id, nil, nil); code != 204 {
				t.Errorf("kill %s: %d %s %v", id, code, body, err)
			}
		}(o.id)
	}
	kw.Wait()
	t.Logf("killed %d sandboxes in %s", killed, time.Since(t0).Round(time.Millisecond))
	if l := d.listAll(t); len(l) != 0 {
		t.Errorf("%d sandboxes still listed after killing all", len(l))
	}

	// Back to the baseline within 30 s.
	var now usage
	back := false
	deadline := time.Now().Add(30 * time.Second)
	for !back && time.Now().Before(deadline) {
		time.Sleep(500 * time.Millisecond)
		now = d.usage()
		back = now.within(base) == ""
	}
	t.Logf("%s after the kills: %s", time.Since(t0).Round(time.Millisecond), now)
	if !back {
		t.Errorf("30 s after killing all, resources are not back to the baseline: %s\nbaseline %s\nnow      %s", now.within(base), base, now)
	}
}

// jsonErrorMessage returns the message of a control-plane error body, "" if it is not one.
func jsonErrorMessage(body string) string {
	var e struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	}
	if json.Unmarshal([]byte(body), &e) != nil || e.Code == 0 {
		return ""
	}
	return e.Message
}

// usage is what the daemon holds, in numbers.
type usage struct {
	procs, fds, netns, veths, mounts int
	memAvailMB                       int
	pool                             int // warm-pool instances (they follow demand)
}

func (u usage) String() string {
	return fmt.Sprintf("runsc-procs=%d daemon-fds=%d netns=%d veths=%d mounts=%d MemAvailable=%d MiB pool=%d", u.procs, u.fds, u.netns, u.veths, u.mounts, u.memAvailMB, u.pool)
}

// within says how u exceeds the baseline b ("" = within): counts may not grow (fds by 8)
// beyond what the warm pool grew by (it follows the create rate: each pool instance holds two
// runsc processes, a netns, a veth and two mounts), and MemAvailable may drop by at most 512 MiB
// plus 64 MiB a pool instance (other work on the host moves it too).
func (u usage) within(b usage) string {
	var bad []string
	grown := max(0, u.pool-b.pool)
	check := func(name string, v, base, tol int) {
		if v > base+tol {
			bad = append(bad, fmt.Sprintf("%s %d > %d", name, v, base+tol))
		}
	}
	check("runsc processes", u.procs, b.procs, 2*grown)
	check("daemon fds", u.fds, b.fds, 8)
	check("netns", u.netns, b.netns, grown)
	check("veths", u.veths, b.veths, grown)
	check("mounts", u.mounts, b.mounts, 2*grown)
	if tol := 512 + 64*grown; u.memAvailMB < b.memAvailMB-tol {
		bad = append(bad, fmt.Sprintf("MemAvailable %d MiB < %d - %d", u.memAvailMB, b.memAvailMB, tol))
	}
	return strings.Join(bad, ", ")
}

func (d *daemon) usage() usage {
	var u usage
	u.pool = len(d.poolSandboxIDs())
	for _, p := range d.runscProcs() {
		if isSandboxOrGofer(p) {
			u.procs++
		}
	}
	if d.cmd != nil && d.cmd.Process != nil {
		fds, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", d.cmd.Process.Pid))
		u.fds = len(fds)
	}
	u.netns, u.veths, u.mounts = len(d.netnsList()), len(d.vethList()), len(d.mountsUnder())
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if f := strings.Fields(l); len(f) >= 2 && f[0] == "MemAvailable:" {
				kb, _ := strconv.Atoi(f[1])
				u.memAvailMB = kb / 1024
			}
		}
	}
	return u
}

// settledUsage waits (at most 20 s) until the counts stop changing.
func (d *daemon) settledUsage(t *testing.T) usage {
	t.Helper()
	prev := d.usage()
	for i, stable := 0, 0; i < 40 && stable < 4; i++ {
		time.Sleep(500 * time.Millisecond)
		cur := d.usage()
		if cur.procs == prev.procs && cur.netns == prev.netns && cur.veths == prev.veths && cur.mounts == prev.mounts && cur.fds == prev.fds {
			stable++
		} else {
			stable = 0
		}
		prev = cur
	}
	return prev
}
