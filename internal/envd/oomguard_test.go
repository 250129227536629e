package envd

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// fakeProc is a /proc with a meminfo and processes (pid -> resident MiB) a test changes.
type fakeProc struct {
	t    *testing.T
	dir  string
	mu   sync.Mutex
	rss  map[int]uint64 // MiB
	base uint64         // MiB in use outside the processes
	tot  uint64         // MiB
	// signals are the SIGSTOPs and SIGCONTs sent, "<signal> <pid>".
	signals []string
}

func newFakeProc(t *testing.T, totalMiB, baseMiB uint64) *fakeProc {
	f := &fakeProc{t: t, dir: t.TempDir(), rss: map[int]uint64{}, base: baseMiB, tot: totalMiB}
	f.sync()
	return f
}

func (f *fakeProc) set(pid int, mib uint64) {
	f.mu.Lock()
	f.rss[pid] = mib
	f.mu.Unlock()
	f.sync()
}

// sync writes meminfo and every process's files (a killed process is a zombie: state Z, no rss).
func (f *fakeProc) sync() {
	f.mu.Lock()
	defer f.mu.Unlock()
	used := f.base
	for _, r := range f.rss {
		used += r
	}
	avail := uint64(0)
	if used < f.tot {
		avail = f.tot - used
	}
	write := func(p, s string) {
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			f.t.Fatal(err)
		}
		if err := os.WriteFile(p+".tmp", []byte(s), 0o644); err != nil {
			f.t.Fatal(err)
		}
		if err := os.Rename(p+".tmp", p); err != nil {
			f.t.Fatal(err)
		}
	}
	for pid, r := range f.rss {
		d := filepath.Join(f.dir, strconv.Itoa(pid))
		state := "S"
		if r == 0 {
			state = "Z"
		}
		pages := (r << 20) / uint64(os.Getpagesize())
		write(filepath.Join(d, "statm"), fmt.Sprintf("%d %d 0 0 0 0 0\n", pages*2, pages))
		write(filepath.Join(d, "stat"), fmt.Sprintf("%d (p %d) %s 1 1 1\n", pid, pid, state))
		write(filepath.Join(d, "comm"), fmt.Sprintf("p%d\n", pid))
	}
	// meminfo last: a guard that sees the memory gone sees the process that holds it.
	write(filepath.Join(f.dir, "meminfo"), fmt.Sprintf("MemTotal:       %8d kB\nMemFree:        %8d kB\nMemAvailable:   %8d kB\nCached:                0 kB\nAnonPages:      %8d kB\nShmem:                 0 kB\n",
		f.tot<<10, avail<<10, avail<<10, used<<10))
}

// kill is the guard's Kill: the process exits and its memory comes back.
func (f *fakeProc) kill(killed chan<- int) func(int, syscall.Signal) error {
	return func(pid int, sig syscall.Signal) error {
		switch {
		case (sig == syscall.SIGSTOP || sig == syscall.SIGCONT) && pid == -1:
			f.mu.Lock()
			f.signals = append(f.signals, fmt.Sprintf("%v %d", sig, pid))
			f.mu.Unlock()
			return nil
		case sig != syscall.SIGKILL:
			f.t.Errorf("signal %v to %d, want SIGKILL", sig, pid)
		}
		f.mu.Lock()
		_, ok := f.rss[pid]
		f.mu.Unlock()
		if !ok {
			return syscall.ESRCH
		}
		f.set(pid, 0)
		killed <- pid
		return nil
	}
}

func startGuard(t *testing.T, f *fakeProc, protect ...int) <-chan int {
	killed, _ := startGuardWith(t, f, oomGuardConfig{Protect: protect})
	return killed
}

func startGuardWith(t *testing.T, f *fakeProc, cfg oomGuardConfig) (<-chan int, *oomGuard) {
	killed := make(chan int, 16)
	cfg.Proc, cfg.Kill, cfg.MaxInterval, cfg.Settle = f.dir, f.kill(killed), 20*time.Millisecond, 200*time.Millisecond
	g := newOOMGuard(slog.New(slog.DiscardHandler), cfg)
	ctx, cancel := context.WithCancel(context.Background())
	go g.run(ctx)
	t.Cleanup(func() { cancel(); <-g.stopped })
	return killed, g
}

