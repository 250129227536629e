package bench

import (
	"strings"
	"testing"
	"time"
)

// The targets table judges each figure against its target as the issue states it: a limit on
// p50 or p99, a margin over the baseline's p50, a rate that must reach a floor, a figure that
// must not exceed its baseline.
func TestTargetsTableVerdicts(t *testing.T) {
	recordedMu.Lock()
	saved, savedScalars := recorded, scalars
	recorded, scalars = map[string]dist{}, map[string]float64{}
	recordedMu.Unlock()
	defer func() { recordedMu.Lock(); recorded, scalars = saved, savedScalars; recordedMu.Unlock() }()

	msd := func(v ...float64) dist {
		var d dist
		for _, x := range v {
			d = append(d, time.Duration(x*float64(time.Millisecond)))
		}
		return d
	}
	recordDist("hot pause (HTTP)", msd(5, 6, 7))
	recordDist("resume after demotion to disk (HTTP)", msd(70, 75, 80))
	recordDist("raw runsc restore into a created container", msd(60, 66, 70))
	recordDist("20 sequential creates, pool sized by a burst", msd(5, 6, 31))
	recordScalar(loadCreatesPerSec, 6.8)
	recordScalar(loadRawRestoresPerSec, 9.2)
	recordScalar(hotPausedPSS, 22.0)
	recordScalar(runningPSS, 21.6)

	want := map[string]string{
		"pause (hot)":                                "met",    // 6 ≤ 10
		"resume after demotion (state on disk)":      "met",    // 75 ≤ 66 + 10
		"20 sequential creates (p99)":                "missed", // p99 31 > 30
		"creates per second, 100 at once, from cold": "missed", // 6.8 < 12
		"memory of a hot-paused idle sandbox (PSS)":  "missed", // 22.0 > 21.6
	}
	for _, tg := range targets {
		row, ok := tg.row()
		verdict, wanted := want[tg.figure]
		if !wanted {
			if ok {
				t.Errorf("%s: a row without its figure recorded: %q", tg.figure, row)
			}
			continue
		}
		if !ok || !strings.HasSuffix(row, " "+verdict) {
			t.Errorf("%s: row %q, want it to end with %q", tg.figure, row, verdict)
		}
	}
	recordDist("raw runsc restore into a created container", msd(50, 55, 60))
	for _, tg := range targets {
		if tg.figure == "resume after demotion (state on disk)" {
			if row, _ := tg.row(); !strings.HasSuffix(row, " missed") {
				t.Errorf("75 over a baseline of 55 + 10: %q", row)
			}
		}
	}
}
