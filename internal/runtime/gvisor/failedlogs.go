package gvisor

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/ember-sandbox/ember/internal/runtime"
)

// The runsc logs of a failed start or restore. Without them a sentry that dies while it
// restores says only "containerManager.Restore failed: EOF": the sandbox process's stderr
// (where Go writes a panic) is /dev/null unless runsc is given a panic or debug log, a kill by
// the host kernel (OOM, seccomp) leaves no log at all, and the instance's log directory goes
// with its state dir. So every launch (run, create, restore) writes Go's runtime messages of
// the sandbox and gofer processes into the instance's log directory (panic.log, written only
// when they panic), with Config.SandboxLogs their logs too, and a failed launch moves that
// directory to <FailedLogDir>/<instance>-<op>-<time> with what the kernel logged about the
// instance (kernel.log, kmsg.go); the error names it and the line that says why.

// failedLogsKept bounds the failed launches' log directories kept (the newest).
const failedLogsKept = 20

// panicLogName is the file in an instance's log directory where the sandbox and gofer
// processes write Go's runtime messages (a panic, a fatal error).
const panicLogName = "panic.log"

// launchLogFlags are the flags that make runsc write the sandbox's logs into logDir. With
// Config.Debug, globalFlags already logs every command at debug level there.
func (d *Driver) launchLogFlags(logDir string) []string {
	// runsc creates the panic log world-readable: made here first, it stays the daemon's own
	// (0600, like every file ember keeps).
	panicLog := filepath.Join(logDir, panicLogName)
	if f, err := os.OpenFile(panicLog, os.O_WRONLY|os.O_CREATE, 0o600); err == nil {
		f.Close()
	}
	f := []string{"--panic-log=" + panicLog}
	if d.cfg.SandboxLogs && !d.cfg.Debug {
		f = append(f, "--debug-log="+logDir+string(filepath.Separator), "--debug-command=boot,gofer")
	}
	return f
}

func (d *Driver) failedLogDir() string {
	if d.cfg.FailedLogDir != "" {
		return d.cfg.FailedLogDir
	}
	return filepath.Join(filepath.Dir(d.cfg.Root), "logs", "failed")
}

// failedLaunch cleans up after id's failed launch and keeps its logs (keepFailedLogs), once
// its sandbox process, which may still be writing them, is gone. runsc's stderr of this launch
// starts at errStart in init.err; the launch started at since (CLOCK_MONOTONIC).
func (d *Driver) failedLaunch(id, logs, op string, errStart int64, since time.Duration, err error) error {
	pid, _ := readStatePid(d.cfg.Root, id)
	d.cleanupFailed(id)
	for deadline := time.Now().Add(2 * time.Second); pid > 0 && alive(pid) && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
	}
	q := kmsgQuery{since: since - time.Second, pid: pid, runsc: d.cfg.Runsc}
	if !d.cfg.IgnoreCgroups {
		q.cgroup = d.cgroupPath(id)
	}
	return d.keepFailedLogs(id, logs, op, errStart, kernelSays(q), err)
}

// keepFailedLogs moves the log directory of id's failed launch (op: run, create, restore)
// into the failed logs and returns err with their path and the reason found in them, or in
// what the kernel logged about its sandbox process (kernel).
func (d *Driver) keepFailedLogs(id, logs, op string, errStart int64, kernel []string, err error) error {
	why := ""
	if len(kernel) > 0 {
		why = trimReason("kernel: " + kernel[len(kernel)-1])
		_ = keepKernelSays(logs, kernel)
	}
	if why == "" {
		why = failureReason(logs)
	}
	if why == "" {
		// The sandbox said nothing (or was stopped before it did): runsc's own error.
		why = trimReason(firstLineFrom(filepath.Join(logs, "init.err"), errStart))
	}
	parent := d.failedLogDir()
	dst := filepath.Join(parent, fmt.Sprintf("%s-%s-%s", id, op, time.Now().UTC().Format("20060102T150405.000Z")))
	if merr := os.MkdirAll(parent, 0o700); merr != nil {
		d.log.Warn("keep the logs of a failed launch", "instance", id, "err", merr)
		return withReason(err, why)
	}
	if merr := moveDir(logs, dst); merr != nil {
		d.log.Warn("keep the logs of a failed launch", "instance", id, "err", merr)
		return withReason(err, why)
	}
	privateFiles(dst)
	// Later runsc commands on id (a delete) still log there.
	_ = os.MkdirAll(logs, 0o700)
	pruneFailedLogs(parent, failedLogsKept)
	// The driver's error (runsc's stderr) is in the kept init.err; the log line has it.
	d.log.Warn("runsc launch failed; its logs are kept", "instance", id, "op", op, "logs", dst, "reason", why, "err", err)
	return &runtime.LaunchError{ID: id, Op: op, Reason: why, Logs: dst, Err: err}
}

