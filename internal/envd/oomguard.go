package envd

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
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
	// looks again before the free memory could be gone at that rate. Default 16 GiB/s (measured:
	// 64 processes of a fork bomb committed 850 MiB in 80 ms on 2 cores).
	MaxRate float64
	// MinInterval and MaxInterval bound the time between two looks (default 5 ms and 50 ms).
	MinInterval, MaxInterval time.Duration
	// Settle bounds the wait, after a kill, for the victim to die before the guard picks
	// another (default 1 s); Release bounds the wait for its memory to come back once it has
	// died (default 500 ms), renewed while the free memory still grows (up to Settle). The guest
	// is stalled meanwhile, so nothing allocates: the wait ends as soon as the memory is back,
	// and it is long only when a victim's memory comes back slowly (a loaded host tears a large
	// address space down late), when killing the next process would kill for memory already
	// on its way back — in the e2e test, the caller's next command.
	Settle, Release time.Duration
	// Kill sends sig to pid (default syscall.Kill).
	Kill func(pid int, sig syscall.Signal) error
	// Protect lists pids never killed besides pid 1 and envd's own.
	Protect []int
	// IdleCheck is how often, while the memory is not low, the guard looks whether any process
	// but pid 1 and envd is left (default 1 s). With none, nothing but envd can allocate, so the
	// guard stops looking until envd starts a process (Wake): an idle sandbox costs no CPU.
	IdleCheck time.Duration
	// Free is the cheap look at the guest's memory (total and free bytes; ok false when it
	// cannot tell): while it shows more free than the reserve, /proc/meminfo is not read.
	// Default: sysinfo(2) when Proc is the real /proc, none otherwise. Under gVisor a read of
	// /proc/meminfo first asks the host which of the guest's pages are committed (a scan of
	// its memory file, throttled to one per clock tick): 1.4 ms at the guard's pace, so that a
	// sandbox with any process alive (a kernel, a server, a sleep) cost 2-3 % of a core while
	// idle. sysinfo's free memory is the memory file's allocated blocks as the host counts them
	// (one fstat, 0.06 ms), never more than /proc/meminfo's MemAvailable: the pages the Sentry
	// knows of are among them. So when it shows enough free memory, so would /proc/meminfo.
	Free func() (total, free uint64, ok bool)
}

type oomGuard struct {
	cfg     oomGuardConfig
	log     *slog.Logger
	self    int
	stopped chan struct{}
	wake    chan struct{} // a process is about to start (Wake)
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
		cfg.MaxRate = 16 << 30
	}
	if cfg.MinInterval <= 0 {
		cfg.MinInterval = 5 * time.Millisecond
	}
	if cfg.MaxInterval <= 0 {
		cfg.MaxInterval = 50 * time.Millisecond
	}
	if cfg.Settle <= 0 {
		cfg.Settle = time.Second
	}
	if cfg.Release <= 0 {
		cfg.Release = 500 * time.Millisecond
	}
	if cfg.Kill == nil {
		cfg.Kill = syscall.Kill
	}
	if cfg.IdleCheck <= 0 {
		cfg.IdleCheck = time.Second
	}
	if cfg.Free == nil && cfg.Proc == "/proc" {
		cfg.Free = sysinfoFree
	}
	return &oomGuard{cfg: cfg, log: log, self: os.Getpid(), stopped: make(chan struct{}), wake: make(chan struct{}, 1)}
}

// Wake tells the guard a process is about to start: every process in a sandbox is envd's or a
// descendant of one that exists, so after a look that found none but envd the guard waits for
// this (see IdleCheck). Never blocks.
func (g *oomGuard) Wake() {
	select {
	case g.wake <- struct{}{}:
	default:
	}
}

// alone reports whether no process but pid 1 and envd is alive (a zombie holds no memory).
func (g *oomGuard) alone() bool {
	ents, err := os.ReadDir(g.cfg.Proc)
	if err != nil {
		return false
	}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid <= 1 || pid == g.self {
			continue
		}
		if g.alive(pid) {
			return false
		}
	}
	return true
}

// reserve is how much free memory the guard keeps: below it, the guest is out of memory.
// 1/64 of the total, between 8 and 64 MiB (16 MiB of 1 GiB).
func reserve(total uint64) uint64 {
	return min(max(total/64, 8<<20), 64<<20)
}

// mem is one look at the guest's memory (bytes).
type mem struct {
	total, avail uint64
	// used is what the guest uses, past total too: MemAvailable stops at 0, so it is also
	// estimated from the uncapped counters (AnonPages + Cached - Shmem: anonymous, page cache,
	// mapped and tmpfs memory, the Sentry's accounting of everything but its own kernel's).
	used uint64
}

