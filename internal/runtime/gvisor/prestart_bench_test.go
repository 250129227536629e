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
