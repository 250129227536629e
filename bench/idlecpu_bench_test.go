package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/sandbox"
)

// BenchmarkIdleCPU: the host CPU an idle running sandbox costs (its runsc processes: sentry,
// stubs and gofer), N = 40 sandboxes restored from `base` and left alone, next to the same
// node's pre-started instances (runsc's processes with no guest yet: the floor). What an idle
// sandbox costs bounds how many a node holds before the idle ones slow the busy ones: before
// envd's out-of-memory guard rested while nothing but envd runs (it read /proc/meminfo every 50
// ms), an idle sandbox cost 1.6–2.1 % of a core, so 40 of them took both cores of this host.
// Every second sandbox has a process left asleep in it (`sleep`, as a kernel or a server would
// be): there the guard looks at the memory 20 times a second, and what each look costs shows.
// EMBER_BENCH_IDLE_N sets N, EMBER_BENCH_IDLE_WINDOW the measured window (default 20 s).
func BenchmarkIdleCPU(b *testing.B) {
	n := getNode(b, 2)
	ctx := context.Background()
	count := 40
	if v, err := strconv.Atoi(os.Getenv("EMBER_BENCH_IDLE_N")); err == nil && v > 0 {
		count = v
	}
	window := 20 * time.Second
	if d, err := time.ParseDuration(os.Getenv("EMBER_BENCH_IDLE_WINDOW")); err == nil && d > 0 {
		window = d
	}
	fmt.Printf("\n== ember CPU of an idle sandbox (N = %d, restored from base, measured over %s; load %s) ==\n", count, window, loadAvg())
	var sbs []*sandbox.Sandbox
	defer func() {
		for _, sb := range sbs {
			n.Manager.Kill(ctx, sb.ID)
		}
	}()
	for i := 0; i < count; i++ {
		sb, err := n.Manager.Create(ctx, sandbox.CreateRequest{TemplateID: "base", NoPool: true})
		if err != nil {
			b.Fatal(err)
		}
		sbs = append(sbs, sb)
	}
	for i, sb := range sbs {
		if i%2 == 1 {
			if _, err := n.run(sb, "nohup sleep 86400 >/dev/null 2>&1 &"); err != nil {
				b.Fatal(err)
			}
		}
	}
	time.Sleep(5 * time.Second) // the last restores settle
	dirs, sleeping := map[string]bool{}, map[string]bool{}
	for i, sb := range sbs {
		if got, err := n.Manager.Get(ctx, sb.ID); err == nil && got.Runtime.StateDir != "" {
			if i%2 == 1 {
				sleeping[got.Runtime.StateDir] = true
			} else {
				dirs[got.Runtime.StateDir] = true
			}
		}
	}
	pre := map[string]bool{}
	marks, _ := filepath.Glob(filepath.Join(n.dataDir, "sandboxes", "*", "*", "prestart-image"))
	for _, f := range marks {
		pre[filepath.Dir(f)] = true
	}
	root := filepath.Join(n.dataDir, "runsc")
	sets := []struct {
		name string
		dirs map[string]bool
		a    map[int]uint64
	}{{name: "idle sandbox (envd, nothing running)", dirs: dirs}, {name: "idle sandbox, a process asleep in it", dirs: sleeping},
		{name: "baseline: pre-started instance (no guest)", dirs: pre}}
	for i := range sets {
		sets[i].a = runscCPU(root, sets[i].dirs)
	}
	time.Sleep(window)
	for _, s := range sets {
		after := runscCPU(root, s.dirs)
		var ticks uint64
		procs := 0
		for pid, t := range after {
			if t0, ok := s.a[pid]; ok && t >= t0 {
				ticks += t - t0
				procs++
			}
		}
		if len(s.dirs) == 0 || procs == 0 {
			fmt.Printf("%-44s none found\n", s.name)
			continue
		}
		// Clock ticks are 1/100 s: ticks per second over the window is % of one core.
		pct := float64(ticks) / window.Seconds() / float64(len(s.dirs))
		fmt.Printf("%-44s n=%-3d %.3f %% of a core each (%d processes)\n", s.name, len(s.dirs), pct, procs)
		b.ReportMetric(pct, strings.ReplaceAll(s.name, " ", "_")+"_pct_core")
	}
}

// runscCPU is the user+system clock ticks of every runsc process (sentry, gofer) of runscRoot
// whose bundle is in one of stateDirs, and of the sentries' systrap stub processes (their
// children, where the guest's code runs), by pid.
func runscCPU(runscRoot string, stateDirs map[string]bool) map[int]uint64 {
	type proc struct {
		ppid  int
		ticks uint64
	}
	all := map[int]proc{}
	ours := map[int]bool{}
	procs, _ := filepath.Glob("/proc/[0-9]*")
	for _, p := range procs {
		pid, _ := strconv.Atoi(filepath.Base(p))
		st, err := os.ReadFile(p + "/stat")
		if err != nil {
			continue
		}
		// "pid (comm) S ppid ...": ppid is field 4, utime and stime fields 14 and 15.
		i := strings.LastIndexByte(string(st), ')')
		f := strings.Fields(string(st)[i+1:])
		if len(f) < 13 {
			continue
		}
		ppid, _ := strconv.Atoi(f[1])
		u, _ := strconv.ParseUint(f[11], 10, 64)
		s, _ := strconv.ParseUint(f[12], 10, 64)
		all[pid] = proc{ppid, u + s}
		if cl, err := os.ReadFile(p + "/cmdline"); err == nil && runscOf(string(cl), runscRoot, stateDirs) {
			ours[pid] = true
		}
	}
	out := map[int]uint64{}
	for pid, p := range all {
		if ours[pid] || ours[p.ppid] {
			out[pid] = p.ticks
		}
	}
	return out
}
