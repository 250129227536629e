package drivertest

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"

	"syscall"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// waitResult is what one Wait call returned, and when.
type waitResult struct {
	exit runtime.Exit
	err  error
	at   time.Time
}

// waitAsync starts Wait(id) in the background.
func (e *env) waitAsync(c context.Context, id string) <-chan waitResult {
	ch := make(chan waitResult, 1)
	go func() {
		ex, err := e.d.Wait(c, id)
		ch <- waitResult{ex, err, time.Now()}
	}()
	return ch
}

// await takes the result of a Wait started by waitAsync, failing the test after bound.
func await(t *testing.T, ch <-chan waitResult, bound time.Duration, what string) waitResult {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(bound):
		t.Fatalf("Wait did not return within %v after %s", bound, what)
		return waitResult{}
	}
}

// testWaitKilled: a SIGKILL to the instance's host process is reported as ExitKilled within 2 s,
// to every one of many concurrent Waits.
func (s *suite) testWaitKilled(t *testing.T) {
	e := s.env(t)
	sp := e.start()
	st, err := e.d.State(ctx(t), sp.ID)
	if err != nil || st.Pid <= 0 {
		t.Fatalf("State = %+v, %v; want a pid", st, err)
	}
	const waiters = 200
	chans := make([]<-chan waitResult, waiters)
	t0 := time.Now()
	for i := range chans {
		chans[i] = e.waitAsync(ctx(t), sp.ID)
	}
	t.Logf("%d concurrent Waits set up in %v", waiters, time.Since(t0))
	time.Sleep(200 * time.Millisecond)
	for i, ch := range chans {
		select {
		case r := <-ch:
			t.Fatalf("Wait %d returned before the kill: %+v, %v", i, r.exit, r.err)
		default:
		}
	}
	killed := time.Now()
	if err := syscall.Kill(st.Pid, syscall.SIGKILL); err != nil {
		t.Fatalf("kill -9 %d: %v", st.Pid, err)
	}
	var worst time.Duration
	for _, ch := range chans {
		r := await(t, ch, 2*time.Second, "kill -9 of the sandbox process")
		if r.err != nil || r.exit.Reason != runtime.ExitKilled {
			t.Fatalf("Wait after kill -9 = %+v, %v; want reason %q", r.exit, r.err, runtime.ExitKilled)
		}
		worst = max(worst, r.at.Sub(killed))
	}
	t.Logf("Wait latency after kill -9: %v (slowest of %d waiters)", worst, waiters)
	// Stopped now: Wait returns at once, with the same reason.
	r := await(t, e.waitAsync(ctx(t), sp.ID), 2*time.Second, "the instance stopped")
	if r.err != nil || r.exit.Reason != runtime.ExitKilled {
		t.Errorf("Wait on the stopped instance = %+v, %v; want %q", r.exit, r.err, runtime.ExitKilled)
	}
}

// testWaitExited: init exiting by itself is ExitExited, with its status when the driver knows it.
func (s *suite) testWaitExited(t *testing.T) {
	e := s.env(t)
	sp := e.spec()
	sp.Args = []string{"/bin/sh", "-c", "sleep 0.5; exit 7"}
	if err := e.d.Start(ctx(t), sp); err != nil {
		t.Fatalf("Start: %v", err)
	}
	e.track(sp.ID)
	r := await(t, e.waitAsync(ctx(t), sp.ID), 10*time.Second, "init's exit")
	if r.err != nil || r.exit.Reason != runtime.ExitExited {
		t.Fatalf("Wait = %+v, %v; want reason %q", r.exit, r.err, runtime.ExitExited)
	}
	if r.exit.Code != 7 && r.exit.Code != -1 {
		t.Errorf("Wait code = %d, want 7 (or -1: unknown)", r.exit.Code)
	}
	t.Logf("init exit reported as %+v", r.exit)
}

