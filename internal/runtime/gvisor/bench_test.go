package gvisor_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/runtime/drivertest"
	"github.com/ember-sandbox/ember/internal/runtime/gvisor"
)

// The benchmarks report the median in ms (ms-p50) next to Go's mean; run them with
// `go test -run '^$' -bench . -benchtime 20x ./internal/runtime/gvisor` as root.

var benchArgs = []string{"/bin/sleep", "1000000"}

type timings []time.Duration

func (ts timings) report(b *testing.B) {
	if len(ts) == 0 {
		return
	}
	s := append(timings(nil), ts...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	b.ReportMetric(float64(s[len(s)/2].Microseconds())/1000, "ms-p50")
	b.ReportMetric(float64(s[len(s)*9/10].Microseconds())/1000, "ms-p90")
	b.ReportMetric(0, "ns/op") // the per-op mean includes untimed setup noise; p50 is the figure
}

func benchSpec(b *testing.B, rootfs string, i int) runtime.Spec {
	id := fmt.Sprintf("bn-%08d", i)
	return runtime.Spec{ID: id, RootFS: rootfs, StateDir: filepath.Join(b.TempDir(), id), Args: benchArgs, MemoryMB: 512, CPUCount: 1}
}

func BenchmarkStart(b *testing.B) {
	for _, ignore := range []bool{false, true} {
		b.Run(fmt.Sprintf("ignore-cgroups=%v", ignore), func(b *testing.B) {
			d := newDriver(b, func(c *gvisor.Config) { c.IgnoreCgroups = ignore })
			rootfs := drivertest.BusyboxRootFS(b)
			ctx := context.Background()
			var ts timings
			for i := 0; i < b.N; i++ {
				sp := benchSpec(b, rootfs, i)
				t0 := time.Now()
				if err := d.Start(ctx, sp); err != nil {
					b.Fatal(err)
				}
				ts = append(ts, time.Since(t0))
				b.StopTimer()
				if err := d.Delete(ctx, sp.ID); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
			ts.report(b)
		})
	}
}

// checkpointVariants are the image settings compared.
var checkpointVariants = []struct {
	name string
	mod  func(*gvisor.Config)
}{
	{"none", func(c *gvisor.Config) {}},
	{"none+zero-pages", func(c *gvisor.Config) { c.ExcludeZeroPages = true }},
	{"flate", func(c *gvisor.Config) { c.Compression = "flate-best-speed" }},
}

// startIdle starts a sandbox, optionally fills memoryMB of its memory-backed filesystem.
func startIdle(b *testing.B, d *gvisor.Driver, rootfs string, i, memoryMB int) runtime.Spec {
	b.Helper()
	sp := benchSpec(b, rootfs, i)
	if err := d.Start(context.Background(), sp); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = d.Delete(context.Background(), sp.ID) })
	if memoryMB > 0 {
		script := fmt.Sprintf("dd if=/dev/urandom of=/root/data bs=1M count=%d 2>/dev/null", memoryMB)
		if _, code, err := d.Exec(context.Background(), sp.ID, []string{"sh", "-c", script}); err != nil || code != 0 {
			b.Fatalf("fill: %d %v", code, err)
		}
	}
	return sp
}

func BenchmarkCheckpoint(b *testing.B) {
	for _, v := range checkpointVariants {
		for _, leave := range []bool{true, false} {
			b.Run(fmt.Sprintf("%s/leave-running=%v", v.name, leave), func(b *testing.B) {
				d := newDriver(b, func(c *gvisor.Config) { c.IgnoreCgroups = true; v.mod(c) })
				rootfs := drivertest.BusyboxRootFS(b)
				ctx := context.Background()
				sp := startIdle(b, d, rootfs, 0, 0)
				var ts timings
				for i := 0; i < b.N; i++ {
					img := b.TempDir()
					t0 := time.Now()
					if err := d.Checkpoint(ctx, sp.ID, img, runtime.CheckpointOptions{LeaveRunning: leave}); err != nil {
						b.Fatal(err)
					}
					ts = append(ts, time.Since(t0))
					if !leave {
						b.StopTimer()
						_ = d.Delete(ctx, sp.ID)
						sp = startIdle(b, d, rootfs, i+1, 0)
						b.StartTimer()
					}
				}
				ts.report(b)
			})
		}
	}
}

