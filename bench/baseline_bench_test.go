package bench

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// BenchmarkBaselines prints issue 11's rows next to the baselines they are measured against, in
// the same run: ember's create (warm pool, pool miss, cold boot), pause and resume; plain runc;
// and runsc itself driven by hand — `runsc checkpoint` and `runsc restore` of the same images,
// one at a time and 16 at once, with the restore flags the issue asks about — and where a
// restore's time goes, from runsc's own debug-log timers.
func BenchmarkBaselines(b *testing.B) {
	n := getNode(b, 2)
	ctx := context.Background()
	fmt.Printf("\n== ember baselines: issue 11's rows next to runc and raw runsc (%d iterations, medians and p99) ==\n", iterations)
	tpl, err := n.Store.GetTemplate(ctx, "base")
	if err != nil {
		b.Fatal(err)
	}

	// The host is shared and noisy: the figures compared are measured interleaved, one of each
	// per round, so that each sees the same load.
	createOne := func(req sandbox.CreateRequest) time.Duration {
		t0 := time.Now()
		sb, err := n.Manager.Create(ctx, req)
		if err != nil {
			b.Fatal(err)
		}
		el := time.Since(t0)
		n.Manager.Kill(ctx, sb.ID)
		return el
	}
	time.Sleep(2 * time.Second) // a full pool to start from
	var pool dist
	for i := 0; i < 20; i++ {
		pool = append(pool, createOne(sandbox.CreateRequest{TemplateID: "base"}))
	}
	runc := runcStart(b, n)

	raw := newRawRunsc(b, n)
	rawOne := func(i int, image string, flags ...string) time.Duration {
		id := fmt.Sprintf("rawseq-%04d", i)
		el, err := raw.restore(raw.instance(b, 0), id, image, "", flags...)
		if err != nil {
			b.Fatal(err)
		}
		raw.remove(id)
		return el
	}
	var miss, cold, rawRestore, rawRestoreBg, rawRestoreDirect dist
	for i := 0; i < iterations; i++ {
		miss = append(miss, createOne(sandbox.CreateRequest{TemplateID: "base", NoPool: true}))
		cold = append(cold, createOne(sandbox.CreateRequest{TemplateID: "base", Cold: true}))
		rawRestore = append(rawRestore, rawOne(i, tpl.Image))
		rawRestoreBg = append(rawRestoreBg, rawOne(i, tpl.Image, "--background"))
		rawRestoreDirect = append(rawRestoreDirect, rawOne(i, tpl.Image, "--direct"))
	}

	// Pause and resume of one sandbox; raw checkpoint of an instance restored from the template
	// (what a pause checkpoints) and raw restore of that image (what a resume restores), with and
	// without zero pages.
	sb, err := n.Manager.Create(ctx, sandbox.CreateRequest{TemplateID: "base", NoPool: true})
	if err != nil {
		b.Fatal(err)
	}
	ckptAndBack := func(i int, ckptFlags ...string) (ckpt, back time.Duration, imgBytes int64) {
		id, id2 := fmt.Sprintf("rawckp-%04d", i), fmt.Sprintf("rawbck-%04d", i)
		bundle := raw.instance(b, 0)
		if _, err := raw.restore(bundle, id, tpl.Image, ""); err != nil {
			b.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond) // let the restored instance settle, as a paused sandbox has
		img := filepath.Join(raw.dir, "img-"+id)
		os.MkdirAll(img, 0o700)
		t0 := time.Now()
		if _, err := raw.run(append(append([]string{"checkpoint", "--image-path", img, "--compression=none"}, ckptFlags...), id)...); err != nil {
			b.Fatal(err)
		}
		ckpt = time.Since(t0)
		raw.remove(id)
		imgBytes = diskBytes(img)
		back, err := raw.restore(bundle, id2, img, "")
		if err != nil {
			b.Fatal(err)
		}
		raw.remove(id2)
		os.RemoveAll(img)
		return ckpt, back, imgBytes
	}
	var pause, resume, rawCkpt, rawBack, rawCkptZ, rawBackZ dist
	var imgBytes, imgBytesZ int64
	for i := 0; i < iterations; i++ {
		t0 := time.Now()
		if err := n.Manager.Pause(ctx, sb.ID); err != nil {
			b.Fatal(err)
		}
		pause = append(pause, time.Since(t0))
		t1 := time.Now()
		if _, _, err := n.Manager.Connect(ctx, sb.ID, time.Minute); err != nil {
			b.Fatal(err)
		}
		resume = append(resume, time.Since(t1))
		c, r, sz := ckptAndBack(i)
		rawCkpt, rawBack, imgBytes = append(rawCkpt, c), append(rawBack, r), sz
		c, r, sz = ckptAndBack(i, "--exclude-committed-zero-pages")
		rawCkptZ, rawBackZ, imgBytesZ = append(rawCkptZ, c), append(rawBackZ, r), sz
	}
	n.Manager.Kill(ctx, sb.ID)

	// 16 restores of the template's image at once, each instance with its own network
	// namespace; three rounds of each flag set, alternated.
	const conc, rounds = 16, 3
	concurrent := func(flags ...string) (d dist, wall time.Duration) {
		var mu sync.Mutex
		var wg sync.WaitGroup
		bundles := make([]string, conc)
		for i := range bundles {
			bundles[i] = raw.instance(b, i)
		}
		t0 := time.Now()
		for i := 0; i < conc; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				el, err := raw.restore(bundles[i], fmt.Sprintf("rawcon-%04d", i), tpl.Image, "", flags...)
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					fmt.Printf("  concurrent raw restore: %v\n", err)
					return
				}
				d = append(d, el)
			}()
		}
		wg.Wait()
		wall = time.Since(t0)
		for i := 0; i < conc; i++ {
			raw.remove(fmt.Sprintf("rawcon-%04d", i))
		}
		return d, wall
	}
	var conPlain, conDirect, conBg, conPlainWall, conDirectWall, conBgWall dist
	for r := 0; r < rounds; r++ {
		d, w := concurrent()
		conPlain, conPlainWall = append(conPlain, d...), append(conPlainWall, w)
		d, w = concurrent("--direct")
		conDirect, conDirectWall = append(conDirect, d...), append(conDirectWall, w)
		d, w = concurrent("--background")
		conBg, conBgWall = append(conBg, d...), append(conBgWall, w)
	}

	fmt.Println("-- ember --")
	report(b, "create from warm pool, 20 sequential", pool)
	report(b, "create on pool miss (restore + /init)", miss)
	report(b, "create by cold boot (boot + envd up)", cold)
	report(b, "pause (checkpoint + release)", pause)
	report(b, "resume (restore, same id)", resume)
	fmt.Println("-- baselines --")
	if len(runc) > 0 {
		report(b, "runc: plain container start of same rootfs", runc)
	}
	report(b, "raw runsc restore, template image", rawRestore)
	report(b, "raw runsc restore --background, same", rawRestoreBg)
	report(b, "raw runsc restore --direct, same", rawRestoreDirect)
	report(b, "raw runsc checkpoint (instance exits)", rawCkpt)
	report(b, "raw runsc restore of that image", rawBack)
	report(b, "raw runsc checkpoint --exclude-zero-pages", rawCkptZ)
	report(b, "raw runsc restore of that image (no zeros)", rawBackZ)
	fmt.Printf("raw checkpoint image on disk: %.1f MiB, with --exclude-committed-zero-pages %.1f MiB\n", float64(imgBytes)/(1<<20), float64(imgBytesZ)/(1<<20))
	report(b, fmt.Sprintf("raw runsc restore, %d at once", conc), conPlain)
	report(b, fmt.Sprintf("raw runsc restore --direct, %d at once", conc), conDirect)
	report(b, fmt.Sprintf("raw runsc restore --background, %d at once", conc), conBg)
	fmt.Printf("%d concurrent raw restores, wall (median of %d rounds): plain %s ms, --direct %s ms, --background %s ms\n", conc, rounds,
		ms(conPlainWall.pct(0.5)), ms(conDirectWall.pct(0.5)), ms(conBgWall.pct(0.5)))

	fmt.Println("-- issue 11 rows against their baselines (p50 / p99, ms) --")
	row := func(name string, d dist, base string, bd dist) {
		fmt.Printf("%-38s %7s / %-7s  vs %-30s %7s / %-7s  (%.2fx)\n", name, ms(d.pct(0.5)), ms(d.pct(0.99)), base, ms(bd.pct(0.5)), ms(bd.pct(0.99)), ratio(d, bd))
	}
	row("create on pool miss", miss, "raw runsc restore", rawRestore)
	row("create on pool miss", miss, "cold boot", cold)
	row("create from warm pool (20 seq.)", pool, "raw runsc restore", rawRestore)
	row("pause", pause, "raw runsc checkpoint", rawCkpt)
	row("resume", resume, "raw runsc restore of its image", rawBack)
	if len(runc) > 0 {
		row("cold boot", cold, "runc start", runc)
		row("raw runsc restore", rawRestore, "runc start", runc)
	}

	raw.breakdown(b, tpl.Image)
}

