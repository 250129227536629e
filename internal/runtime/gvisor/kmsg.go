package gvisor

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// A sandbox process killed by the host kernel (a seccomp filter's SIGSYS, the OOM killer)
// writes nothing: the kernel's log says why. kernelSays reads what the kernel logged, since the
// launch started, about the instance: its cgroup (the OOM killer names it, and the pid it
// kills), its sandbox pid when known, and seccomp kills of runsc processes (an audit record
// names only the pid and the program: one of another instance that died at the same moment
// may be among them).

// monotonicNow is CLOCK_MONOTONIC, the clock of the kernel log's timestamps.
func monotonicNow() time.Duration {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		return 0
	}
	return time.Duration(ts.Nano())
}

// kmsgQuery says which kernel log records are about an instance.
type kmsgQuery struct {
	since  time.Duration // CLOCK_MONOTONIC
	cgroup string        // the instance's cgroup, relative ("ember/<id>"); "" = none
	pid    int           // its sandbox process, 0 = unknown
	runsc  string        // the runsc binary
}

// kernelSays returns the kernel's log records about q's instance, oldest first (nil when the
// log cannot be read).
func kernelSays(q kmsgQuery) []string {
	fd, err := unix.Open("/dev/kmsg", unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil
	}
	defer unix.Close(fd)
	var out []string
	pids := map[int]bool{}
	if q.pid > 0 {
		pids[q.pid] = true
	}
	buf := make([]byte, 8192)
	for {
		n, err := unix.Read(fd, buf)
		if errors.Is(err, unix.EPIPE) {
			continue // records were overwritten while reading
		}
		if err != nil || n <= 0 {
			return out
		}
		if msg, ok := q.about(buf[:n], pids); ok {
			out = append(out, msg)
		}
	}
}

var (
	kmsgPidRe    = regexp.MustCompile(`[ ,]pid=(\d+)[ ,]`)
	kmsgKilledRe = regexp.MustCompile(`[Kk]illed process (\d+) \(`)
)

// about returns the message of one /dev/kmsg record ("prio,seq,usec,flags[,...];message\n",
// then continuation lines) if it is about q's instance: it names its cgroup (its pid then joins
// pids), or a pid in pids, or it is the audit record of a seccomp kill of runsc.
func (q kmsgQuery) about(rec []byte, pids map[int]bool) (string, bool) {
	semi := bytes.IndexByte(rec, ';')
	if semi < 0 {
		return "", false
	}
	fields := bytes.SplitN(rec[:semi], []byte(","), 4)
	if len(fields) < 3 {
		return "", false
	}
	usec, err := strconv.ParseInt(string(fields[2]), 10, 64)
	if err != nil || time.Duration(usec)*time.Microsecond < q.since {
		return "", false
	}
	msg := string(rec[semi+1:])
	if i := strings.IndexByte(msg, '\n'); i >= 0 {
		msg = msg[:i]
	}
	pidOf := func(re *regexp.Regexp) int {
		if m := re.FindStringSubmatch(msg); m != nil {
			n, _ := strconv.Atoi(m[1])
			return n
		}
		return 0
	}
	if q.cgroup != "" && (strings.Contains(msg, "/"+q.cgroup+",") || strings.HasSuffix(msg, "/"+q.cgroup)) {
		if p := pidOf(kmsgPidRe); p > 0 {
			pids[p] = true
		}
		return msg, true
	}
	if p := pidOf(kmsgPidRe); p > 0 && pids[p] {
		return msg, true
	}
	if p := pidOf(kmsgKilledRe); p > 0 && pids[p] {
		return msg, true
	}
	if strings.Contains(msg, "type=1326") && q.runsc != "" && strings.Contains(msg, `exe="`+q.runsc+`"`) {
		return msg, true
	}
	return "", false
}

// keepKernelSays writes records into dir/kernel.log.
func keepKernelSays(dir string, records []string) error {
	var b bytes.Buffer
	for _, r := range records {
		b.WriteString(r + "\n")
	}
	return os.WriteFile(filepath.Join(dir, "kernel.log"), b.Bytes(), 0o600)
}