// testWaitLifecycle: Wait on unknown and deleted ids returns at once; Kill, Delete and
// Checkpoint are reported as ExitKilled; a cancelled ctx ends Wait promptly.
func (s *suite) testWaitLifecycle(t *testing.T) {
	e := s.env(t)
	t.Run("unknown", func(t *testing.T) {
		r := await(t, e.waitAsync(ctx(t), newID()), time.Second, "Wait on an unknown id")
		if !errors.Is(r.err, errdefs.ErrNotFound) {
			t.Errorf("Wait(unknown) = %+v, %v; want ErrNotFound", r.exit, r.err)
		}
	})
	t.Run("cancel", func(t *testing.T) {
		sp := e.start()
		c, cancel := context.WithCancel(ctx(t))
		ch := e.waitAsync(c, sp.ID)
		time.Sleep(100 * time.Millisecond)
		cancel()
		r := await(t, ch, time.Second, "ctx cancellation")
		if !errors.Is(r.err, context.Canceled) {
			t.Errorf("Wait after cancel = %+v, %v; want context.Canceled", r.exit, r.err)
		}
		if got := e.state(sp.ID); got != runtime.StateRunning {
			t.Errorf("instance %s after a cancelled Wait", got)
		}
	})
	for _, op := range []string{"Kill", "Delete", "Checkpoint"} {
		t.Run(op, func(t *testing.T) {
			sp := e.start()
			ch := e.waitAsync(ctx(t), sp.ID)
			var err error
			switch op {
			case "Kill":
				err = e.d.Kill(ctx(t), sp.ID)
			case "Delete":
				err = e.d.Delete(ctx(t), sp.ID)
			case "Checkpoint":
				err = e.d.Checkpoint(ctx(t), sp.ID, t.TempDir(), runtime.CheckpointOptions{})
			}
			if err != nil {
				t.Fatalf("%s: %v", op, err)
			}
			r := await(t, ch, 5*time.Second, op)
			if r.err != nil || r.exit.Reason != runtime.ExitKilled {
				t.Errorf("Wait across %s = %+v, %v; want %q", op, r.exit, r.err, runtime.ExitKilled)
			}
			if op == "Delete" {
				r := await(t, e.waitAsync(ctx(t), sp.ID), time.Second, "Wait after Delete")
				if !errors.Is(r.err, errdefs.ErrNotFound) {
					t.Errorf("Wait after Delete = %+v, %v; want ErrNotFound at once", r.exit, r.err)
				}
			}
		})
	}
}

// testMemoryHog runs a process that allocates far past MemoryMB (256) at once, as
// `python3 -c "x=bytearray(8<<30)"` does. What a driver guarantees is one of: the process is
// killed and the sandbox lives on (what a VM's kernel does), or the whole instance stops and
// Wait reports ExitOOM promptly. It must not hang. gVisor does both, depending on which host
// process the kernel's OOM killer picks (see the gvisor package's tests).
func (s *suite) testMemoryHog(t *testing.T) {
	e := s.env(t)
	hogs := []struct{ name, script string }{
		{"one big buffer", "dd if=/dev/zero of=/dev/null bs=2000M count=1"},
		{"growing string", `awk 'BEGIN{s="a"; for(i=0;i<30;i++) s=s s; print length(s)}'`},
	}
	for _, h := range hogs {
		t.Run(h.name, func(t *testing.T) {
			sp := e.start()
			if st, err := e.d.Stats(ctx(t), sp.ID); err != nil {
				t.Fatalf("Stats: %v", err)
			} else if st.MemoryLimit == 0 {
				testutil.NotApplicable(t, "the driver does not enforce MemoryMB in this configuration (Stats.MemoryLimit is 0)")
			}
			wc := e.waitAsync(ctx(t), sp.ID)
			t0 := time.Now()
			type execResult struct {
				out  []byte
				code int
				err  error
			}
			ec := make(chan execResult, 1)
			go func() {
				out, code, err := e.d.Exec(ctx(t), sp.ID, []string{"/bin/sh", "-c", h.script})
				ec <- execResult{out, code, err}
			}()
			select {
			case r := <-wc:
				if r.err != nil || r.exit.Reason != runtime.ExitOOM {
					t.Fatalf("Wait = %+v, %v; want reason %q", r.exit, r.err, runtime.ExitOOM)
				}
				t.Logf("%s: the instance was stopped, Wait reported %q after %v", h.name, r.exit.Reason, r.at.Sub(t0))
			case r := <-ec:
				if r.err == nil && r.code == 0 {
					t.Fatalf("the hog succeeded within a 256 MiB limit: %q", r.out)
				}
				// Either the process was killed and the sandbox lives, or the instance is
				// stopping: then Wait must say out of memory.
				select {
				case w := <-wc:
					if w.exit.Reason != runtime.ExitOOM {
						t.Fatalf("Wait = %+v, %v; want %q", w.exit, w.err, runtime.ExitOOM)
					}
					t.Logf("%s: the instance was stopped, Wait reported %q after %v", h.name, w.exit.Reason, w.at.Sub(t0))
					return
				case <-time.After(2 * time.Second):
				}
				if got := e.sh(sp.ID, 0, "echo alive"); got != "alive\n" {
					t.Fatalf("after the hog: %q", got)
				}
				t.Logf("%s: the process was killed (exit %d, err %v) after %v; the sandbox lives on", h.name, r.code, r.err, time.Since(t0))
			case <-time.After(60 * time.Second):
				t.Fatalf("memory hog: neither the process nor the instance ended within 60 s")
			}
		})
	}
}

