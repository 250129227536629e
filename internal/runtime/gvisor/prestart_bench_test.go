package gvisor_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/runtime/drivertest"
	"github.com/ember-sandbox/ember/internal/runtime/gvisor"
)

// BenchmarkPrestart compares, at the driver, a restore of an image into a new instance with a
// restore into an instance pre-started (untimed; its own cost is reported as prestart-ms-p50)
// from the same image, with and without a disk limit on the layer.
func BenchmarkPrestart(b *testing.B) {
	for _, diskMB := range []int{0, 2048} {
		for _, pre := range []bool{false, true} {
			b.Run(fmt.Sprintf("disk=%dMiB/prestarted=%v", diskMB, pre), func(b *testing.B) {
				d := newDriver(b, nil)
				rootfs := drivertest.BusyboxRootFS(b)
				ctx := context.Background()
				sp := startIdle(b, d, rootfs, 99999999, 0)
				img := b.TempDir()
				if err := d.Checkpoint(ctx, sp.ID, img, runtime.CheckpointOptions{LeaveRunning: true}); err != nil {
					b.Fatal(err)
				}
				var ts, pts timings
				for i := 0; i < b.N; i++ {
					c := benchSpec(b, rootfs, i)
					c.DiskMB = diskMB
					if pre {
						b.StopTimer()
						t0 := time.Now()
						if err := d.Prestart(ctx, c, img); err != nil {
							b.Fatal(err)
						}
						pts = append(pts, time.Since(t0))
						if i == 0 {
							b.ReportMetric(float64(privateKiB(c.ID))/1024, "prestarted-private-MiB")
						}
						b.StartTimer()
					}
					t0 := time.Now()
					var err error
					if pre {
						err = d.RestoreInto(ctx, c.ID, img)
					} else {
						err = d.Restore(ctx, c, img)
					}
					if err != nil {
						b.Fatal(err)
					}
					ts = append(ts, time.Since(t0))
					b.StopTimer()
					if err := d.Delete(ctx, c.ID); err != nil {
						b.Fatal(err)
					}
					b.StartTimer()
				}
				ts.report(b)
				if len(pts) > 0 {
					b.ReportMetric(float64(median([]time.Duration(pts)).Microseconds())/1000, "prestart-ms-p50")
				}
			})
		}
	}
}

// privateKiB sums the private memory of the host processes whose command line names id.
func privateKiB(id string) int64 {
	var kib int64
	procs, _ := filepath.Glob("/proc/[0-9]*")
	for _, p := range procs {
		cl, err := os.ReadFile(p + "/cmdline")
		if err != nil || !strings.Contains(string(cl), id) {
			continue
		}
		data, _ := os.ReadFile(p + "/smaps_rollup")
		for _, line := range strings.Split(string(data), "\n") {
			if f := strings.Fields(line); len(f) >= 2 && (f[0] == "Private_Clean:" || f[0] == "Private_Dirty:") {
				v, _ := strconv.ParseInt(f[1], 10, 64)
				kib += v
			}
		}
	}
	return kib
}

// BenchmarkRestoreIntoPhases shows where a restore into a pre-started instance spends its time,
// from runsc's own debug logs (timestamps of its log lines and the sandbox's "Timer for
// Restore" midpoints), per phase, medians in ms: cli (the `runsc restore` process until its RPC
// reaches the sandbox), setup (from there until the kernel state is read; it includes seccomp:
// the sentry building its seccomp filters inside the restore, issue 11 lever 2), kernel
// (loading the kernel state and memory), start (until the command returns), and total.
func BenchmarkRestoreIntoPhases(b *testing.B) {
	d := newDriver(b, func(c *gvisor.Config) { c.Debug = true })
	rootfs := drivertest.BusyboxRootFS(b)
	ctx := context.Background()
	sp := startIdle(b, d, rootfs, 99999999, 0)
	img := b.TempDir()
	if err := d.Checkpoint(ctx, sp.ID, img, runtime.CheckpointOptions{LeaveRunning: true}); err != nil {
		b.Fatal(err)
	}
	phases := map[string]timings{}
	for i := 0; i < b.N; i++ {
		c := benchSpec(b, rootfs, i)
		c.DiskMB = 2048
		if err := d.Prestart(ctx, c, img); err != nil {
			b.Fatal(err)
		}
		if err := d.RestoreInto(ctx, c.ID, img); err != nil {
			b.Fatal(err)
		}
		for k, v := range restorePhases(b, filepath.Join(c.StateDir, "logs")) {
			phases[k] = append(phases[k], v)
		}
		if err := d.Delete(ctx, c.ID); err != nil {
			b.Fatal(err)
		}
	}
	for _, k := range []string{"cli", "setup", "seccomp", "kernel", "start", "total"} {
		if len(phases[k]) > 0 {
			b.ReportMetric(float64(median([]time.Duration(phases[k])).Microseconds())/1000, k+"-ms-p50")
		}
	}
	b.ReportMetric(0, "ns/op")
}

// restorePhases reads the debug logs of one restore (logs: an instance's log directory).
func restorePhases(b *testing.B, logs string) map[string]time.Duration {
	b.Helper()
	lines := func(pattern string) []string {
		m, _ := filepath.Glob(filepath.Join(logs, pattern))
		if len(m) != 1 {
			b.Fatalf("debug logs %s: %v", pattern, m)
		}
		data, err := os.ReadFile(m[0])
		if err != nil {
			b.Fatal(err)
		}
		return strings.Split(strings.TrimSpace(string(data)), "\n")
	}
	at := func(line string) time.Time {
		f := strings.Fields(line)
		if len(f) < 2 {
			return time.Time{}
		}
		t, _ := time.Parse("15:04:05.000000", f[1])
		return t
	}
	find := func(ls []string, sub string, last bool) time.Time {
		var t time.Time
		for _, l := range ls {
			if strings.Contains(l, sub) {
				t = at(l)
				if !last {
					return t
				}
			}
		}
		return t
	}
	cli, boot := lines("*.restore.txt"), lines("*.boot.txt")
	cliStart, cliEnd := at(cli[0]), at(cli[len(cli)-1])
	rpc := find(boot, "midpoint cm.Restore RPC", false)
	loading := find(boot, "midpoint loading kernel", false)
	loaded := find(boot, "midpoint kernel loaded", false)
	seccomp := time.Duration(0)
	for _, l := range boot {
		// The filters built after the RPC (the sentry's, for the restored kernel).
		if strings.Contains(l, "Seccomp program optimized") && !at(l).Before(rpc) {
			var from, to int
			var build, opt string
			if _, err := fmt.Sscanf(l[strings.Index(l, "Seccomp program"):], "Seccomp program optimized from %d to %d instructions; took %s to build and %s to optimize", &from, &to, &build, &opt); err == nil {
				bd, _ := time.ParseDuration(build)
				od, _ := time.ParseDuration(opt)
				seccomp += bd + od
			}
		}
	}
	return map[string]time.Duration{
		"cli":     rpc.Sub(cliStart),
		"setup":   loading.Sub(rpc),
		"seccomp": seccomp,
		"kernel":  loaded.Sub(loading),
		"start":   cliEnd.Sub(loaded),
		"total":   cliEnd.Sub(cliStart),
	}
}