// rawRunsc drives runsc by hand with the node's global flags, outside ember's Manager and
// driver: the floor ember's own work is measured against. Instances borrow the root filesystem
// of one sandbox the Manager made (all restore the same images) and each gets a network
// namespace of its own, named after the benchmark node.
type rawRunsc struct {
	runsc, dir, node string
	flags            []string
	config           map[string]any // the borrowed sandbox's OCI spec
	mu               sync.Mutex
	netns            map[int]bool
}

func newRawRunsc(b *testing.B, n *node) *rawRunsc {
	b.Helper()
	ctx := context.Background()
	sb, err := n.Manager.Create(ctx, sandbox.CreateRequest{TemplateID: "base", NoPool: true})
	if err != nil {
		b.Fatal(err)
	}
	info, err := n.Manager.Get(ctx, sb.ID)
	if err != nil {
		b.Fatal(err)
	}
	cfg, err := os.ReadFile(filepath.Join(info.Runtime.StateDir, "bundle", "config.json"))
	if err != nil {
		b.Fatal(err)
	}
	r := &rawRunsc{runsc: testutil.Runsc(b), dir: b.TempDir(), node: envOr("EMBER_BENCH_NODE", "bench"), netns: map[int]bool{}}
	if err := json.Unmarshal(cfg, &r.config); err != nil {
		b.Fatal(err)
	}
	// The driver's global flags for this node (internal/runtime/gvisor globalFlags).
	r.flags = []string{"--root=" + filepath.Join(n.dataDir, "runsc"), "--platform=systrap", "--overlay2=none",
		"--network=sandbox", "--allow-suid", "--log=" + filepath.Join(r.dir, "runsc.log")}
	b.Cleanup(func() {
		for i := range r.netns {
			exec.Command("ip", "netns", "del", r.netnsName(i)).Run()
		}
		n.Manager.Kill(ctx, sb.ID)
	})
	return r
}