// A guest with no process but envd costs no CPU: the guard stops looking (a look every 50 ms
// was about 1.5 % of a core per idle sandbox under gVisor) until envd starts a process, and
// then guards as before. Every process in a sandbox is started by envd or by a process that
// exists, so one that appears without a Wake (only possible in this test) goes unseen.
func TestOOMGuardRestsWhileOnlyEnvdRuns(t *testing.T) {
	f := newFakeProc(t, 1024, 40)
	f.set(1, 10)
	f.set(os.Getpid(), 5)
	f.set(20, 30)
	killed, g := startGuardWith(t, f, oomGuardConfig{IdleCheck: 20 * time.Millisecond})
	f.set(20, 0) // the last command exits (a zombie until reaped)
	time.Sleep(200 * time.Millisecond)
	f.set(30, 990) // appears without envd starting it: a resting guard does not look
	select {
	case pid := <-killed:
		t.Fatalf("killed %d: the guard kept looking with only envd left", pid)
	case <-time.After(300 * time.Millisecond):
	}
	g.Wake() // envd starts a process
	select {
	case pid := <-killed:
		if pid != 30 {
			t.Fatalf("killed %d, want 30", pid)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("nothing killed 2 s after envd started a process that ran the memory out")
	}
}

// While a process runs, the guard keeps looking, however long it runs.
func TestOOMGuardKeepsLookingWhileAProcessRuns(t *testing.T) {
	f := newFakeProc(t, 1024, 40)
	f.set(1, 10)
	f.set(20, 5)
	killed, _ := startGuardWith(t, f, oomGuardConfig{IdleCheck: 20 * time.Millisecond})
	time.Sleep(200 * time.Millisecond)
	f.set(20, 980)
	select {
	case pid := <-killed:
		if pid != 20 {
			t.Fatalf("killed %d, want 20", pid)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("nothing killed: the guard stopped looking while a process ran")
	}
}

// The guard's periodic look is the cheap one (sysinfo under gVisor) while it shows more free
// memory than the reserve; /proc/meminfo, whose every read under gVisor scans the sandbox's
// memory file (2-3 % of a core for a sandbox with a process alive, looked at 20 times a second),
// is read only once the cheap look shows the memory low, and it decides as before.
func TestOOMGuardReadsMeminfoOnlyWhenTheCheapLookIsLow(t *testing.T) {
	f := newFakeProc(t, 1024, 40)
	f.set(1, 10)
	f.set(20, 5)
	var mu sync.Mutex
	free, looks := uint64(900<<20), 0
	cheap := func() (uint64, uint64, bool) {
		mu.Lock()
		defer mu.Unlock()
		looks++
		return 1024 << 20, free, true
	}
	killed, _ := startGuardWith(t, f, oomGuardConfig{Free: cheap})
	time.Sleep(100 * time.Millisecond)
	f.set(20, 990) // only /proc/meminfo shows it: the guard must not be reading it
	select {
	case pid := <-killed:
		t.Fatalf("killed %d while the cheap look showed 900 MiB free: the guard read /proc/meminfo", pid)
	case <-time.After(300 * time.Millisecond):
	}
	mu.Lock()
	n := looks
	free = 4 << 20 // the cheap look shows the memory low: /proc/meminfo decides
	mu.Unlock()
	if n < 5 {
		t.Fatalf("%d cheap looks in 400 ms, want the guard's pace (one per 20 ms here)", n)
	}
	select {
	case pid := <-killed:
		if pid != 20 {
			t.Fatalf("killed %d, want 20", pid)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("nothing killed 2 s after the cheap look showed the memory low")
	}
}

// When the guest's memory runs out the guard kills the largest process, never pid 1, envd or a
// protected one, and only one for one allocation.
func TestOOMGuardKillsTheLargestProcess(t *testing.T) {
	f := newFakeProc(t, 1024, 40)
	f.set(1, 900) // init (envd in a sandbox): never
	f.set(os.Getpid(), 5)
	f.set(20, 30)
	f.set(21, 10)
	f.set(22, 8) // protected
	killed := startGuard(t, f, 22)
	select {
	case pid := <-killed:
		t.Fatalf("killed %d with memory to spare", pid)
	case <-time.After(100 * time.Millisecond):
	}
	f.set(1, 20)
	f.set(30, 950) // the allocation: 40+20+5+30+10+8+950 > 1024
	select {
	case pid := <-killed:
		if pid != 30 {
			t.Fatalf("killed %d, want 30 (the largest)", pid)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("nothing killed 2 s after the memory ran out")
	}
	select {
	case pid := <-killed:
		t.Fatalf("also killed %d after the memory came back", pid)
	case <-time.After(300 * time.Millisecond):
	}
	// The guest was stalled for the kill (every process stopped), then the rest resumed.
	f.mu.Lock()
	sigs := strings.Join(f.signals, ", ")
	f.mu.Unlock()
	if sigs != "stopped (signal) -1, continued -1" {
		t.Errorf("signals %q, want SIGSTOP to all, then SIGCONT to the rest", sigs)
	}
}

// Memory a process does not hold (a file in a memory filesystem): the guard kills what it can,
// largest first, and then, with nothing left to kill, it waits.
func TestOOMGuardWithNothingToKill(t *testing.T) {
	f := newFakeProc(t, 1024, 1020)
	f.set(1, 10)
	f.set(20, 3)
	killed := startGuard(t, f)
	select {
	case pid := <-killed:
		if pid != 20 {
			t.Fatalf("killed %d, want 20", pid)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("nothing killed")
	}
	select {
	case pid := <-killed:
		t.Fatalf("killed %d: nothing but pid 1 was left", pid)
	case <-time.After(400 * time.Millisecond):
	}
}

// The guard looks more often as the free memory shrinks: before it could be gone at MaxRate.
func TestOOMGuardInterval(t *testing.T) {
	g := newOOMGuard(slog.New(slog.DiscardHandler), oomGuardConfig{})
	const gib = 1 << 30
	if d := g.interval(mem{total: 4 * gib, avail: 3 * gib}); d != 50*time.Millisecond {
		t.Errorf("idle: %v", d)
	}
	if d := g.interval(mem{total: gib, avail: 16<<20 + 160<<20}); d < 9*time.Millisecond || d > 10*time.Millisecond {
		t.Errorf("160 MiB above the reserve: %v, want the 9.8 ms 160 MiB lasts at 16 GiB/s", d)
	}
	if d := g.interval(mem{total: gib, avail: 8 << 20}); d != 5*time.Millisecond {
		t.Errorf("out of memory: %v", d)
	}
}

// A burst of processes (a fork bomb holding memory): the guard kills as many as the memory past
// the total needs (it reads how far past from the uncapped counters), largest first, until the
// rest fit.
func TestOOMGuardKeepsPaceWithABurst(t *testing.T) {
	f := newFakeProc(t, 1024, 40)
	f.set(1, 10)
	killed := startGuard(t, f)
	t0 := time.Now()
	for pid := 100; pid < 120; pid++ { // 20 x 100 MiB: 11 must go
		f.set(pid, 100)
	}
	n := 0
	for n < 11 {
		select {
		case <-killed:
			n++
		case <-time.After(time.Second): // one Settle: the old guard's pace was one kill per Settle
			t.Fatalf("%d kills after %s, want 11", n, time.Since(t0))
		}
	}
	t.Logf("11 kills in %s", time.Since(t0))
	select {
	case pid := <-killed:
		t.Fatalf("a 12th kill (%d): the other 9 fit", pid)
	case <-time.After(300 * time.Millisecond):
	}
}

// A victim's memory that comes back slowly after it died (a loaded host tears a large address
// space down over hundreds of milliseconds) is waited for: the guard does not kill the next
// process — in the e2e test, the caller's next command — while the free memory still grows.
func TestOOMGuardWaitsForMemoryComingBack(t *testing.T) {
	f := newFakeProc(t, 1024, 40)
	f.set(1, 20)
	f.set(20, 30) // the next command
	killed := make(chan int, 16)
	var returning sync.WaitGroup
	t.Cleanup(returning.Wait) // before the fake /proc goes: the memory coming back writes to it
	kill := func(pid int, sig syscall.Signal) error {
		if sig != syscall.SIGKILL {
			return nil
		}
		f.mu.Lock()
		r, ok := f.rss[pid]
		if ok {
			f.rss[pid], f.base = 0, f.base+r // dead, its memory not back yet
		}
		f.mu.Unlock()
		if !ok {
			return syscall.ESRCH
		}
		f.sync()
		killed <- pid
		returning.Add(1)
		go func() { // back after 150 ms, in 10 steps over 400 ms
			defer returning.Done()
			time.Sleep(150 * time.Millisecond)
			for i := 0; i < 10; i++ {
				time.Sleep(40 * time.Millisecond)
				f.mu.Lock()
				f.base -= r / 10
				f.mu.Unlock()
				f.sync()
			}
		}()
		return nil
	}
	g := newOOMGuard(slog.New(slog.DiscardHandler), oomGuardConfig{Proc: f.dir, Kill: kill, MaxInterval: 20 * time.Millisecond, Settle: time.Second})
	ctx, cancel := context.WithCancel(context.Background())
	go g.run(ctx)
	t.Cleanup(func() { cancel(); <-g.stopped })
	f.set(30, 950)
	select {
	case pid := <-killed:
		if pid != 30 {
			t.Fatalf("killed %d, want 30 (the allocation)", pid)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("nothing killed 2 s after the memory ran out")
	}
	select {
	case pid := <-killed:
		t.Fatalf("also killed %d while the allocation's memory was coming back", pid)
	case <-time.After(800 * time.Millisecond):
	}
}
