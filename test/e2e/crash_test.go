package e2e

import (
	"errors"
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	emberdaemon "github.com/ember-sandbox/ember/internal/daemon"
)

// TestCrashInjection (issue 7 item 7): rounds of a mixed workload against the real daemon
// (create from the pool, from the template's checkpoint and from a snapshot, write files, pause,
// resume, snapshot, fork, kill), each cut by kill -9 of the daemon at a random (seeded) moment,
// then a restart and the invariants:
//   - every sandbox the API reported created (201) and the test did not kill is running with its
//     files (an old file reads back AND a new one can be written), or paused and resumable with
//     its files, or reported gone with a reason; an operation cut by the crash may have happened
//     or not (a pause: running or paused; a kill: gone or running);
//   - nothing runs that the store does not know: every runsc instance is a listed sandbox's or
//     the pool's (at most pool size + 1 being restored, each with its state dir), every netns is
//     an instance's or a spare of the slot pool, every mount and instance dir is under a running
//     instance's state dir, every runsc sandbox/gofer process belongs to an instance;
//   - no half-written snapshot is accepted: a snapshot the API reported created restores with its
//     files; one whose creation the crash cut is either absent or restores fully.
//
// Bound: 30 rounds (EMBER_CRASH_ROUNDS) and 5.5 min (EMBER_CRASH_BUDGET, a Go duration); it stops
// early when the budget is spent and says so. EMBER_CRASH_SEED replays a run.
func TestCrashInjection(t *testing.T) {
	rounds := envInt("EMBER_CRASH_ROUNDS", 30)
	budget := 330 * time.Second
	if v, err := time.ParseDuration(os.Getenv("EMBER_CRASH_BUDGET")); err == nil {
		budget = v
	}
	seed := time.Now().UnixNano()
	if v, err := strconv.ParseInt(os.Getenv("EMBER_CRASH_SEED"), 10, 64); err == nil {
		seed = v
	}
	t.Logf("seed %d (EMBER_CRASH_SEED=%d replays the plan), %d rounds, budget %s", seed, seed, rounds, budget)
	rng := rand.New(rand.NewSource(seed))
	// EMBER_CRASH_POOL_OFF=1 runs the loop with --pool-size 0 (every create restores).
	pool, flags := crashPoolSize, []string(nil)
	if os.Getenv("EMBER_CRASH_POOL_OFF") == "1" {
		pool, flags = 0, []string{"--pool-size", "0"}
	}
	// EMBER_CRASH_FLAGS: more `ember serve` flags (e.g. "--pause-mode checkpoint" for an A/B).
	flags = append(flags, strings.Fields(os.Getenv("EMBER_CRASH_FLAGS"))...)
	d := lostNode(t, flags...)
	if pool > 0 {
		d.waitInstances(t, 1, 90*time.Second)
	}
	c := &crashRun{t: t, d: d, rng: rng, pool: pool, live: map[string]*tracked{}, inFlight: map[string]int{}, done: map[string]int{}, failed: map[string]int{}}
	start := time.Now()
	var restarts []time.Duration
	ran := 0
	for r := 0; r < rounds; r++ {
		if time.Since(start) > budget {
			t.Logf("time budget %s spent after %d rounds: stopping early", budget, r)
			break
		}
		c.round = r
		c.runRound()
		t0 := time.Now()
		d.crash()
		if err := d.start(); err != nil {
			t.Fatalf("round %d: restart after kill -9: %v\n%s", r, err, d.logs())
		}
		restarts = append(restarts, time.Since(t0))
		c.killing.Store(false)
		c.check()
		ran++
		if c.violations > 60 {
			t.Logf("more than 60 violations: stopping after %d rounds", ran)
			break
		}
	}
	elapsed := time.Since(start)
	d.killAll(t)
	c.live = map[string]*tracked{}
	for _, sn := range c.snaps {
		d.call(30*time.Second, "DELETE", "/templates/"+sn.id, nil, nil)
	}
	c.snaps = nil
	c.settle()
	// Nothing stacks a fork layer any more: every one is gone, those of forks a kill -9 cut too.
	deadline := time.Now().Add(15 * time.Second)
	for len(d.forkLayers()) > 0 && time.Now().Before(deadline) {
		time.Sleep(200 * time.Millisecond)
	}
	if l := d.forkLayers(); len(l) > 0 {
		t.Errorf("with every sandbox killed and every snapshot deleted, fork layers are left: %v", l)
	}
	h := d.host()
	checkOnlyPool(t, d, h, pool, crashSlotPool)
	if !d.stop() {
		t.Errorf("the daemon did not stop within 60 s of SIGTERM")
	}
	time.Sleep(500 * time.Millisecond)
	if after := d.host(); !after.empty() {
		t.Errorf("after the loop, killing every sandbox and a clean stop, ember left: %s", after)
	}
	// Figures.
	sort.Slice(restarts, func(i, j int) bool { return restarts[i] < restarts[j] })
	med, worst := time.Duration(0), time.Duration(0)
	if n := len(restarts); n > 0 {
		med, worst = restarts[n/2], restarts[n-1]
	}
	t.Logf("%d rounds in %s (seed %d); restart (kill -9 -> API up): median %s, max %s", ran, elapsed.Round(time.Second), seed,
		med.Round(time.Millisecond), worst.Round(time.Millisecond))
	t.Logf("crash points (operations in flight at a kill -9, by kind): %s; kills with nothing in flight: %d", fmtCounts(c.inFlight), c.idle)
	t.Logf("operations completed: %s; failed with an API error: %s", fmtCounts(c.done), fmtCounts(c.failed))
	hows := map[string]int{}
	for _, m := range regexp.MustCompile(`msg="sandbox created"[^\n]*how=(\w+)`).FindAllStringSubmatch(d.allLogs(), -1) {
		hows[m[1]]++
	}
	t.Logf("sandboxes created, by how the daemon made them: %s", fmtCounts(hows))
	t.Logf("after restarts: %d sandbox checks passed, %d paused resumed, %d gone with a reason, %d unknown sandboxes from cut creates, %d snapshots restored; %d violations",
		c.verified, c.resumed, c.goneReason, c.unknown, c.snapsOK, c.violations)
}

