package envd

import (
	"bytes"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// zombieAge is how long a zombie child that envd did not start must stay unreaped before the
// reaper collects it. Code that waits for its own children (os/exec) reaps them at once, so an
// old zombie is an orphan that was reparented to envd.
const zombieAge = time.Second

// scanDelay is how long after a SIGCHLD the reaper scans /proc for zombies. Every command's
// exit sends one, at the moment envd sends the command's end event and the client may start
// its next command: a scan then would compete with both for the sandbox's CPUs (and a start
// waits for the scan's lock). An orphan is reaped after zombieAge anyway, so the delay costs
// nothing, and a burst of exits is scanned once.
const scanDelay = 100 * time.Millisecond

// reaper collects orphaned zombies when envd is the sandbox's init (or a child subreaper). It
// never waits for a pid that envd's process manager tracks, so commands keep their exit status.
type reaper struct {
	log  *slog.Logger
	sigc chan os.Signal
	done chan struct{}
	wg   sync.WaitGroup

	mu      sync.Mutex
	tracked map[int]bool
	first   map[int]time.Time // untracked zombie -> when it was first seen
}

func startReaper(log *slog.Logger, _ *processManager) *reaper {
	if os.Getpid() != 1 {
		if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
			log.Warn("cannot become child subreaper", "err", err)
		}
	}
	r := &reaper{
		log:     log,
		sigc:    make(chan os.Signal, 1),
		done:    make(chan struct{}),
		tracked: map[int]bool{},
		first:   map[int]time.Time{},
	}
	signal.Notify(r.sigc, syscall.SIGCHLD)
	r.wg.Add(1)
	go r.loop()
	return r
}

func (r *reaper) loop() {
	defer r.wg.Done()
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	var next time.Time // when the armed timer fires; zero: not armed
	arm := func(d time.Duration) {
		if at := time.Now().Add(d); next.IsZero() || at.Before(next) {
			timer.Reset(d)
			next = at
		}
	}
	for {
		select {
		case <-r.done:
			return
		case <-r.sigc:
			arm(scanDelay)
			continue
		case <-timer.C:
			next = time.Time{}
		}
		if r.scan(time.Now()) {
			arm(zombieAge) // young zombies: look again once they are old enough
		}
	}
}

// scan reaps the untracked zombies that are old enough and reports whether younger ones remain.
func (r *reaper) scan(now time.Time) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	next := map[int]time.Time{}
	for _, pid := range zombieChildren(os.Getpid()) {
		if r.tracked[pid] {
			continue
		}
		seen, ok := r.first[pid]
		if !ok {
			seen = now
		}
		if now.Sub(seen) < zombieAge {
			next[pid] = seen
			continue
		}
		var ws unix.WaitStatus
		if wpid, err := unix.Wait4(pid, &ws, unix.WNOHANG, nil); err == nil && wpid == pid {
			r.log.Debug("reaped orphan", "pid", pid, "status", ws.ExitStatus())
		}
	}
	r.first = next
	return len(next) > 0
}

// startTracked starts cmd and tracks its pid atomically with respect to scans.
func (r *reaper) startTracked(cmd *exec.Cmd) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := cmd.Start(); err != nil {
		return err
	}
	r.tracked[cmd.Process.Pid] = true
	return nil
}

func (r *reaper) untrack(pid int) {
	r.mu.Lock()
	delete(r.tracked, pid)
	r.mu.Unlock()
}

func (r *reaper) stop() {
	signal.Stop(r.sigc)
	close(r.done)
	r.wg.Wait()
}

// zombieChildren lists the pids of parent's children that are zombies, from /proc.
func zombieChildren(parent int) []int {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var out []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		// "pid (comm) S ppid ...": comm may hold spaces and parentheses.
		i := bytes.LastIndexByte(b, ')')
		if i < 0 {
			continue
		}
		f := bytes.Fields(b[i+1:])
		if len(f) < 2 || string(f[0]) != "Z" {
			continue
		}
		if ppid, err := strconv.Atoi(string(f[1])); err == nil && ppid == parent {
			out = append(out, pid)
		}
	}
	return out
}