func (m mem) low() bool { return m.avail <= reserve(m.total) }

// excess is how much must be freed to bring the guest back to twice the reserve free.
func (m mem) excess() uint64 {
	target := m.total - min(m.total, 2*reserve(m.total))
	if m.used <= target {
		return 0
	}
	return m.used - target
}

// run watches until ctx is done. If the guest's memory cannot be read it logs why and returns.
func (g *oomGuard) run(ctx context.Context) {
	defer close(g.stopped)
	m, err := g.meminfo()
	if err != nil || m.total == 0 {
		g.log.Warn("out-of-memory guard off: the guest's memory is unreadable", "err", err)
		return
	}
	g.log.Debug("out-of-memory guard on", "total_mib", m.total>>20, "reserve_mib", reserve(m.total)>>20)
	var nothing bool // nothing left to kill: logged once until memory is back
	var stalled bool // the guard has stopped every process
	lastIdleCheck := time.Now()
	defer func() {
		if stalled {
			g.resume()
		}
	}()
	for {
		if m.low() {
			if !stalled {
				// Stall the guest, as a kernel stalls allocations while its OOM killer works: the
				// guard is one guest process among those allocating, and with many of them (a fork
				// bomb) it would get the CPU too rarely to keep up.
				g.stall()
				stalled = true
				if n, err := g.meminfo(); err == nil && n.total > 0 {
					m = n
				}
			}
			vs := g.victims(m.excess())
			switch {
			case len(vs) > 0:
				nothing = false
				g.kill(ctx, vs, m)
			case !nothing:
				nothing = true
				g.log.Warn("out of memory and no process to kill", "used_mib", m.used>>20, "total_mib", m.total>>20)
			}
			if len(vs) == 0 { // nothing the guard can do: let the guest run (the host's limit is the last resort)
				g.resume()
				stalled = false
			}
		} else {
			nothing = false
			if stalled {
				g.resume()
				stalled = false
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(g.interval(m)):
		}
		if !stalled && !m.low() && time.Since(lastIdleCheck) >= g.cfg.IdleCheck {
			lastIdleCheck = time.Now()
			// A Wake from before this look is stale: the look sees that process, or its exit.
			select {
			case <-g.wake:
			default:
			}
			if g.alone() {
				// Nothing but envd: no process can allocate until envd starts one.
				select {
				case <-ctx.Done():
					return
				case <-g.wake:
				}
				lastIdleCheck = time.Now()
			}
		}
		if n, err := g.look(); err == nil && n.total > 0 {
			m = n
		}
	}
}

// look is the guard's periodic look at the guest's memory: the cheap one (Free) while it shows
// more free memory than the reserve, else /proc/meminfo, which decides whether the memory is
// low and how much is used past the total.
func (g *oomGuard) look() (mem, error) {
	if g.cfg.Free != nil {
		if total, free, ok := g.cfg.Free(); ok && total > 0 && free <= total && free > reserve(total) {
			return mem{total: total, avail: free, used: total - free}, nil
		}
	}
	return g.meminfo()
}

// sysinfoFree is the guest's total and free memory from sysinfo(2).
func sysinfoFree() (total, free uint64, ok bool) {
	var si syscall.Sysinfo_t
	if err := syscall.Sysinfo(&si); err != nil {
		return 0, 0, false
	}
	unit := max(uint64(si.Unit), 1)
	return si.Totalram * unit, si.Freeram * unit, true
}

// stall stops every process but envd: kill(-1, SIGSTOP) spares init (envd) and the caller, and
// costs one system call, so it is the first thing the guard does when the memory runs out.
func (g *oomGuard) stall() {
	if err := g.cfg.Kill(-1, syscall.SIGSTOP); err != nil && !errors.Is(err, syscall.ESRCH) {
		g.log.Warn("out of memory: stopping the processes failed", "err", err)
	}
}

// resume continues the processes stall stopped (a process stopped before the stall, by a user,
// is continued too: the price of stalling at once).
func (g *oomGuard) resume() {
	if err := g.cfg.Kill(-1, syscall.SIGCONT); err != nil && !errors.Is(err, syscall.ESRCH) {
		g.log.Warn("out of memory: continuing the processes failed", "err", err)
	}
}

// interval is the wait before the next look: the time the free memory above the reserve would
// last at MaxRate, within [MinInterval, MaxInterval].
func (g *oomGuard) interval(m mem) time.Duration {
	r := reserve(m.total)
	if m.avail <= r {
		return g.cfg.MinInterval
	}
	d := time.Duration(float64(m.avail-r) / g.cfg.MaxRate * float64(time.Second))
	return min(max(d, g.cfg.MinInterval), g.cfg.MaxInterval)
}

// kill SIGKILLs vs, then waits until they have died (at most Settle) and their memory is back
// (at most Release more), so that one allocation costs one process, yet a burst of processes
// (a fork bomb) is met kill after kill.
func (g *oomGuard) kill(ctx context.Context, vs []oomVictim, m mem) {
	var sent []int
	for _, v := range vs {
		if err := g.cfg.Kill(v.Pid, syscall.SIGKILL); err != nil {
			if !errors.Is(err, syscall.ESRCH) {
				g.log.Warn("out of memory: kill failed", "pid", v.Pid, "err", err)
			}
			continue
		}
		sent = append(sent, v.Pid)
		g.log.Warn("out of memory: killed process", "pid", v.Pid, "comm", v.Comm, "rss_mib", v.RSS>>20, "used_mib", m.used>>20, "total_mib", m.total>>20)
	}
	if len(sent) == 0 {
		return
	}
	deadline := time.Now().Add(g.cfg.Settle)
	var last uint64 // the free memory last seen since the victims died
	for dead, limit := false, deadline; time.Now().Before(deadline); {
		if !dead && !slices.ContainsFunc(sent, g.alive) {
			dead, deadline = true, time.Now().Add(g.cfg.Release)
			limit = time.Now().Add(g.cfg.Settle)
		}
		if dead {
			n, err := g.meminfo()
			if err != nil || !n.low() {
				return
			}
			// Memory still coming back (a loaded host tears a large address space down
			// slowly): wait on, up to Settle, rather than kill the next process — often the
			// caller's next command — for memory that is already on its way back.
			if n.avail > last {
				if next := time.Now().Add(g.cfg.Release); last != 0 && next.After(deadline) {
					deadline = next
					if deadline.After(limit) {
						deadline = limit
					}
				}
				last = n.avail
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(g.cfg.MinInterval):
		}
	}
}

// meminfo reads the guest's memory.
func (g *oomGuard) meminfo() (mem, error) {
	b, err := os.ReadFile(filepath.Join(g.cfg.Proc, "meminfo"))
	if err != nil {
		return mem{}, err
	}
	var m mem
	var haveAvail bool
	var anon, cached, shmem uint64
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
			m.total = n
		case "MemAvailable":
			m.avail, haveAvail = n, true
		case "AnonPages":
			anon = n
		case "Cached":
			cached = n
		case "Shmem":
			shmem = n
		}
	}
	if !haveAvail {
		return mem{}, errors.New("no MemAvailable in meminfo")
	}
	m.used = m.total - min(m.avail, m.total)
	if u := anon + cached - min(shmem, anon+cached); u > m.used {
		m.used = u
	}
	return m, nil
}

