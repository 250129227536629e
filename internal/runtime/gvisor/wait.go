package gvisor

// Exit watching (Driver.Wait).
//
// An instance is its runsc sandbox process ("runsc-sandbox ... boot ... <id>"). That process is
// not the daemon's child (runsc run --detach forks it and exits; the daemon may also have been
// restarted since), so the driver cannot wait(2) for it. Instead it holds a pidfd on it, which
// Go's runtime poller watches (one epoll for every instance), and one goroutine per watched
// instance waits there; any number of Wait calls share it. When the process is gone the driver
// tells why:
//
//   - the driver stopped it itself (Kill, Delete, Checkpoint): ExitKilled with that detail;
//   - its memory cgroup counted an OOM kill (memory.oom_control's oom_kill on cgroup v1,
//     memory.events' oom_kill on v2), read before anything removes the cgroup: ExitOOM;
//   - the process exited normally (it does when the sandbox's init process exits: runsc exits
//     with init's status, 128+n when init died of signal n): ExitExited with that status;
//   - it was killed by a signal from outside: ExitKilled.
//
// The exit status of a process that is not one's child comes from PIDFD_GET_INFO with
// PIDFD_INFO_EXIT (Linux 6.15+; kept by the kernel once the process is reaped), or from the
// exit_code field of /proc/<pid>/stat while it is a zombie. Where neither is available (an older
// kernel, or an instance that died while no daemon watched it) the status is unknown: Code -1,
// and the reason is ExitKilled unless the cgroup shows an OOM kill.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/runtime"
)

// watch is the exit watcher of one sandbox process (one generation of an instance id).
type watch struct {
	pid  int
	ooms int // the cgroup's OOM kill count when the watch began
	done chan struct{}
	exit runtime.Exit // set before done is closed
}

// Wait implements runtime.Driver. For an unknown id (never started, or deleted) it returns at once
// with an error wrapping errdefs.ErrNotFound; for a stopped instance it returns at once with the
// reason the driver can still tell.
func (d *Driver) Wait(ctx context.Context, id string) (runtime.Exit, error) {
	if err := validateID(id); err != nil {
		return runtime.Exit{}, err
	}
	if err := ctx.Err(); err != nil {
		return runtime.Exit{}, err
	}
	w, err := d.watchFor(ctx, id)
	if err != nil {
		return runtime.Exit{}, err
	}
	select {
	case <-w.done:
		return w.exit, nil
	case <-ctx.Done():
		return runtime.Exit{}, ctx.Err()
	}
}

// watchFor returns the watch of id's current sandbox process, starting one if needed. A stopped
// instance gets a watch that is already done.
func (d *Driver) watchFor(ctx context.Context, id string) (*watch, error) {
	pid, pidfd, err := d.openSandbox(ctx, id)
	if err != nil {
		return nil, err
	}
	if pidfd < 0 { // stopped: what a watcher saw, else what the cgroup still tells
		w := &watch{done: make(chan struct{})}
		d.mu.Lock()
		exit, ok := d.exits[id]
		d.mu.Unlock()
		if !ok {
			exit = d.classify(id, -1, -1, 0)
		}
		w.exit = exit
		close(w.done)
		return w, nil
	}
	d.mu.Lock()
	if w := d.watches[id]; w != nil && w.pid == pid {
		d.mu.Unlock()
		unix.Close(pidfd)
		return w, nil
	}
	w := &watch{pid: pid, ooms: d.oomKills(id), done: make(chan struct{})}
	d.watches[id] = w
	d.mu.Unlock()
	go d.runWatch(id, w, pidfd)
	return w, nil
}

