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

// BenchmarkLaunchLogs: what the sandbox's and gofer's logs of every launch (Config.SandboxLogs)
// cost a start and a restore, with and without them taking turns in every round, and the bytes
// they hold after a restore and 20 commands. Prints p50/p99 per variant.
func BenchmarkLaunchLogs(b *testing.B) {
	drivers := map[bool]*gvisor.Driver{
		false: newDriver(b, nil),
		true:  newDriver(b, func(c *gvisor.Config) { c.SandboxLogs = true }),
	}
	d := drivers[false]
	rootfs := drivertest.BusyboxRootFS(b)
	ctx := context.Background()
	sp := benchSpec(b, rootfs, 99999999)
	if err := d.Start(ctx, sp); err != nil {
		b.Fatal(err)
	}
	img := b.TempDir()
	if err := d.Checkpoint(ctx, sp.ID, img, runtime.CheckpointOptions{}); err != nil {
		b.Fatal(err)
	}
	type variant struct {
		on               bool
		starts, restores timings
		bytes            int64
	}
	vs := []*variant{{on: false}, {on: true}}
	seq := 0
	next := func() runtime.Spec { seq++; return benchSpec(b, rootfs, seq) }
	b.ResetTimer()
	for n := 0; n < b.N; n++ {
		for _, v := range vs {
			d := drivers[v.on]
			s := next()
			t0 := time.Now()
			if err := d.Start(ctx, s); err != nil {
				b.Fatal(err)
			}
			v.starts = append(v.starts, time.Since(t0))
			d.Delete(ctx, s.ID)
			s = next()
			t0 = time.Now()
			if err := d.Restore(ctx, s, img); err != nil {
				b.Fatal(err)
			}
			v.restores = append(v.restores, time.Since(t0))
			if n == 0 {
				for i := 0; i < 20; i++ {
					d.Exec(ctx, s.ID, []string{"/bin/true"})
				}
				v.bytes = dirBytes(filepath.Join(s.StateDir, "logs"))
			}
			d.Delete(ctx, s.ID)
		}
	}
	b.StopTimer()
	pct := func(ts timings, p float64) float64 {
		s := append(timings(nil), ts...)
		sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
		return float64(s[min(len(s)-1, int(float64(len(s))*p))].Microseconds()) / 1000
	}
	for _, v := range vs {
		fmt.Printf("launch logs %-5v start p50 %6.1f ms p99 %6.1f ms   restore p50 %6.1f ms p99 %6.1f ms   logs after restore+20 execs %d B (n=%d)\n",
			v.on, pct(v.starts, 0.5), pct(v.starts, 0.99), pct(v.restores, 0.5), pct(v.restores, 0.99), v.bytes, len(v.starts))
	}
	b.ReportMetric(0, "ns/op")
}

func dirBytes(dir string) int64 {
	var n int64
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if fi, err := e.Info(); err == nil {
			n += fi.Size()
		}
	}
	return n
}