const (
	crashPoolSize = 2 // ember's default --pool-size
	// crashPrestarted bounds the pre-started instances (runsc state "created") of a settled
	// node: ember's default --prestart-size (1) and one being made.
	crashPrestarted = 2
	crashSlotPool   = emberdaemon.DefaultSlotPoolSize // ember's default --slot-pool-size
	crashMaxLive    = 5                               // sandboxes kept alive across rounds
)

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

func fmtCounts(m map[string]int) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s=%d", k, m[k]))
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, " ")
}

// tracked is what the test knows of a sandbox the API reported created.
type tracked struct {
	s       sbx
	paused  bool
	files   map[string]string // path -> content, confirmed written
	busy    bool              // an operation of this round targets it
	cut     string            // the operation on it the crash cut ("" = none)
	instID  string            // cached runsc instance (invalid after pause/resume)
	created int               // round
}

type snapRec struct {
	id       string
	files    map[string]string
	src      string
	verified bool // restored once after a restart, with its files
}

type crashRun struct {
	t     *testing.T
	d     *daemon
	rng   *rand.Rand
	round int
	pool  int // the daemon's --pool-size

	mu        sync.Mutex
	live      map[string]*tracked
	snaps     []snapRec // confirmed, restorable
	cutSnaps  []snapRec // snapshot calls the crash cut (id unknown; src and files known)
	cutCreate int       // creates and forks cut this round
	opSeq     int

	inFlight, done, failed map[string]int
	idle                   int
	killing                atomic.Bool // set just before the kill -9 of a round

	verified, resumed, goneReason, unknown, snapsOK, violations int
}