// openSandbox finds id's sandbox process and opens a pidfd on it. pidfd is -1 when the instance
// exists but is stopped; an unknown id is ErrNotFound.
func (d *Driver) openSandbox(ctx context.Context, id string) (pid, pidfd int, err error) {
	if pid = d.statePid(id); pid > 0 {
		if fd, err := unix.PidfdOpen(pid, unix.PIDFD_NONBLOCK); err == nil {
			// The pid is checked after the pidfd pins it, so it cannot be a recycled one.
			if isSandboxProcess(pid, id) {
				return pid, fd, nil
			}
			unix.Close(fd)
		}
	}
	st, err := d.State(ctx, id)
	if err != nil {
		return 0, -1, err
	}
	if st.State != runtime.StateRunning {
		return 0, -1, nil
	}
	fd, err := unix.PidfdOpen(st.Pid, unix.PIDFD_NONBLOCK)
	if err != nil {
		return 0, -1, nil // exited in between
	}
	if !isSandboxProcess(st.Pid, id) {
		unix.Close(fd)
		return 0, -1, nil
	}
	return st.Pid, fd, nil
}

// statePid reads the sandbox pid from runsc's state file (see sandboxPid); 0 if unreadable.
func (d *Driver) statePid(id string) int {
	pid, err := readStatePid(d.cfg.Root, id)
	if err != nil {
		return 0
	}
	return pid
}

// isSandboxProcess reports whether pid is runsc's sandbox process of instance id.
func isSandboxProcess(pid int, id string) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		return false
	}
	args := strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
	if len(args) < 2 || args[len(args)-1] != id {
		return false
	}
	for _, a := range args {
		if a == "boot" {
			return true
		}
	}
	return false
}

// runWatch waits on the pidfd through Go's poller (no thread is held), then classifies the exit.
func (d *Driver) runWatch(id string, w *watch, pidfd int) {
	f := os.NewFile(uintptr(pidfd), fmt.Sprintf("pidfd:%d", w.pid))
	defer f.Close()
	if rc, err := f.SyscallConn(); err == nil {
		err = rc.Read(func(fd uintptr) bool { return pidfdExited(int(fd)) })
		if err != nil {
			d.log.Warn("exit watcher: poll failed; falling back to a blocking wait", "sandbox_id", id, "err", err)
			for !pidfdExited(pidfd) {
				time.Sleep(100 * time.Millisecond)
			}
		}
	}
	w.exit = d.classify(id, w.pid, pidfd, w.ooms) // f still owns and holds pidfd open
	d.mu.Lock()
	if d.watches[id] == w {
		delete(d.watches, id)
		d.exits[id] = w.exit
	}
	d.mu.Unlock()
	close(w.done)
	d.log.Debug("sandbox exited", "sandbox_id", id, "pid", w.pid, "reason", w.exit.Reason, "code", w.exit.Code, "detail", w.exit.Detail)
}

// pidfdExited reports whether the process behind pidfd has exited (the pidfd is readable).
func pidfdExited(pidfd int) bool {
	fds := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
	for {
		n, err := unix.Poll(fds, 0)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		return err != nil || n > 0
	}
}

// classify tells why id's sandbox process (pid, held by pidfd; -1 when unknown) stopped. ooms is
// the cgroup's OOM kill count while it still ran: the host OOM killer often kills only the
// systrap stub of one application process (the sandbox lives on and that process dies of
// SIGKILL), so only kills counted since then, with a sandbox process that did not exit normally,
// mean the sandbox itself died of OOM.
func (d *Driver) classify(id string, pid, pidfd, ooms int) runtime.Exit {
	exit := runtime.Exit{Reason: runtime.ExitKilled, Code: -1, At: time.Now()}
	// The cgroup first: nothing must remove it before it is read.
	oom := d.oomKills(id) > ooms
	status, known := exitStatus(pid, pidfd)
	d.mu.Lock()
	intent := d.stopping[id]
	d.mu.Unlock()
	switch {
	case intent != "":
		exit.Detail = intent
	case known && status.Exited():
		exit.Reason, exit.Code = runtime.ExitExited, status.ExitStatus()
		exit.Detail = fmt.Sprintf("init process exited with status %d", exit.Code)
	case oom:
		exit.Reason, exit.Detail = runtime.ExitOOM, "memory limit exceeded: the sandbox was killed by the host's OOM killer"
	case known && status.Signaled():
		exit.Detail = fmt.Sprintf("sandbox process killed by signal %d (%v)", int(status.Signal()), status.Signal())
	default:
		exit.Detail = "sandbox process gone (status unknown)"
	}
	return exit
}