func (r *rawRunsc) netnsName(i int) string { return fmt.Sprintf("%s-raw%d", r.node, i) }

// instance returns the bundle of raw instance slot i (its own network namespace and cgroup).
func (r *rawRunsc) instance(b *testing.B, i int) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	bundle := filepath.Join(r.dir, fmt.Sprintf("bundle-%d", i))
	if r.netns[i] {
		return bundle
	}
	if out, err := exec.Command("ip", "netns", "add", r.netnsName(i)).CombinedOutput(); err != nil {
		b.Fatalf("ip netns add: %v %s", err, out)
	}
	r.netns[i] = true
	exec.Command("ip", "netns", "exec", r.netnsName(i), "ip", "link", "set", "lo", "up").Run()
	var spec map[string]any
	js, _ := json.Marshal(r.config)
	json.Unmarshal(js, &spec)
	linux := spec["linux"].(map[string]any)
	for _, ns := range linux["namespaces"].([]any) {
		if m := ns.(map[string]any); m["type"] == "network" {
			m["path"] = "/run/netns/" + r.netnsName(i)
		}
	}
	if cg, ok := linux["cgroupsPath"].(string); ok {
		linux["cgroupsPath"] = filepath.Join(filepath.Dir(cg), fmt.Sprintf("raw-%d", i))
	}
	js, _ = json.Marshal(spec)
	os.MkdirAll(bundle, 0o700)
	if err := os.WriteFile(filepath.Join(bundle, "config.json"), js, 0o600); err != nil {
		b.Fatal(err)
	}
	return bundle
}