func (c *crashRun) violate(format string, args ...any) {
	c.t.Helper()
	c.violations++
	if c.violations <= 40 {
		c.t.Errorf("round %d: "+format, append([]any{c.round}, args...)...)
	}
}

var errCut = errors.New("cut by the crash")

// isCut: the call failed without an answer because the daemon was killed under it.
func (c *crashRun) isCut(err error) bool { return err != nil && c.killing.Load() }

type op struct {
	kind   string
	target *tracked
	snap   *snapRec
	delay  time.Duration
}

// plan picks 3-5 operations for this round (under c.mu).
func (c *crashRun) plan() []op {
	var ops []op
	n := 3 + c.rng.Intn(3)
	var running, paused []*tracked
	ids := make([]string, 0, len(c.live))
	for id := range c.live {
		ids = append(ids, id)
	}
	sort.Strings(ids) // map order is random; the plan must follow the seed
	for _, id := range ids {
		tr := c.live[id]
		if tr.paused {
			paused = append(paused, tr)
		} else {
			running = append(running, tr)
		}
	}
	pick := func(l *[]*tracked) *tracked {
		if len(*l) == 0 {
			return nil
		}
		i := c.rng.Intn(len(*l))
		tr := (*l)[i]
		*l = append((*l)[:i], (*l)[i+1:]...)
		return tr
	}
	creates := 0
	for tries := 0; len(ops) < n && tries < 100; tries++ {
		kinds := []string{"create-pool", "create-pool", "create-checkpoint", "write", "write", "pause", "resume", "snapshot", "fork", "kill", "create-snapshot"}
		k := kinds[c.rng.Intn(len(kinds))]
		o := op{kind: k, delay: time.Duration(c.rng.Intn(300)) * time.Millisecond}
		switch k {
		case "create-pool", "create-checkpoint":
			if len(c.live)+creates >= crashMaxLive {
				continue
			}
			creates++
		case "create-snapshot":
			if len(c.snaps) == 0 || len(c.live)+creates >= crashMaxLive {
				continue
			}
			creates++
			sn := c.snaps[c.rng.Intn(len(c.snaps))]
			o.snap = &sn
		case "write", "pause", "snapshot", "kill":
			if o.target = pick(&running); o.target == nil {
				continue
			}
		case "fork":
			if len(c.live)+creates >= crashMaxLive {
				continue
			}
			if o.target = pick(&running); o.target == nil {
				continue
			}
			creates++
		case "resume":
			if o.target = pick(&paused); o.target == nil {
				continue
			}
		}
		if o.target != nil {
			o.target.busy = true
		}
		ops = append(ops, o)
	}
	return ops
}

