package bench

import (
	"fmt"
	"sort"
	"strings"
	"sync"
	"time"
)

// The figures issues 18 (the agent loop) and 20 (Code Interpreter) set targets for, gathered
// from whatever benchmarks ran and printed as one table when the run ends (`make bench`, or any
// -bench pattern: rows whose benchmark did not run are left out). Each row is the figure as the
// benchmark printed it, its target, and its baseline from the same run.

var (
	recordedMu sync.Mutex
	recorded   = map[string]dist{}    // report's name → the durations it printed
	scalars    = map[string]float64{} // recordScalar's name → value
)

// recordScalar keeps a figure that is not a set of durations (a rate, a memory size) for the
// targets table.
func recordScalar(name string, v float64) {
	recordedMu.Lock()
	defer recordedMu.Unlock()
	scalars[name] = v
}

func recordDist(name string, d dist) {
	recordedMu.Lock()
	defer recordedMu.Unlock()
	recorded[name] = append(dist(nil), d...)
}

// A target: figure names the row as the issue does; key names the figure (report's name, or
// recordScalar's when scalar); the target is on p50 unless onP99. limit is in ms, or in the
// scalar's unit; with overBaseline it is added to the baseline's p50. atLeast: higher is better.
type target struct {
	issue        int
	figure       string
	key          string
	baseline     string
	limit        float64
	onP99        bool
	overBaseline bool
	scalar       bool
	atLeast      bool
	unit         string
}

var targets = []target{
	{issue: 18, figure: "pause (hot)", key: "hot pause (HTTP)", baseline: "checkpoint pause (old)", limit: 10},
	{issue: 18, figure: "resume of a hot-paused sandbox", key: "resume, hot-paused: thaw (HTTP)", baseline: "raw runsc restore (new container)", limit: 10},
	{issue: 18, figure: "resume after demotion (state on disk)", key: "resume after demotion to disk (HTTP)", baseline: "raw runsc restore into a created container", limit: 10, overBaseline: true},
	{issue: 18, figure: "step checkpoint: answer", key: "checkpoint: answer (HTTP)", baseline: "baseline: raw runsc checkpoint --leave-running", limit: 50},
	{issue: 18, figure: "step checkpoint: sandbox stopped", key: "checkpoint: sandbox stopped", baseline: "baseline: raw runsc checkpoint --leave-running", limit: 30},
	{issue: 18, figure: "rollback with a standby", key: "rollback with standby (HTTP)", limit: 20},
	{issue: 18, figure: "rollback without a standby", key: "rollback without standby (HTTP)", baseline: "baseline: raw runsc restore", limit: 10, overBaseline: true},
	{issue: 18, figure: "named snapshot after 1 GiB written: answer", key: "named snapshot after 1 GiB written: answer", baseline: "baseline: cp --reflink=always of the layer", limit: 150},
	{issue: 18, figure: "fork into 16, per child", key: "fork into 16, per child: over the captured layer", baseline: "floor: 16 raw runsc restores at once, wall per restore", limit: 100},
	{issue: 18, figure: "create → first command, create–run–kill loop", key: "SDK create -> first run done (loop)", baseline: "baseline: bash -l -c true inside sandbox", limit: 40},
	{issue: 18, figure: "20 sequential creates (p99)", key: "20 sequential creates, pool sized by a burst", baseline: "20 sequential creates, cold pool", limit: 30, onP99: true},
	{issue: 18, figure: "creates per second, 100 at once, from cold", key: loadCreatesPerSec, baseline: loadRawRestoresPerSec, limit: 12, scalar: true, atLeast: true, unit: "/s"},
	{issue: 18, figure: "memory of a hot-paused idle sandbox (PSS)", key: hotPausedPSS, baseline: runningPSS, scalar: true, unit: " MiB"},
	{issue: 18, figure: "agent loop: step overhead", key: "agent step overhead, hot pause", baseline: "agent step overhead, checkpoint pause (old)"},
	{issue: 20, figure: "Sandbox.create() code-interpreter-v1 (pool)", key: "Sandbox.create() code-interpreter-v1 (pool)", baseline: "  baseline: Sandbox.create() base (pool)", limit: 15},
	{issue: 20, figure: "runCode('1+1'), warm context", key: "runCode('1+1'), warm context", baseline: "  baseline: commands.run('true')", limit: 15},
	{issue: 20, figure: "first runCode after create", key: "first runCode('1+1') after create", limit: 50},
	{issue: 20, figure: "a matplotlib plot as PNG", key: "matplotlib plot as PNG (runCode)"},
}