// setStopping records that the driver itself is stopping id (reason for Wait), or clears it.
func (d *Driver) setStopping(id, why string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if why == "" {
		delete(d.stopping, id)
	} else {
		d.stopping[id] = why
	}
}

// forgetExit drops what the driver remembers of id's last exit (a new instance, or Delete).
func (d *Driver) forgetExit(id string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(d.stopping, id)
	delete(d.exits, id)
}

// pidfdInfo is struct pidfd_info of linux/pidfd.h, up to exit_code (PIDFD_INFO_SIZE_VER0).
type pidfdInfo struct {
	Mask     uint64
	CgroupID uint64
	Pid      uint32
	Tgid     uint32
	Ppid     uint32
	Ruid     uint32
	Rgid     uint32
	Euid     uint32
	Egid     uint32
	Suid     uint32
	Sgid     uint32
	Fsuid    uint32
	Fsgid    uint32
	ExitCode int32
}

const (
	pidfdInfoExit = 1 << 3 // PIDFD_INFO_EXIT
	// PIDFD_GET_INFO = _IOWR(PIDFS_IOCTL_MAGIC 0xFF, 11, struct pidfd_info) with the VER0 size.
	pidfdGetInfo = 3<<30 | uintptr(unsafe.Sizeof(pidfdInfo{}))<<16 | 0xFF<<8 | 11
)

// exitStatus returns the wait status of an exited process: from the kernel's pidfd info once it
// is reaped (its parent is init, which reaps at once), else from /proc while it is a zombie.
func exitStatus(pid, pidfd int) (syscall.WaitStatus, bool) {
	if pid <= 0 || pidfd < 0 {
		return 0, false
	}
	for i := 0; i < 50; i++ {
		info := pidfdInfo{Mask: pidfdInfoExit}
		_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(pidfd), pidfdGetInfo, uintptr(unsafe.Pointer(&info)))
		if errno == 0 && info.Mask&pidfdInfoExit != 0 {
			return syscall.WaitStatus(info.ExitCode), true
		}
		if errno == unix.ENOTTY || errno == unix.EINVAL {
			// No PIDFD_GET_INFO (before Linux 6.13): only a zombie still tells.
			return zombieStatus(pid)
		}
		if st, ok := zombieStatus(pid); ok {
			return st, true
		}
		time.Sleep(10 * time.Millisecond) // exited but not yet reaped and not yet a zombie entry
	}
	return 0, false
}

// zombieStatus reads exit_code (field 52) of /proc/<pid>/stat for a zombie.
func zombieStatus(pid int) (syscall.WaitStatus, bool) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, false
	}
	f := strings.Fields(s[i+1:]) // f[0] is field 3 (state)
	if len(f) < 50 || f[0] != "Z" {
		return 0, false
	}
	v, err := strconv.Atoi(f[49])
	if err != nil {
		return 0, false
	}
	return syscall.WaitStatus(v), true
}

// oomKills returns how many OOM kills the instance's memory cgroup counted (0 when it has no
// memory cgroup, or it is gone).
func (d *Driver) oomKills(id string) int {
	total := 0
	for _, dir := range d.instanceCgroups(id) {
		for _, name := range []string{"memory.oom_control", "memory.events"} { // v1, v2
			b, err := os.ReadFile(filepath.Join(dir, name))
			if err != nil {
				continue
			}
			for _, line := range strings.Split(string(b), "\n") {
				if k, v, ok := strings.Cut(line, " "); ok && k == "oom_kill" {
					n, _ := strconv.Atoi(strings.TrimSpace(v))
					total += n
				}
			}
		}
	}
	return total
}