// testExportImport: Checkpoint, ExportImage, ImportImage into a new directory, Restore: files
// (a hard link, a symlink, a deleted lower file, an opaque directory, a 16 TiB sparse file) and
// memory (a running process) survive, and the sparse file's holes are not in the export. (That it
// stays sparse on the host is for the driver's own tests: the sandbox's st_blocks need not be the
// host's; gVisor reports size/512.)
func (s *suite) testExportImport(t *testing.T) {
	e := s.env(t)
	sp := e.start()
	pid := e.spawn(sp.ID, "exec sleep 1000")
	e.sh(sp.ID, 0, strings.Join([]string{
		"echo hl > /root/a && ln /root/a /root/b && ln -s /root/a /root/sym",
		"rm /bin/yes",
		"mkdir /etc2 && cp /etc/passwd /etc2/ && rm -rf /etc && mkdir /etc && cp /etc2/passwd /etc/ && echo new > /etc/only",
		"(truncate -s 16T /root/sparse || truncate -s 17592186040320 /root/sparse)",
		"echo tail | dd of=/root/sparse bs=1 seek=1099511627776 conv=notrunc 2>/dev/null",
	}, " && "))
	wantSize := e.sh(sp.ID, 0, "stat -c %s /root/sparse")
	t.Logf("sparse file before: %s", e.sh(sp.ID, 0, "stat -c 'size %s blocks %b' /root/sparse"))
	img := t.TempDir()
	if err := e.d.Checkpoint(ctx(t), sp.ID, img, runtime.CheckpointOptions{}); err != nil {
		t.Fatalf("Checkpoint: %v", err)
	}
	exp := t.TempDir()
	t0 := time.Now()
	if err := e.d.ExportImage(ctx(t), img, exp); err != nil {
		t.Fatalf("ExportImage: %v", err)
	}
	t.Logf("ExportImage: %v", time.Since(t0))
	var total int64
	ents, _ := os.ReadDir(exp)
	for _, de := range ents {
		fi, err := os.Lstat(filepath.Join(exp, de.Name()))
		if err != nil || !fi.Mode().IsRegular() {
			t.Fatalf("exported %s is not a regular file (%v)", de.Name(), err)
		}
		if fi.Mode().Perm()&0o077 != 0 {
			t.Errorf("exported %s has mode %v, want no access for group and others", de.Name(), fi.Mode())
		}
		total += fi.Size()
	}
	if total > 64<<20 {
		t.Errorf("exported image is %d bytes: holes were expanded", total)
	}
	imported := filepath.Join(t.TempDir(), "imported")
	t0 = time.Now()
	if err := e.d.ImportImage(ctx(t), exp, imported, runtime.ImportOptions{MaxBytes: 1 << 30}); err != nil {
		t.Fatalf("ImportImage: %v", err)
	}
	t.Logf("ImportImage: %v (exported %d bytes)", time.Since(t0), total)

	resumed := sp
	resumed.StateDir = filepath.Join(t.TempDir(), "resumed")
	resumed.ConsumeImage = true
	e.restore(resumed, imported)
	checks := []struct{ name, script, want string }{
		{"process", "cat /proc/" + pid + "/cmdline | tr '\\0' ' '", "sleep 1000 "},
		{"hard link", "cat /root/b; [ $(stat -c %i /root/a) = $(stat -c %i /root/b) ] && stat -c %h /root/a", "hl\n2\n"},
		{"symlink", "readlink /root/sym", "/root/a\n"},
		{"whiteout", "test -e /bin/yes && echo present || echo absent", "absent\n"},
		{"opaque dir", "ls /etc | tr '\\n' ' '", "only passwd "},
		{"sparse size", "stat -c %s /root/sparse", wantSize},
		{"sparse data", "dd if=/root/sparse bs=1 skip=1099511627776 count=4 2>/dev/null", "tail"},
	}
	t.Logf("sparse file after: %s", e.sh(sp.ID, 0, "stat -c 'size %s blocks %b' /root/sparse"))
	for _, c := range checks {
		if got := e.sh(sp.ID, 0, c.script); got != c.want {
			t.Errorf("%s after export/import/restore = %q, want %q", c.name, got, c.want)
		}
	}
}