func copyFiles(m map[string]string) map[string]string {
	out := make(map[string]string, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

func (c *crashRun) content() (string, string) {
	c.opSeq++
	return fmt.Sprintf("/home/user/f%d.txt", c.opSeq), fmt.Sprintf("r%d-o%d-%x", c.round, c.opSeq, c.rng.Int63())
}

// runRound starts the planned operations, kills the daemon at a random moment, waits for them.
func (c *crashRun) runRound() {
	c.mu.Lock()
	ops := c.plan()
	type fileFor struct{ path, content string }
	files := make([]fileFor, len(ops))
	for i := range ops {
		files[i].path, files[i].content = c.content()
	}
	killAt := time.Duration(20+c.rng.Intn(700)) * time.Millisecond
	c.cutCreate = 0
	c.killing.Store(false)
	c.mu.Unlock()

	var wg sync.WaitGroup
	cut := make([]bool, len(ops))
	for i, o := range ops {
		wg.Add(1)
		go func(i int, o op) {
			defer wg.Done()
			time.Sleep(o.delay)
			err := c.do(o, files[i].path, files[i].content)
			c.mu.Lock()
			defer c.mu.Unlock()
			switch {
			case errors.Is(err, errCut):
				cut[i] = true
				c.inFlight[o.kind]++
			case err != nil:
				c.failed[o.kind]++
				c.t.Logf("round %d: %s: %v", c.round, o.kind, err)
			default:
				c.done[o.kind]++
			}
		}(i, o)
	}
	time.Sleep(killAt)
	c.killing.Store(true)
	c.d.crash()
	waited := make(chan struct{})
	go func() { wg.Wait(); close(waited) }()
	select {
	case <-waited:
	case <-time.After(90 * time.Second):
		c.t.Fatalf("round %d: operations still running 90 s after the daemon was killed", c.round)
	}
	kinds := []string{}
	for i, o := range ops {
		if cut[i] {
			kinds = append(kinds, o.kind)
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(kinds) == 0 {
		c.idle++
	}
	for _, tr := range c.live {
		tr.busy = false
	}
	all := []string{}
	for _, o := range ops {
		all = append(all, o.kind)
	}
	c.t.Logf("round %d: ops %v, kill -9 at %s, cut: %v", c.round, all, killAt, kinds)
}

// do runs one operation; errCut when the crash cut it.
func (c *crashRun) do(o op, path, content string) error {
	d := c.d
	const long = 90 * time.Second
	switch o.kind {
	case "create-pool", "create-checkpoint", "create-snapshot":
		body := map[string]any{"templateID": "base", "timeout": 900}
		var files map[string]string
		if o.kind == "create-checkpoint" {
			body["allow_internet_access"] = false // never served by the pool
		}
		if o.snap != nil {
			body["templateID"] = o.snap.id
			files = copyFiles(o.snap.files)
		}
		var s sbx
		code, resp, err := d.call(long, "POST", "/v2/sandboxes", body, &s)
		if c.isCut(err) {
			c.mu.Lock()
			c.cutCreate++
			c.mu.Unlock()
			return errCut
		}
		if code != 201 {
			return fmt.Errorf("create: %d %s %v", code, resp, err)
		}
		tr := &tracked{s: s, files: map[string]string{}, busy: true, created: c.round}
		c.mu.Lock()
		c.live[s.SandboxID] = tr
		c.mu.Unlock()
		if files != nil {
			// A snapshot the API reported created restores with its files.
			if err := c.checkFiles(tr, files); err != nil {
				if errors.Is(err, errCut) {
					return err
				}
				c.mu.Lock()
				c.violate("sandbox %s from snapshot %s: %v", s.SandboxID, o.snap.id, err)
				c.mu.Unlock()
			}
			c.mu.Lock()
			tr.files = files
			c.snapsOK++
			c.mu.Unlock()
		}
		return c.write(tr, path, content)
	case "write":
		return c.write(o.target, path, content)
	case "pause":
		code, resp, err := d.call(long, "POST", "/sandboxes/"+o.target.s.SandboxID+"/pause", map[string]any{}, nil)
		if c.isCut(err) {
			c.markCut(o.target, "pause")
			return errCut
		}
		if code != 204 {
			return fmt.Errorf("pause %s: %d %s", o.target.s.SandboxID, code, resp)
		}
		c.mu.Lock()
		o.target.paused, o.target.instID = true, ""
		c.mu.Unlock()
	case "resume":
		var s sbx
		code, resp, err := d.call(long, "POST", "/v2/sandboxes/"+o.target.s.SandboxID+"/connect", map[string]any{"timeout": 900}, &s)
		if c.isCut(err) {
			c.markCut(o.target, "resume")
			return errCut
		}
		if code != 201 && code != 200 {
			return fmt.Errorf("resume %s: %d %s", o.target.s.SandboxID, code, resp)
		}
		c.mu.Lock()
		o.target.paused, o.target.instID = false, ""
		c.mu.Unlock()
	case "snapshot":
		c.mu.Lock()
		files := copyFiles(o.target.files)
		c.mu.Unlock()
		var sn struct {
			SnapshotID string `json:"snapshotID"`
		}
		code, resp, err := d.call(long, "POST", "/sandboxes/"+o.target.s.SandboxID+"/snapshots", map[string]any{}, &sn)
		if c.isCut(err) {
			c.mu.Lock()
			c.cutSnaps = append(c.cutSnaps, snapRec{src: o.target.s.SandboxID, files: files})
			c.mu.Unlock()
			c.markCut(o.target, "snapshot")
			return errCut
		}
		if code != 201 {
			return fmt.Errorf("snapshot %s: %d %s", o.target.s.SandboxID, code, resp)
		}
		c.mu.Lock()
		c.snaps = append(c.snaps, snapRec{id: sn.SnapshotID, files: files, src: o.target.s.SandboxID})
		c.mu.Unlock()
	case "fork":
		c.mu.Lock()
		files := copyFiles(o.target.files)
		c.mu.Unlock()
		var items []forkItem
		code, resp, err := d.call(long, "POST", "/sandboxes/"+o.target.s.SandboxID+"/fork", map[string]any{"count": 1, "timeout": 900}, &items)
		if c.isCut(err) {
			c.mu.Lock()
			c.cutCreate++
			c.mu.Unlock()
			c.markCut(o.target, "fork")
			return errCut
		}
		if code != 201 || len(items) != 1 || items[0].Sandbox == nil {
			return fmt.Errorf("fork %s: %d %s", o.target.s.SandboxID, code, resp)
		}
		c.mu.Lock()
		c.live[items[0].Sandbox.SandboxID] = &tracked{s: *items[0].Sandbox, files: files, busy: true, created: c.round}
		c.mu.Unlock()
	case "kill":
		code, resp, err := d.call(long, "DELETE", "/sandboxes/"+o.target.s.SandboxID, nil, nil)
		if c.isCut(err) {
			c.markCut(o.target, "kill")
			return errCut
		}
		if code != 204 {
			return fmt.Errorf("kill %s: %d %s", o.target.s.SandboxID, code, resp)
		}
		c.mu.Lock()
		delete(c.live, o.target.s.SandboxID)
		c.mu.Unlock()
	}
	return nil
}

func (c *crashRun) markCut(tr *tracked, kind string) {
	c.mu.Lock()
	tr.cut = kind
	c.mu.Unlock()
}

// write writes a new file and confirms it by reading it back.
func (c *crashRun) write(tr *tracked, path, content string) error {
	r, err := c.d.runFor(60*time.Second, tr.s, fmt.Sprintf("echo %s > %s && cat %s", content, path, path))
	if err != nil {
		if c.killing.Load() {
			c.markCut(tr, "write")
			return errCut
		}
		return fmt.Errorf("write %s in %s: %v", path, tr.s.SandboxID, err)
	}
	if r.exitCode != 0 || r.stdout != content+"\n" {
		if c.killing.Load() {
			c.markCut(tr, "write")
			return errCut
		}
		return fmt.Errorf("write %s in %s: exit %d %q %q", path, tr.s.SandboxID, r.exitCode, r.stdout, r.stderr)
	}
	c.mu.Lock()
	tr.files[path] = content
	c.mu.Unlock()
	return nil
}

// checkFiles reads every file in want from the sandbox.
func (c *crashRun) checkFiles(tr *tracked, want map[string]string) error {
	if len(want) == 0 {
		return nil
	}
	paths := make([]string, 0, len(want))
	for p := range want {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	var exp strings.Builder
	for _, p := range paths {
		exp.WriteString(want[p] + "\n")
	}
	r, err := c.d.runFor(60*time.Second, tr.s, "cat "+strings.Join(paths, " "))
	if err != nil {
		if c.killing.Load() {
			return errCut
		}
		return fmt.Errorf("reading its files: %v", err)
	}
	if r.stdout != exp.String() {
		return fmt.Errorf("files %v read %q (stderr %q), want %q", paths, r.stdout, r.stderr, exp.String())
	}
	return nil
}

// check verifies the invariants after a restart.
func (c *crashRun) check() {
	t, d := c.t, c.d
	listed := map[string]sbx{}
	for _, s := range d.listAll(t) {
		listed[s.SandboxID] = s
	}
	ids := make([]string, 0, len(c.live))
	for id := range c.live {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		tr := c.live[id]
		ls, ok := listed[id]
		delete(listed, id)
		if !ok {
			code, body, _ := d.call(30*time.Second, "GET", "/sandboxes/"+id, nil, nil)
			switch {
			case tr.cut == "kill":
			case code == 404 && reasonRe.MatchString(body):
				c.goneReason++
			default:
				c.violate("sandbox %s (created round %d, paused=%v, cut %q) is gone after the restart without a reason: GET %d %s", id, tr.created, tr.paused, tr.cut, code, body)
			}
			delete(c.live, id)
			continue
		}
		switch {
		case ls.State == "paused" && !tr.paused && tr.cut != "pause":
			c.violate("sandbox %s was running and came back paused", id)
		case ls.State == "running" && tr.paused && tr.cut != "resume":
			c.violate("sandbox %s was paused and came back running", id)
		}
		if ls.State == "running" {
			tr.paused = false
		}
		if ls.State == "paused" {
			tr.paused = true
			if c.rng.Intn(2) == 0 && tr.cut == "" {
				continue // stays paused; resumed and checked in a later round
			}
			var s sbx
			code, resp, err := d.call(90*time.Second, "POST", "/v2/sandboxes/"+id+"/connect", map[string]any{"timeout": 900}, &s)
			if code != 201 && code != 200 {
				c.violate("paused sandbox %s does not resume after the restart: %d %s %v", id, code, resp, err)
				d.call(30*time.Second, "DELETE", "/sandboxes/"+id, nil, nil)
				delete(c.live, id)
				continue
			}
			tr.paused, tr.instID = false, ""
			c.resumed++
		}
		tr.cut = ""
		if err := c.checkFiles(tr, tr.files); err != nil {
			c.violate("sandbox %s (created round %d): %v; the daemon said of it:\n%s", id, tr.created, err, d.logLines(id, 15))
			d.call(30*time.Second, "DELETE", "/sandboxes/"+id, nil, nil)
			delete(c.live, id)
			continue
		}
		path, content := c.content()
		if err := c.write(tr, path, content); err != nil {
			c.violate("sandbox %s (created round %d): after the restart a new file cannot be written: %v", id, tr.created, err)
			d.call(30*time.Second, "DELETE", "/sandboxes/"+id, nil, nil)
			delete(c.live, id)
			continue
		}
		c.verified++
	}
	// Listed sandboxes the test does not know: only a create or fork the crash cut may leave one.
	for id := range listed {
		if c.cutCreate > 0 {
			c.cutCreate--
			c.unknown++
		} else {
			c.violate("unknown sandbox %s listed (%s) though no create or fork was cut", id, listed[id].State)
		}
		d.call(30*time.Second, "DELETE", "/sandboxes/"+id, nil, nil)
	}
	c.checkSnapshots()
	c.checkHost()
	// Keep the population bounded.
	for len(c.live) > crashMaxLive {
		for id := range c.live {
			d.call(30*time.Second, "DELETE", "/sandboxes/"+id, nil, nil)
			delete(c.live, id)
			break
		}
	}
}

// checkSnapshots: a snapshot whose creation the crash cut is either absent or restores fully;
// only the two newest confirmed snapshots are kept.
func (c *crashRun) checkSnapshots() {
	d := c.d
	known := map[string]bool{}
	for _, s := range c.snaps {
		known[s.id] = true
	}
	for _, cs := range c.cutSnaps {
		var l []struct {
			SnapshotID string `json:"snapshotID"`
		}
		if code, body, err := d.call(30*time.Second, "GET", "/snapshots?sandboxID="+cs.src, nil, &l); code != 200 {
			c.violate("list snapshots of %s: %d %s %v", cs.src, code, body, err)
			continue
		}
		for _, sn := range l {
			if known[sn.SnapshotID] {
				continue
			}
			// It exists: it must restore, with its files.
			var s sbx
			code, body, err := d.call(90*time.Second, "POST", "/v2/sandboxes", map[string]any{"templateID": sn.SnapshotID, "timeout": 900}, &s)
			if code != 201 {
				c.violate("snapshot %s (its creation was cut by the crash) is listed but does not restore: %d %s %v", sn.SnapshotID, code, body, err)
			} else {
				if err := c.checkFiles(&tracked{s: s}, cs.files); err != nil {
					c.violate("snapshot %s (its creation was cut by the crash) restores without its files: %v", sn.SnapshotID, err)
				} else {
					c.snapsOK++
				}
				d.call(30*time.Second, "DELETE", "/sandboxes/"+s.SandboxID, nil, nil)
			}
			d.call(30*time.Second, "DELETE", "/templates/"+sn.SnapshotID, nil, nil)
		}
	}
	c.cutSnaps = nil
	// Every snapshot the API reported created restores, with its files (checked once each,
	// after the restart that followed it).
	for i := range c.snaps {
		sn := &c.snaps[i]
		if sn.verified {
			continue
		}
		sn.verified = true
		var s sbx
		code, body, err := d.call(90*time.Second, "POST", "/v2/sandboxes", map[string]any{"templateID": sn.id, "timeout": 900}, &s)
		if code != 201 {
			c.violate("snapshot %s (reported created) does not restore after the restart: %d %s %v", sn.id, code, body, err)
			continue
		}
		if err := c.checkFiles(&tracked{s: s}, sn.files); err != nil {
			c.violate("snapshot %s (reported created) restores without its files: %v", sn.id, err)
		} else {
			c.snapsOK++
		}
		d.call(30*time.Second, "DELETE", "/sandboxes/"+s.SandboxID, nil, nil)
	}
	for len(c.snaps) > 2 {
		d.call(30*time.Second, "DELETE", "/templates/"+c.snaps[0].id, nil, nil)
		c.snaps = c.snaps[1:]
	}
}

// settle waits (at most 10 s) until no restore runs and runsc runs at least the live running
// sandboxes plus a full pool.
func (c *crashRun) settle() {
	want := c.pool
	for _, tr := range c.live {
		if !tr.paused {
			want++
		}
	}
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		restoring := false
		for _, p := range c.d.runscProcs() {
			if strings.Contains(p.args, " restore ") {
				restoring = true
			}
		}
		running := 0
		for _, i := range c.d.instances() {
			if i.Status == "running" {
				running++
			}
		}
		if !restoring && running >= want {
			return
		}
	}
}

// checkHost: nothing runs, is mounted or kept on disk that the store does not know.
func (c *crashRun) checkHost() {
	d := c.d
	c.settle()
	insts := d.instances()
	owned := map[string]string{} // instance -> sandbox
	hot := map[string]bool{}     // instances of sandboxes paused in memory (frozen: runsc says paused)
	for _, id := range sortedKeys(c.live) {
		tr := c.live[id]
		if tr.paused {
			if i, _, err := d.findInstance(tr.s, insts); err == nil && i.Status == "paused" {
				owned[i.ID], hot[i.ID] = id, true
			}
			continue
		}
		if tr.instID != "" && containsInstance(insts, tr.instID) {
			owned[tr.instID] = id
			continue
		}
		i, _, err := d.findInstance(tr.s, insts)
		if err != nil {
			c.violate("running sandbox %s: %v", id, err)
			continue
		}
		owned[i.ID] = id
		tr.instID = i.ID
	}
	var extra, prestarted []string
	used := map[string]bool{}
	for _, i := range insts {
		if _, err := os.Stat(i.Bundle); err != nil {
			c.violate("instance %s (sandbox %q) runs with its state dir gone", i.ID, owned[i.ID])
		}
		used[d.instanceNetns(i)] = true
		switch {
		case i.Status == "created" && owned[i.ID] == "":
			prestarted = append(prestarted, i.ID)
		case hot[i.ID]:
			// a hot-paused sandbox's frozen instance
		case i.Status != "running":
			c.violate("instance %s (sandbox %q) is %s and still kept", i.ID, owned[i.ID], i.Status)
		case owned[i.ID] == "":
			extra = append(extra, i.ID)
		}
	}
	if len(extra) > c.pool+1 {
		c.violate("%d instances belong to no sandbox (pool size %d): %v", len(extra), c.pool, extra)
	}
	if len(prestarted) > crashPrestarted {
		c.violate("%d pre-started instances, want at most %d: %v", len(prestarted), crashPrestarted, prestarted)
	}
	// Slots are made in the background (slot pool): look again before calling a mismatch.
	var netProblem string
	for try := 0; try < 4; try++ {
		if try > 0 {
			time.Sleep(500 * time.Millisecond)
		}
		netProblem = ""
		spare := 0
		netns := d.netnsList()
		for _, n := range netns {
			if !used[n] {
				spare++
			}
		}
		if v := d.vethList(); len(v) != len(netns) {
			netProblem = fmt.Sprintf("veths %v do not match netns %v", v, netns)
		}
		if spare > crashSlotPool+1 {
			netProblem = fmt.Sprintf("%d netns belong to no instance (slot pool %d): %v", spare, crashSlotPool, netns)
		}
		if netProblem == "" {
			break
		}
	}
	if netProblem != "" {
		c.violate("%s", netProblem)
	}
	// Mounts, instance dirs and runsc processes that no instance owns. A launch makes its dir
	// and mounts just before runsc knows the instance: look again before calling one a stray.
	strays := func() []string {
		insts := d.instances()
		var dirs []string
		for _, i := range insts {
			dirs = append(dirs, filepath.Dir(i.Bundle))
		}
		under := func(p string) bool {
			for _, s := range dirs {
				if p == s || strings.HasPrefix(p, s+"/") {
					return true
				}
			}
			return false
		}
		var out []string
		h := d.host()
		forks := filepath.Join(d.dataDir, "forks") + "/"
		for _, m := range h.mounts {
			// A fork layer (the source's layer captured read-only) is mounted while a child
			// or a snapshot of one stacks it: checked at the end, when nothing is left.
			if !under(m) && !strings.HasPrefix(m, forks) {
				out = append(out, "mount "+m+" belongs to no running instance")
			}
		}
		for _, dir := range h.dirs {
			if !under(dir) {
				out = append(out, "instance dir "+dir+" belongs to no running instance")
			}
		}
		for _, p := range h.procs {
			if isSandboxOrGofer(p) && procInstance(p, insts) == "" {
				out = append(out, fmt.Sprintf("runsc process %d belongs to no instance: %.200s", p.pid, p.args))
			}
		}
		return out
	}
	var found []string
	for try := 0; try < 4; try++ {
		if try > 0 {
			time.Sleep(500 * time.Millisecond)
		}
		if found = strays(); len(found) == 0 {
			break
		}
	}
	for _, f := range found {
		c.violate("%s", f)
	}
	// Sandbox dirs: only listed sandboxes, and the pool's instances (which live under the id
	// they will be assigned with), have one.
	pool := d.poolSandboxIDs()
	dirs, _ := filepath.Glob(filepath.Join(d.dataDir, "sandboxes", "*"))
	for _, dir := range dirs {
		if pool[filepath.Base(dir)] {
			continue
		}
		if _, ok := c.live[filepath.Base(dir)]; !ok {
			if code := c.getCode(filepath.Base(dir)); code != 200 {
				c.violate("sandbox dir %s belongs to no sandbox (GET %d)", dir, code)
			}
		}
	}
}

func containsInstance(l []instance, id string) bool {
	for _, i := range l {
		if i.ID == id {
			return true
		}
	}
	return false
}

func (c *crashRun) getCode(id string) int {
	code, _, _ := c.d.call(30*time.Second, "GET", "/sandboxes/"+id, nil, nil)
	return code
}

func sortedKeys(m map[string]*tracked) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