// Scalar figures' names (recordScalar).
const (
	loadCreatesPerSec     = "creates/s, 100 at once from cold, a command each"
	loadRawRestoresPerSec = "raw runsc restores/s, 100 at once"
	hotPausedPSS          = "hot-paused idle sandbox, PSS MiB"
	runningPSS            = "running idle sandbox, PSS MiB"
)

// printTargets prints the table of the targets whose figures were recorded in this run.
func printTargets() {
	recordedMu.Lock()
	defer recordedMu.Unlock()
	var rows []string
	for _, t := range targets {
		row, ok := t.row()
		if ok {
			rows = append(rows, row)
		}
	}
	if len(rows) == 0 {
		return
	}
	fmt.Printf("\n== targets of issues 18 and 20, figures of this run (%s, host load %s) ==\n", time.Now().UTC().Format("2006-01-02 15:04 UTC"), loadAvg())
	fmt.Printf("%-5s %-46s %-19s %-16s %-30s %s\n", "issue", "figure", "this run", "target", "baseline (same run)", "")
	for _, r := range rows {
		fmt.Println(r)
	}
	var missing []string
	for _, t := range targets {
		if _, ok := t.row(); !ok {
			missing = append(missing, t.figure)
		}
	}
	if len(missing) > 0 {
		sort.Strings(missing)
		fmt.Printf("not measured in this run: %s\n", strings.Join(missing, "; "))
	}
}

// row formats t, or reports that its figure was not recorded.
func (t target) row() (string, bool) {
	var value, limit float64
	var shown, base, goal string
	if t.scalar {
		v, ok := scalars[t.key]
		if !ok {
			return "", false
		}
		value, shown = v, fmt.Sprintf("%.1f%s", v, t.unit)
		if b, ok := scalars[t.baseline]; ok {
			base = fmt.Sprintf("%.1f%s", b, t.unit)
			if t.limit == 0 && !t.atLeast {
				limit, goal = b, "≤ baseline"
			}
		}
	} else {
		d, ok := recorded[t.key]
		if !ok || len(d) == 0 {
			return "", false
		}
		p50, p99 := msf(d.pct(0.5)), msf(d.pct(0.99))
		value, shown = p50, fmt.Sprintf("%.1f / %.1f ms", p50, p99)
		if t.onP99 {
			value = p99
		}
		if b, ok := recorded[t.baseline]; ok && len(b) > 0 {
			base = fmt.Sprintf("%.1f / %.1f ms", msf(b.pct(0.5)), msf(b.pct(0.99)))
			if t.overBaseline {
				limit = msf(b.pct(0.5)) + t.limit
			}
		}
	}
	if t.limit != 0 && !t.overBaseline {
		limit = t.limit
	}
	switch {
	case t.scalar && t.atLeast:
		goal = fmt.Sprintf("≥ %g%s", t.limit, t.unit)
	case t.scalar:
	case t.overBaseline:
		goal = fmt.Sprintf("≤ baseline + %g", t.limit)
	case t.limit != 0:
		goal = fmt.Sprintf("≤ %g", t.limit)
		if t.onP99 {
			goal += " (p99)"
		}
	}
	verdict := "measured"
	if limit != 0 {
		met := value <= limit
		if t.atLeast {
			met = value >= limit
		}
		verdict = map[bool]string{true: "met", false: "missed"}[met]
	}
	if t.baseline != "" && base == "" {
		base = "(not measured)"
	}
	return fmt.Sprintf("%-5d %-46s %-19s %-16s %-30s %s", t.issue, t.figure, shown, goal, base, verdict), true
}

func msf(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
