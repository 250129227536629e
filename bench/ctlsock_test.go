package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/runtime/drivertest"
	"github.com/ember-sandbox/ember/internal/runtime/gvisor"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// BenchmarkCtlSock compares, in one run, the gVisor driver's calls over the sandbox's control
// socket (the default) with the same calls through runsc's CLI (gvisor.Config.RunscCLI): freeze
// and thaw (runsc pause / resume), a checkpoint that leaves the sandbox running (with host layers
// that is a pause, the checkpoint, the layer clone and a resume), a checkpoint of a frozen
// sandbox (the background checkpoint of a hot pause: it stays frozen), and a checkpoint that
// stops it (a pause to disk), then the restore of that checkpoint into a pre-started instance
// (the socket's pre-start gives the sentry its network ahead, timed apart). For each it
// prints the median and p99 of the wall time and of the CPU time the calling process and its
// child processes used per call (getrusage RUSAGE_SELF + RUSAGE_CHILDREN: the runsc processes
// the CLI starts; the sentry's own work is in neither).
//
//	sudo go test -run '^$' -bench BenchmarkCtlSock -benchtime 1x ./bench/
//
// EMBER_BENCH_CTLSOCK_N sets the rounds per figure (default 20). Instances run busybox (one
// process counting in a tmpfs file) from a runsc root of the benchmark's own.
func BenchmarkCtlSock(b *testing.B) {
	testutil.RequireRoot(b)
	rounds := atoiOr(os.Getenv("EMBER_BENCH_CTLSOCK_N"), 20)
	root := filepath.Join(b.TempDir(), "runsc-root")
	defer unix.Unmount(filepath.Join(root, "null-netns"), unix.MNT_DETACH)
	mk := func(cli bool) *gvisor.Driver {
		d, err := gvisor.New(gvisor.Config{Runsc: testutil.Runsc(b), Root: root, RunscCLI: cli, Logger: benchLogger()})
		if err != nil {
			b.Fatal(err)
		}
		return d
	}
	// Two drivers on one runsc root: either acts on the other's instances.
	sock, cli := mk(false), mk(true)
	rootfs := drivertest.BusyboxRootFS(b)
	ctx := context.Background()
	seq := 0
	spec := func() runtime.Spec {
		seq++
		id := fmt.Sprintf("cs-%06d", seq)
		return runtime.Spec{
			ID: id, RootFS: rootfs, StateDir: filepath.Join(b.TempDir(), id),
			Args: []string{"/bin/sh", "-c", `i=0; while :; do i=$((i+1)); echo $i > /dev/shm/n; sleep 0.05; done`},
			Env:  []string{"PATH=/bin"}, Cwd: "/", MemoryMB: 256, CPUCount: 1,
		}
	}
	var all []string
	defer func() {
		for _, id := range all {
			sock.Delete(ctx, id)
		}
	}()
	start := func() runtime.Spec {
		sp := spec()
		if err := sock.Start(ctx, sp); err != nil {
			b.Fatal(err)
		}
		all = append(all, sp.ID)
		return sp
	}
	imgDir := func() string {
		d, err := os.MkdirTemp(b.TempDir(), "img-")
		if err != nil {
			b.Fatal(err)
		}
		return d
	}

	type figure struct{ wall, cpu dist }
	figs := map[string]*figure{}
	var order []string
	timed := func(name string, f func() error) {
		fg := figs[name]
		if fg == nil {
			fg = &figure{}
			figs[name] = fg
			order = append(order, name)
		}
		c0 := cpuTime()
		t0 := time.Now()
		if err := f(); err != nil {
			b.Fatalf("%s: %v", name, err)
		}
		fg.wall = append(fg.wall, time.Since(t0))
		fg.cpu = append(fg.cpu, cpuTime()-c0)
	}
	modes := []struct {
		name string
		d    *gvisor.Driver
	}{{"socket", sock}, {"runsc CLI", cli}}

	// Freeze and thaw of one running sandbox, the two ways alternating.
	sp := start()
	time.Sleep(200 * time.Millisecond)
	for i := 0; i < rounds; i++ {
		for j := range modes {
			m := modes[(i+j)%2]
			timed("freeze / "+m.name, func() error { return m.d.Freeze(ctx, sp.ID) })
			timed("thaw / "+m.name, func() error { return m.d.Thaw(ctx, sp.ID) })
		}
	}
	// Checkpoints that leave it running, then ones of it frozen (it stays frozen).
	for i := 0; i < rounds; i++ {
		for j := range modes {
			m := modes[(i+j)%2]
			img := imgDir()
			timed("checkpoint leave-running / "+m.name, func() error {
				return m.d.Checkpoint(ctx, sp.ID, img, runtime.CheckpointOptions{LeaveRunning: true})
			})
			os.RemoveAll(img)
		}
	}
	if err := sock.Freeze(ctx, sp.ID); err != nil {
		b.Fatal(err)
	}
	for i := 0; i < rounds; i++ {
		for j := range modes {
			m := modes[(i+j)%2]
			img := imgDir()
			timed("checkpoint of frozen / "+m.name, func() error {
				return m.d.Checkpoint(ctx, sp.ID, img, runtime.CheckpointOptions{LeaveRunning: true})
			})
			os.RemoveAll(img)
		}
	}
	if st, err := sock.State(ctx, sp.ID); err != nil || !st.Frozen {
		b.Fatalf("after the checkpoints of a frozen sandbox: %+v, %v; want it frozen", st, err)
	}
	// A pause to disk: each round a sandbox restored from one image, checkpointed (timed), and
	// that checkpoint restored into a pre-started instance (timed: the CLI floor).
	base := imgDir()
	if err := sock.Checkpoint(ctx, sp.ID, base, runtime.CheckpointOptions{LeaveRunning: true}); err != nil {
		b.Fatal(err)
	}
	for i := 0; i < rounds; i++ {
		for j := range modes {
			m := modes[(i+j)%2]
			s := spec()
			if err := sock.Restore(ctx, s, base); err != nil {
				b.Fatal(err)
			}
			all = append(all, s.ID)
			time.Sleep(50 * time.Millisecond)
			img := imgDir()
			timed("checkpoint to stop / "+m.name, func() error {
				return m.d.Checkpoint(ctx, s.ID, img, runtime.CheckpointOptions{})
			})
			sock.Delete(ctx, s.ID)
			sock.Release(ctx, s.StateDir)
			// The pre-start (not on a request's path; with the socket it gives the sentry its
			// network) and the restore into it.
			in := spec()
			all = append(all, in.ID)
			timed("pre-start / "+m.name, func() error { return m.d.Prestart(ctx, in, img) })
			timed("restore into pre-started / "+m.name, func() error {
				return m.d.RestoreInto(ctx, in.ID, img)
			})
			sock.Delete(ctx, in.ID)
			sock.Release(ctx, in.StateDir)
			os.RemoveAll(img)
		}
	}

	fmt.Printf("\n== control socket vs runsc CLI (gVisor driver, %d rounds each; wall and CPU of the caller + its children per call) ==\n", rounds)
	fmt.Printf("%-58s %9s %9s %9s %9s\n", "", "p50 ms", "p99 ms", "cpu p50", "cpu p99")
	for _, name := range order {
		fg := figs[name]
		fmt.Printf("%-58s %9s %9s %9s %9s\n", name, ms(fg.wall.pct(0.5)), ms(fg.wall.pct(0.99)), ms(fg.cpu.pct(0.5)), ms(fg.cpu.pct(0.99)))
		b.ReportMetric(float64(fg.wall.pct(0.5).Microseconds())/1000, metricName(name)+"_p50_ms")
	}
	for _, op := range []string{"freeze", "thaw", "checkpoint leave-running", "checkpoint of frozen", "checkpoint to stop", "pre-start", "restore into pre-started"} {
		s, c := figs[op+" / socket"], figs[op+" / runsc CLI"]
		if s == nil || c == nil {
			continue
		}
		fmt.Printf("%-28s socket saves %s ms wall (p50) and %s ms CPU (p50) per call\n", op+":",
			ms(c.wall.pct(0.5)-s.wall.pct(0.5)), ms(c.cpu.pct(0.5)-s.cpu.pct(0.5)))
	}
	b.ReportMetric(0, "ns/op")
}

// cpuTime is the user and system time of this process and of its waited-for children.
func cpuTime() time.Duration {
	var self, kids unix.Rusage
	unix.Getrusage(unix.RUSAGE_SELF, &self)
	unix.Getrusage(unix.RUSAGE_CHILDREN, &kids)
	tv := func(t unix.Timeval) time.Duration { return time.Duration(t.Nano()) }
	return tv(self.Utime) + tv(self.Stime) + tv(kids.Utime) + tv(kids.Stime)
}

func metricName(s string) string {
	r := strings.NewReplacer(" / ", "_", " ", "-", "(", "", ")", "")
	return r.Replace(s)
}