// victims are the processes to kill to free excess bytes: the one with the largest resident
// set, then the next largest while the sum of their resident sets is short of excess (a burst of
// many processes past the memory). Left out: pid 1, envd, the protected pids and processes that
// have exited (zombies hold no memory).
func (g *oomGuard) victims(excess uint64) []oomVictim {
	ents, err := os.ReadDir(g.cfg.Proc)
	if err != nil {
		return nil
	}
	var all []oomVictim
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid <= 1 || pid == g.self || g.protected(pid) {
			continue
		}
		if rss, ok := g.rss(pid); ok && rss > 0 && g.alive(pid) {
			all = append(all, oomVictim{Pid: pid, RSS: rss})
		}
	}
	// Largest first; of equals, the newest.
	slices.SortFunc(all, func(a, b oomVictim) int {
		if a.RSS != b.RSS {
			return cmp.Compare(b.RSS, a.RSS)
		}
		return cmp.Compare(b.Pid, a.Pid)
	})
	var out []oomVictim
	var freed uint64
	for _, v := range all {
		if len(out) > 0 && freed >= excess {
			break
		}
		if c, err := os.ReadFile(filepath.Join(g.cfg.Proc, strconv.Itoa(v.Pid), "comm")); err == nil {
			v.Comm = strings.TrimSpace(string(c))
		}
		out = append(out, v)
		freed += v.RSS
	}
	return out
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
	st := g.state(pid)
	return st != 0 && st != 'Z' && st != 'X'
}

// state is pid's state letter (/proc/<pid>/stat), 0 if it is gone.
func (g *oomGuard) state(pid int) byte {
	b, err := os.ReadFile(filepath.Join(g.cfg.Proc, strconv.Itoa(pid), "stat"))
	if err != nil {
		return 0
	}
	// "pid (comm) S ...": the state follows the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 || i+2 >= len(b) {
		return 0
	}
	return b[i+2]
}
