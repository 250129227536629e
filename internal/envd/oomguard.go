package envd

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// The out-of-memory guard. gVisor has no OOM killer: when a sandbox's memory runs out, the host
// stops the whole sandbox. The host gives each sandbox headroom above the memory its guest sees
// (internal/runtime/gvisor, raiseMemoryLimit), and this guard does what a VM's kernel would:
// when the guest's memory in use nears its total, it SIGKILLs the process with the largest
// resident set (never envd itself, pid 1), so that command fails as killed by a signal and the
// sandbox lives on.
//
// The guest's use is /proc/meminfo: in gVisor MemTotal is the sandbox's memory (runsc's
// --total-memory) and MemAvailable is MemTotal less every page the Sentry has committed for
// the guest (anonymous memory, page cache, tmpfs and a memory-backed rootfs alike, from its
// memory file's accounting), 0 once the guest has gone past MemTotal into the headroom.

// oomGuardConfig tunes a guard; the zero value of a field takes the default.
type oomGuardConfig struct {
	// Proc is the procfs root ("/proc").
	Proc string
	// MaxRate is the fastest the guest is assumed to allocate (bytes per second): the guard
	// looks again before the free memory could be gone at that rate. Default 4 GiB/s.
	MaxRate float64
	// MinInterval and MaxInterval bound the time between two looks (default 5 ms and 250 ms).
	MinInterval, MaxInterval time.Duration
	// Settle bounds the wait, after a kill, for the victim to die before the guard picks
	// another (default 1 s); Release bounds the wait for its memory to come back once it has
	// died (default 50 ms): a burst of many processes needs many kills in a row.
	Settle, Release time.Duration
	// Kill sends sig to pid (default syscall.Kill).
	Kill func(pid int, sig syscall.Signal) error
	// Protect lists pids never killed besides pid 1 and envd's own.
	Protect []int
}

type oomGuard struct {
	cfg     oomGuardConfig
	log     *slog.Logger
	self    int
	onKill  func(victim oomVictim, used, total uint64) // tests
	stopped chan struct{}
}

// oomVictim is a process the guard chose.
type oomVictim struct {
	Pid  int
	Comm string
	RSS  uint64
}

func newOOMGuard(log *slog.Logger, cfg oomGuardConfig) *oomGuard {
	if cfg.Proc == "" {
		cfg.Proc = "/proc"
	}
	if cfg.MaxRate <= 0 {
		cfg.MaxRate = 4 << 30
	}
	if cfg.MinInterval <= 0 {
		cfg.MinInterval = 5 * time.Millisecond
	}
	if cfg.MaxInterval <= 0 {
		cfg.MaxInterval = 250 * time.Millisecond
	}
	if cfg.Settle <= 0 {
		cfg.Settle = time.Second
	}
	if cfg.Release <= 0 {
		cfg.Release = 50 * time.Millisecond
	}
	if cfg.Kill == nil {
		cfg.Kill = syscall.Kill
	}
	return &oomGuard{cfg: cfg, log: log, self: os.Getpid(), stopped: make(chan struct{})}
}

// reserve is how much free memory the guard keeps: below it, the guest is out of memory.
// 1/64 of the total, between 8 and 64 MiB (16 MiB of 1 GiB).
func reserve(total uint64) uint64 {
	return min(max(total/64, 8<<20), 64<<20)
}

// run watches until ctx is done. If the guest's memory cannot be read it logs why and returns.
func (g *oomGuard) run(ctx context.Context) {
	defer close(g.stopped)
	total, avail, err := g.meminfo()
	if err != nil || total == 0 {
		g.log.Warn("out-of-memory guard off: the guest's memory is unreadable", "err", err)
		return
	}
	g.log.Debug("out-of-memory guard on", "total_mib", total>>20, "reserve_mib", reserve(total)>>20)
	var nothing bool // nothing left to kill: logged once until memory is back
	for {
		if avail <= reserve(total) {
			v, ok := g.victim()
			switch {
			case ok:
				nothing = false
				g.kill(ctx, v, total, avail)
			case !nothing:
				nothing = true
				g.log.Warn("out of memory and no process to kill", "used_mib", (total-avail)>>20, "total_mib", total>>20)
			}
		} else {
			nothing = false
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(g.interval(total, avail)):
		}
		t, a, err := g.meminfo()
		if err == nil && t > 0 {
			total, avail = t, a
		}
	}
}