func BenchmarkRestore(b *testing.B) {
	variants := append(checkpointVariants[:len(checkpointVariants):len(checkpointVariants)], struct {
		name string
		mod  func(*gvisor.Config)
	}{"none+background", func(c *gvisor.Config) { c.RestoreBackground = true }})
	for _, mem := range []int{0, 64} {
		for _, v := range variants {
			b.Run(fmt.Sprintf("data=%dMiB/%s", mem, v.name), func(b *testing.B) {
				d := newDriver(b, func(c *gvisor.Config) { c.IgnoreCgroups = true; v.mod(c) })
				rootfs := drivertest.BusyboxRootFS(b)
				ctx := context.Background()
				sp := startIdle(b, d, rootfs, 99999999, mem)
				img := b.TempDir()
				if err := d.Checkpoint(ctx, sp.ID, img, runtime.CheckpointOptions{LeaveRunning: true}); err != nil {
					b.Fatal(err)
				}
				var ts timings
				for i := 0; i < b.N; i++ {
					c := benchSpec(b, rootfs, i)
					t0 := time.Now()
					if err := d.Restore(ctx, c, img); err != nil {
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
			})
		}
	}
}

// BenchmarkStackDepth: start and restore of an instance whose rootfs is one directory against a
// stack of 2 and of 11 layers (a template's top layer over image layers). The depths take turns
// in every round, so drift in the host's load hits all alike; it prints p50/p99 per depth.
func BenchmarkStackDepth(b *testing.B) {
	d := newDriver(b, nil)
	base := drivertest.BusyboxRootFS(b)
	layers := make([]string, 10)
	for i := range layers {
		layers[i] = filepath.Join(b.TempDir(), fmt.Sprintf("l%02d", i))
		for _, f := range []string{"etc/l" + fmt.Sprint(i), "opt/l" + fmt.Sprint(i) + "/a", "opt/l" + fmt.Sprint(i) + "/b"} {
			os.MkdirAll(filepath.Join(layers[i], filepath.Dir(f)), 0o755)
			os.WriteFile(filepath.Join(layers[i], f), []byte(f), 0o644)
		}
		os.Chmod(layers[i], 0o755)
	}
	cases := []struct {
		name             string
		rootfs           string
		lowers           []string
		image            string
		starts, restores timings
	}{
		{name: "one directory", rootfs: base},
		{name: "stack of 2", rootfs: layers[0], lowers: []string{base}},
		{name: "stack of 11", rootfs: layers[0], lowers: append(append([]string{}, layers[1:]...), base)},
	}
	ctx := context.Background()
	seq := 0
	spec := func(rootfs string, lowers []string) runtime.Spec {
		seq++
		sp := benchSpec(b, rootfs, seq)
		sp.Lowers = lowers
		return sp
	}
	for i := range cases {
		c := &cases[i]
		sp := spec(c.rootfs, c.lowers)
		if err := d.Start(ctx, sp); err != nil {
			b.Fatal(err)
		}
		c.image = b.TempDir()
		if err := d.Checkpoint(ctx, sp.ID, c.image, runtime.CheckpointOptions{}); err != nil {
			b.Fatal(err)
		}
		d.Delete(ctx, sp.ID)
	}
	b.ResetTimer()
	for n := 0; n < b.N; n++ {
		for i := range cases {
			c := &cases[i]
			sp := spec(c.rootfs, c.lowers)
			t0 := time.Now()
			if err := d.Start(ctx, sp); err != nil {
				b.Fatal(err)
			}
			c.starts = append(c.starts, time.Since(t0))
			d.Delete(ctx, sp.ID)
			sp = spec(c.rootfs, c.lowers)
			t0 = time.Now()
			if err := d.Restore(ctx, sp, c.image); err != nil {
				b.Fatal(err)
			}
			c.restores = append(c.restores, time.Since(t0))
			d.Delete(ctx, sp.ID)
		}
	}
	b.StopTimer()
	pct := func(ts timings, p float64) time.Duration {
		s := append(timings(nil), ts...)
		sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
		return s[min(len(s)-1, int(float64(len(s))*p))]
	}
	for _, c := range cases {
		fmt.Printf("%-14s start p50 %6.1f ms p99 %6.1f ms   restore p50 %6.1f ms p99 %6.1f ms   (n=%d)\n", c.name,
			float64(pct(c.starts, 0.5).Microseconds())/1000, float64(pct(c.starts, 0.99).Microseconds())/1000,
			float64(pct(c.restores, 0.5).Microseconds())/1000, float64(pct(c.restores, 0.99).Microseconds())/1000, len(c.starts))
	}
	b.ReportMetric(0, "ns/op")
}