// run runs a runsc command with the node's flags, stdio on /dev/null (a detached sandbox keeps
// the descriptors it inherits).
func (r *rawRunsc) run(args ...string) (time.Duration, error) {
	null, err := os.OpenFile(os.DevNull, os.O_RDWR, 0)
	if err != nil {
		return 0, err
	}
	defer null.Close()
	errf, err := os.CreateTemp(r.dir, "stderr-")
	if err != nil {
		return 0, err
	}
	defer os.Remove(errf.Name())
	defer errf.Close()
	cmd := exec.Command(r.runsc, append(append([]string(nil), r.flags...), args...)...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = null, null, errf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	t0 := time.Now()
	err = cmd.Run()
	el := time.Since(t0)
	if err != nil {
		msg, _ := os.ReadFile(errf.Name())
		return el, fmt.Errorf("runsc %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(string(msg)))
	}
	return el, nil
}

// restore runs `runsc restore --detach` of image into bundle as id; debugDir, if set, gets
// runsc's debug logs.
func (r *rawRunsc) restore(bundle, id, image, debugDir string, flags ...string) (time.Duration, error) {
	args := []string{"restore", "--detach", "--bundle", bundle, "--image-path", image}
	if debugDir != "" {
		args = append([]string{"--debug", "--debug-log=" + debugDir + "/"}, args...)
	}
	return r.run(append(append(args, flags...), id)...)
}

// remove kills and deletes a raw instance.
func (r *rawRunsc) remove(id string) {
	r.run("kill", id, "KILL")
	r.run("delete", "--force", id)
}

// breakdown restores image once with runsc's debug log on and prints the longest steps of its
// timers: the sandbox's boot midpoints and the restore phases (debug logging makes each slower
// than the figures above; the shares are what matter).
func (r *rawRunsc) breakdown(b *testing.B, image string) {
	dbg := filepath.Join(r.dir, "debug")
	os.MkdirAll(dbg, 0o700)
	id := "rawdbg-0000"
	el, err := r.restore(r.instance(b, 0), id, image, dbg)
	if err != nil {
		fmt.Printf("restore breakdown: %v\n", err)
		return
	}
	time.Sleep(300 * time.Millisecond) // the boot log's timeline is written once the kernel starts
	r.remove(id)
	fmt.Printf("-- where a raw restore's time goes (runsc debug-log timers; this restore took %s with --debug) --\n", el.Round(time.Millisecond))
	logs, _ := filepath.Glob(filepath.Join(dbg, "*.boot.txt"))
	for _, l := range logs {
		for _, tl := range parseTimelines(l) {
			tl.print(8)
		}
	}
}

// timeline is one of runsc's timing.Timer timelines: its name, total and top-level steps.
type timeline struct {
	name  string
	total time.Duration
	steps []step
}

type step struct {
	name string
	d    time.Duration
}

func (t timeline) print(top int) {
	s := append([]step(nil), t.steps...)
	sort.SliceStable(s, func(i, j int) bool { return s[i].d > s[j].d })
	if len(s) > top {
		s = s[:top]
	}
	var parts []string
	for _, st := range s {
		parts = append(parts, fmt.Sprintf("%s %s", st.name, ms(st.d)))
	}
	fmt.Printf("%-12s total %6s ms; longest steps (ms): %s\n", t.name, ms(t.total), strings.Join(parts, ", "))
}

// A timeline line: "[hh:mm:ss.us]\t +1 234µs ▉▉\t├─ step name: 1 234µs ..." (the first column
// is the timeline's own; further columns are its forked sub-timelines).
var (
	stepRe  = regexp.MustCompile(`^[├╰]─ (.+?): ([0-9][0-9  ]*)µs`)
	startRe = regexp.MustCompile(`^╭─ (.+?)\s*$`)
	totalRe = regexp.MustCompile(`total ([0-9][0-9  ]*)µs`)
)

func parseTimelines(path string) []timeline {
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []timeline
	var cur *timeline
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "[") {
			continue
		}
		cols := strings.Split(line, "\t")
		if len(cols) < 3 {
			continue
		}
		first := strings.TrimSpace(cols[2])
		if m := startRe.FindStringSubmatch(first); m != nil {
			out = append(out, timeline{name: m[1]})
			cur = &out[len(out)-1]
			continue
		}
		if cur == nil {
			continue
		}
		if m := stepRe.FindStringSubmatch(first); m != nil {
			d := microseconds(m[2])
			if m[1] == "END" || strings.HasPrefix(first, "╰─ END") {
				if t := totalRe.FindStringSubmatch(first); t != nil {
					cur.total = microseconds(t[1])
				}
				cur = nil
				continue
			}
			cur.steps = append(cur.steps, step{m[1], d})
		} else if strings.HasPrefix(first, "╰─ END") {
			if t := totalRe.FindStringSubmatch(first); t != nil {
				cur.total = microseconds(t[1])
			}
			cur = nil
		}
	}
	return out
}

func microseconds(s string) time.Duration {
	s = strings.Map(func(r rune) rune {
		if r >= '0' && r <= '9' {
			return r
		}
		return -1
	}, s)
	v, _ := strconv.ParseInt(s, 10, 64)
	return time.Duration(v) * time.Microsecond
}

// diskBytes is the disk the regular files under dir take (allocated blocks).
func diskBytes(dir string) int64 {
	var total int64
	filepath.Walk(dir, func(_ string, fi os.FileInfo, err error) error {
		if err == nil && fi.Mode().IsRegular() {
			if st, ok := fi.Sys().(*syscall.Stat_t); ok {
				total += st.Blocks * 512
			}
		}
		return nil
	})
	return total
}