func withReason(err error, why string) error {
	if why == "" {
		return err
	}
	return fmt.Errorf("%w [%s]", err, why)
}

// moveDir renames src to dst, or copies its files when they are on different filesystems.
func moveDir(src, dst string) error {
	err := os.Rename(src, dst)
	if err == nil || !errors.Is(err, syscall.EXDEV) {
		return err
	}
	if err := os.Mkdir(dst, 0o700); err != nil {
		return err
	}
	ents, err := os.ReadDir(src)
	if err != nil {
		return err
	}
	for _, e := range ents {
		if !e.Type().IsRegular() {
			continue
		}
		if err := copyFile(filepath.Join(src, e.Name()), filepath.Join(dst, e.Name())); err != nil {
			return err
		}
	}
	return nil
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// pruneFailedLogs removes all but the newest keep directories in parent.
func pruneFailedLogs(parent string, keep int) {
	ents, err := os.ReadDir(parent)
	if err != nil {
		return
	}
	type dir struct {
		name string
		mod  time.Time
	}
	var dirs []dir
	for _, e := range ents {
		if fi, err := e.Info(); err == nil && e.IsDir() {
			dirs = append(dirs, dir{e.Name(), fi.ModTime()})
		}
	}
	if len(dirs) <= keep {
		return
	}
	sort.Slice(dirs, func(i, j int) bool { return dirs[i].mod.After(dirs[j].mod) })
	for _, d := range dirs[keep:] {
		os.RemoveAll(filepath.Join(parent, d.name))
	}
}

// maxReason bounds the reason put into an error.
const maxReason = 300

var (
	// A Go runtime message: panic, fatal error, a signal.
	goFatalRe = regexp.MustCompile(`^(panic: |fatal error: |runtime: |\[signal |SIGSYS|SIGSEGV|SIGBUS|SIGABRT)`)
	// A log line of runsc's text format: level letter, date, time, thread, file:line] message.
	logLineRe = regexp.MustCompile(`^([DIWEF])\d{4} [0-9:.]+\s+\d+\s+\S+\] (.*)$`)
	// The messages of the sandbox's or gofer's log that tell why it ended.
	fatalMsgRe = regexp.MustCompile(`(?i)panic|fatal|signal|killed|failed`)
)

// failureReason returns the line of a failed launch's logs that says why: the first Go runtime
// message of the panic log, else the last fatal-sounding message of the sandbox's or gofer's
// log, else "".
func failureReason(logs string) string {
	if line := firstMatch(filepath.Join(logs, panicLogName), goFatalRe); line != "" {
		return trimReason(line)
	}
	files, _ := filepath.Glob(filepath.Join(logs, "*"))
	var last string
	for _, f := range files {
		base := filepath.Base(f)
		if !strings.Contains(base, "boot") && !strings.Contains(base, "gofer") {
			continue
		}
		if line := lastFatal(f); line != "" {
			last = line
			if strings.Contains(base, "boot") {
				break
			}
		}
	}
	return trimReason(last)
}

// firstLineFrom returns the first non-empty line of path from offset off.
func firstLineFrom(path string, off int64) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	if _, err := f.Seek(off, io.SeekStart); err != nil {
		return ""
	}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if l := strings.TrimSpace(sc.Text()); l != "" {
			return l
		}
	}
	return ""
}

func trimReason(s string) string {
	s = strings.TrimSpace(s)
	if len(s) > maxReason {
		s = s[:maxReason] + "..."
	}
	return s
}

func firstMatch(path string, re *regexp.Regexp) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if re.MatchString(sc.Text()) {
			return sc.Text()
		}
	}
	return ""
}

// lastFatal returns the message of the last warning-or-worse line of a runsc log that sounds
// fatal, or the last Go runtime message in it (a log's file is also the process's stderr).
func lastFatal(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	var last, goMsg string
	for sc.Scan() {
		line := sc.Text()
		if m := logLineRe.FindStringSubmatch(line); m != nil {
			if m[1] != "D" && m[1] != "I" && fatalMsgRe.MatchString(m[2]) {
				last = m[2]
			}
			continue
		}
		if goMsg == "" && goFatalRe.MatchString(line) {
			goMsg = line
		}
	}
	if goMsg != "" {
		return goMsg
	}
	return last
}