// interval is the wait before the next look: the time the free memory above the reserve would
// last at MaxRate, within [MinInterval, MaxInterval].
func (g *oomGuard) interval(total, avail uint64) time.Duration {
	r := reserve(total)
	if avail <= r {
		return g.cfg.MinInterval
	}
	d := time.Duration(float64(avail-r) / g.cfg.MaxRate * float64(time.Second))
	return min(max(d, g.cfg.MinInterval), g.cfg.MaxInterval)
}

// kill SIGKILLs v, then waits until it has died (at most Settle) and its memory is back (at most
// Release more), so that one allocation costs one process, yet a burst of processes gets
// one kill after another.
func (g *oomGuard) kill(ctx context.Context, v oomVictim, total, avail uint64) {
	used := total - avail
	if err := g.cfg.Kill(v.Pid, syscall.SIGKILL); err != nil {
		if !errors.Is(err, syscall.ESRCH) {
			g.log.Warn("out of memory: kill failed", "pid", v.Pid, "err", err)
		}
		return
	}
	g.log.Warn("out of memory: killed process", "pid", v.Pid, "comm", v.Comm, "rss_mib", v.RSS>>20, "used_mib", used>>20, "total_mib", total>>20)
	if g.onKill != nil {
		g.onKill(v, used, total)
	}
	deadline := time.Now().Add(g.cfg.Settle)
	for dead := false; time.Now().Before(deadline); {
		if !dead && !g.alive(v.Pid) {
			dead, deadline = true, time.Now().Add(g.cfg.Release)
		}
		if dead {
			if _, a, err := g.meminfo(); err != nil || a > reserve(total) {
				return
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(g.cfg.MinInterval):
		}
	}
}

// meminfo reads MemTotal and MemAvailable (bytes).
func (g *oomGuard) meminfo() (total, avail uint64, err error) {
	b, err := os.ReadFile(filepath.Join(g.cfg.Proc, "meminfo"))
	if err != nil {
		return 0, 0, err
	}
	var haveAvail bool
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		f := strings.Fields(v)
		if len(f) == 0 {
			continue
		}
		n, err := strconv.ParseUint(f[0], 10, 64)
		if err != nil {
			continue
		}
		if len(f) > 1 && f[1] == "kB" {
			n <<= 10
		}
		switch k {
		case "MemTotal":
			total = n
		case "MemAvailable":
			avail, haveAvail = n, true
		}
	}
	if !haveAvail {
		return 0, 0, errors.New("no MemAvailable in meminfo")
	}
	return total, avail, nil
}

// victim is the process with the largest resident set, leaving out pid 1, envd, the protected
// pids and processes that have exited (zombies hold no memory).
func (g *oomGuard) victim() (oomVictim, bool) {
	ents, err := os.ReadDir(g.cfg.Proc)
	if err != nil {
		return oomVictim{}, false
	}
	var best oomVictim
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid <= 1 || pid == g.self || g.protected(pid) {
			continue
		}
		rss, ok := g.rss(pid)
		if !ok || rss == 0 || rss < best.RSS || (rss == best.RSS && pid < best.Pid) {
			continue
		}
		best = oomVictim{Pid: pid, RSS: rss}
	}
	if best.Pid == 0 {
		return oomVictim{}, false
	}
	if c, err := os.ReadFile(filepath.Join(g.cfg.Proc, strconv.Itoa(best.Pid), "comm")); err == nil {
		best.Comm = strings.TrimSpace(string(c))
	}
	return best, true
}

func (g *oomGuard) protected(pid int) bool {
	for _, p := range g.cfg.Protect {
		if p == pid {
			return true
		}
	}
	return false
}

// rss is pid's resident set in bytes (/proc/<pid>/statm, in pages).
func (g *oomGuard) rss(pid int) (uint64, bool) {
	b, err := os.ReadFile(filepath.Join(g.cfg.Proc, strconv.Itoa(pid), "statm"))
	if err != nil {
		return 0, false
	}
	f := strings.Fields(string(b))
	if len(f) < 2 {
		return 0, false
	}
	n, err := strconv.ParseUint(f[1], 10, 64)
	if err != nil {
		return 0, false
	}
	return n * uint64(os.Getpagesize()), true
}

// alive reports whether pid still runs (a zombie has exited).
func (g *oomGuard) alive(pid int) bool {
	b, err := os.ReadFile(filepath.Join(g.cfg.Proc, strconv.Itoa(pid), "stat"))
	if err != nil {
		return false
	}
	// "pid (comm) S ...": the state follows the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 || i+2 >= len(b) {
		return false
	}
	return b[i+2] != 'Z' && b[i+2] != 'X'
}
