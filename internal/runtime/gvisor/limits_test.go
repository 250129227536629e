package gvisor_test

import (
	"context"
	"errors"
	"github.com/ember-sandbox/ember/internal/testutil"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/runtime/drivertest"
	"github.com/ember-sandbox/ember/internal/runtime/gvisor"
)

// mustExec runs a shell command in the instance and wants exit 0.
func mustExec(t *testing.T, d *gvisor.Driver, id, script string) string {
	t.Helper()
	out, code, err := d.Exec(context.Background(), id, []string{"sh", "-c", script})
	if err != nil || code != 0 {
		t.Fatalf("exec %q: code %d, %v: %s", script, code, err, out)
	}
	return string(out)
}

func startInstance(t *testing.T, d *gvisor.Driver, sp runtime.Spec) {
	t.Helper()
	if err := d.Start(context.Background(), sp); err != nil {
		t.Fatalf("Start %s: %v", sp.ID, err)
	}
	t.Cleanup(func() { _ = d.Delete(context.Background(), sp.ID) })
}

// loopDevices counts the loop devices bound to files under dir (other tests on the host may
// use loop devices of their own).
func loopDevices(dir string) int {
	n := 0
	ents, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, e := range ents {
		b, _ := os.ReadFile(e)
		if strings.HasPrefix(strings.TrimSpace(string(b)), dir+"/") {
			n++
		}
	}
	return n
}

// waitLoopDevices waits until loopDevices(dir) == want (autoclear detaches a device shortly
// after its last unmount) and reports the count seen last.
func waitLoopDevices(dir string, want int) int {
	deadline := time.Now().Add(3 * time.Second)
	for {
		n := loopDevices(dir)
		if n == want || time.Now().After(deadline) {
			return n
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestDiskLimit: with DiskMB=64 a write past the limit fails inside with ENOSPC, the sandbox
// keeps running, host files are untouched, and the limited layer survives pause (checkpoint +
// consuming restore) and fork (leave-running checkpoint + restore into a clone).
func TestDiskLimit(t *testing.T) {
	d := newDriver(t, nil)
	rootfs := drivertest.BusyboxRootFS(t)
	args := []string{"/bin/sleep", "100000"}
	hostDir := t.TempDir()
	sentinel := filepath.Join(hostDir, "sentinel")
	if err := os.WriteFile(sentinel, []byte("host"), 0o600); err != nil {
		t.Fatal(err)
	}
	sp := runtime.Spec{ID: "gv-disklim1", RootFS: rootfs, StateDir: t.TempDir(), Args: args, DiskMB: 64, MemoryMB: 512}
	t0 := time.Now()
	startInstance(t, d, sp)
	t.Logf("start with DiskMB=64: %v", time.Since(t0))

	out, code, err := d.Exec(context.Background(), sp.ID, []string{"sh", "-c", "dd if=/dev/zero of=/big bs=1M count=200"})
	if err != nil {
		t.Fatal(err)
	}
	if code == 0 || !strings.Contains(string(out), "No space left on device") {
		t.Fatalf("dd of 200 MiB into a 64 MiB layer: exit %d, %q; want ENOSPC", code, out)
	}
	size := mustExec(t, d, sp.ID, "stat -c %s /big; df -m / | tail -1")
	t.Logf("after dd: /big and df /: %q", size)
	if got := mustExec(t, d, sp.ID, "echo alive > /alive && cat /alive"); got != "alive\n" {
		t.Fatalf("sandbox unusable after ENOSPC: %q", got)
	}
	if b, err := os.ReadFile(sentinel); err != nil || string(b) != "host" {
		t.Fatalf("host file changed: %q, %v", b, err)
	}
	if _, err := os.Stat(filepath.Join(rootfs, "big")); err == nil {
		t.Fatal("the write reached the template rootfs")
	}
	// Host disk: the sparse image holds at most DiskMB.
	var st unix.Stat_t
	if err := unix.Stat(filepath.Join(sp.StateDir, "layer", ".disk.img"), &st); err == nil {
		t.Error("the image is reachable at layer/.disk.img while mounted (want it under the mount)")
	}
	tmp := filepath.Dir(sp.StateDir) // every t.TempDir of this test
	if n := loopDevices(tmp); n != 1 {
		t.Errorf("loop devices of one limited instance: %d, want 1", n)
	}

	// The formatted-image cache lives in runsc's root: runsc must still list instances.
	if ids, err := d.List(context.Background()); err != nil || len(ids) != 1 || ids[0] != sp.ID {
		t.Fatalf("List = %v, %v", ids, err)
	}

	// Fork: leave-running checkpoint, restore into a clone; the child has the parent's files and
	// its own limit.
	ctx := context.Background()
	img := t.TempDir()
	t0 = time.Now()
	if err := d.Checkpoint(ctx, sp.ID, img, runtime.CheckpointOptions{LeaveRunning: true}); err != nil {
		t.Fatal(err)
	}
	t.Logf("leave-running checkpoint (image clone of a full 64 MiB layer): %v", time.Since(t0))
	// The child asks for more: its copy of the image grows to 128 MiB.
	child := runtime.Spec{ID: "gv-disklim2", RootFS: rootfs, StateDir: t.TempDir(), Args: args, DiskMB: 128, MemoryMB: 512}
	t0 = time.Now()
	if err := d.Restore(ctx, child, img); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Delete(context.Background(), child.ID) })
	t.Logf("fork restore: %v", time.Since(t0))
	if got := mustExec(t, d, child.ID, "cat /alive"); got != "alive\n" {
		t.Fatalf("child lacks the parent's file: %q", got)
	}
	if got := mustExec(t, d, child.ID, "df -m / | tail -1 | awk '{print $2}'"); got < "100" || len(got) != 4 {
		t.Errorf("child's filesystem: %q MiB, want about 120 (grown to 128)", got)
	}
	mustExec(t, d, child.ID, "rm /big && dd if=/dev/zero of=/c bs=1M count=20 2>/dev/null")
	if _, code, err := d.Exec(ctx, sp.ID, []string{"test", "-f", "/big"}); err != nil || code != 0 {
		t.Fatalf("the child's rm reached the parent: %d %v", code, err)
	}
	if out, code, _ := d.Exec(ctx, child.ID, []string{"sh", "-c", "dd if=/dev/zero of=/d bs=1M count=150"}); code == 0 || !strings.Contains(string(out), "No space left") {
		t.Errorf("child: write past its limit: exit %d %q", code, out)
	}

	// Pause: checkpoint (the layer moves into the image) and resume consuming it.
	pimg := t.TempDir()
	t0 = time.Now()
	if err := d.Checkpoint(ctx, sp.ID, pimg, runtime.CheckpointOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Logf("pause checkpoint: %v", time.Since(t0))
	if _, err := os.Stat(filepath.Join(pimg, "layer", ".disk.img")); err != nil {
		t.Fatalf("paused image has no disk image: %v", err)
	}
	resumed := sp
	resumed.ConsumeImage = true
	resumed.StateDir = t.TempDir()
	t0 = time.Now()
	if err := d.Restore(ctx, resumed, pimg); err != nil {
		t.Fatal(err)
	}
	t.Logf("resume restore: %v", time.Since(t0))
	if got := mustExec(t, d, sp.ID, "cat /alive; test -f /big && echo big"); got != "alive\nbig\n" {
		t.Fatalf("resumed sandbox lost files: %q", got)
	}
	if out, code, _ := d.Exec(ctx, sp.ID, []string{"sh", "-c", "dd if=/dev/zero of=/more bs=1M count=10"}); code == 0 || !strings.Contains(string(out), "No space left") {
		t.Errorf("resumed: write past the limit: exit %d %q", code, out)
	}
	for _, id := range []string{sp.ID, child.ID} {
		if err := d.Delete(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	if n := waitLoopDevices(tmp, 0); n != 0 {
		t.Errorf("loop devices left after Delete: %d", n)
	}
}

// TestDiskUnlimited: DiskMB=0 keeps a plain layer (no image, no loop device).
func TestDiskUnlimited(t *testing.T) {
	d := newDriver(t, nil)
	sp := runtime.Spec{ID: "gv-diskunl1", RootFS: drivertest.BusyboxRootFS(t), StateDir: t.TempDir(), Args: []string{"/bin/sleep", "1000"}}
	startInstance(t, d, sp)
	if _, err := os.Stat(filepath.Join(sp.StateDir, "layer", ".disk.img")); err == nil {
		t.Error("DiskMB=0 made a disk image")
	}
	mustExec(t, d, sp.ID, "dd if=/dev/zero of=/f bs=1M count=80 2>/dev/null")
}

// cgroupInt reads a number from one of the instance's cgroup files (a "key value" file when
// key is set).
func cgroupInt(t *testing.T, d *gvisor.Driver, id, file, key string) int64 {
	t.Helper()
	p := gvisor.InstanceCgroupFile(d, id, file)
	if p == "" {
		t.Fatalf("no cgroup file %s for %s", file, id)
	}
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	s := strings.TrimSpace(string(b))
	if key != "" {
		for _, l := range strings.Split(s, "\n") {
			if f := strings.Fields(l); len(f) == 2 && f[0] == key {
				s = f[1]
			}
		}
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		t.Fatalf("%s: %q: %v", p, s, err)
	}
	return n
}

// TestMemoryLimitStopsSandbox pins what going past the host limit (MemoryMB + headroom) does
// with gVisor at this version when nothing in the guest acts first (no envd's guard here): the
// Sentry has no OOM killer and dies with any of its stub processes, so the host memcg OOM
// killer stops the whole sandbox, promptly (the bound: within 2 s), and counts it in
// memory.oom_control. The allocation is a single 1000 MiB buffer, committed by read(), past
// 256 MiB + 384 MiB of headroom.
func TestMemoryLimitStopsSandbox(t *testing.T) {
	d := newDriver(t, nil)
	sp := runtime.Spec{ID: "gv-memoom01", RootFS: drivertest.BusyboxRootFS(t), StateDir: t.TempDir(), Args: []string{"/bin/sleep", "1000"}, MemoryMB: 256}
	startInstance(t, d, sp)
	if sw := gvisor.InstanceCgroupFile(d, sp.ID, "memory.memsw.limit_in_bytes"); sw != "" {
		if n, l := cgroupInt(t, d, sp.ID, "memory.memsw.limit_in_bytes", ""), cgroupInt(t, d, sp.ID, "memory.limit_in_bytes", ""); n != l || n != gvisor.HostMemoryLimit(256<<20) {
			t.Errorf("memory+swap limit %d, memory limit %d, want both %d (256 MiB + headroom, no swapping past the limit)", n, l, gvisor.HostMemoryLimit(256<<20))
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	t0 := time.Now()
	_, _, err := d.Exec(ctx, sp.ID, []string{"sh", "-c", "dd if=/dev/zero of=/dev/null bs=1000M count=1"})
	returned := time.Since(t0)
	if ctx.Err() != nil {
		t.Fatalf("the allocating exec hung: %v", err)
	}
	testutil.Eventually(t, 2*time.Second, "the sandbox stops after its over-limit exec returned", func() bool {
		st, err := d.State(context.Background(), sp.ID)
		if err != nil {
			t.Fatal(err)
		}
		return st.State == runtime.StateStopped
	})
	t.Logf("MemoryMB=256, 1000 MiB allocated: exec returned after %v, sandbox stopped after %v", returned, time.Since(t0))
	if n := cgroupInt(t, d, sp.ID, "memory.oom_control", "oom_kill"); n < 1 {
		t.Errorf("memory.oom_control oom_kill = %d, want >= 1 (how Wait tells out of memory)", n)
	}
	if r, detail, ok := gvisor.LimitExitForTest(d, sp.ID); !ok || r != runtime.ExitOOM {
		t.Errorf("limitExit = %q %q %v, want out of memory", r, detail, ok)
	}
}

// TestPidsLimit: a fork bomb (as an unprivileged uid) is held at the per-uid task bound inside
// the sandbox, the host stays responsive, and once the bomb is killed new commands work.
func TestPidsLimit(t *testing.T) {
	defer gvisor.SetTasksPerUIDForTest(64)()
	d := newDriver(t, nil)
	sp := runtime.Spec{ID: "gv-pidslim1", RootFS: drivertest.BusyboxRootFS(t), StateDir: t.TempDir(), Args: []string{"/bin/sleep", "100000"}, CPUCount: 1, MemoryMB: 512, PidsLimit: 64}
	startInstance(t, d, sp)
	if n := cgroupInt(t, d, sp.ID, "pids.max", ""); n != 64*2+128 {
		t.Errorf("host pids.max = %d, want %d", n, 64*2+128)
	}
	// The bomb runs detached so the exec returns; it forks until the bound, forever.
	mustExec(t, d, sp.ID, `su -s /bin/sh nobody -c 'f(){ f | f & }; f' >/dev/null 2>&1 </dev/null &`)
	time.Sleep(3 * time.Second)
	// Host responsiveness: a host process start while the bomb runs.
	t0 := time.Now()
	if err := exec.Command("/bin/true").Run(); err != nil {
		t.Fatal(err)
	}
	hostLat := time.Since(t0)
	count := mustExec(t, d, sp.ID, "ps -o user | grep -c nobody || true")
	hostTasks := cgroupInt(t, d, sp.ID, "pids.current", "")
	t.Logf("fork bomb after 3 s: %s nobody tasks (bound 64), host tasks %d, host /bin/true %v", strings.TrimSpace(count), hostTasks, hostLat)
	// +1: the su process became nobody by setuid, after it was counted as root's.
	if n, _ := strconv.Atoi(strings.TrimSpace(count)); n > 64+1 {
		t.Errorf("%d tasks of the bomb's uid, bound 64", n)
	}
	if st, _ := d.State(context.Background(), sp.ID); st.State != runtime.StateRunning {
		t.Fatalf("sandbox stopped by the fork bomb")
	}
	// Kill the bomb from inside (as its uid: kill -1 reaches every process of that uid).
	for i := 0; i < 20; i++ {
		_, _, _ = d.Exec(context.Background(), sp.ID, []string{"su", "-s", "/bin/sh", "nobody", "-c", "kill -9 -1"})
		out, _, _ := d.Exec(context.Background(), sp.ID, []string{"sh", "-c", "ps -o user | grep -c nobody || true"})
		if strings.TrimSpace(string(out)) == "0" {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if got := mustExec(t, d, sp.ID, "echo ok"); got != "ok\n" {
		t.Fatalf("after the bomb: %q", got)
	}
}

// TestPidsHostBackstop: past the host pids bound (from a small PidsLimit) the sandbox is
// stopped, and pids.events says why.
func TestPidsHostBackstop(t *testing.T) {
	d := newDriver(t, nil)
	sp := runtime.Spec{ID: "gv-pidslim2", RootFS: drivertest.BusyboxRootFS(t), StateDir: t.TempDir(), Args: []string{"/bin/sleep", "100000"}, PidsLimit: 16}
	startInstance(t, d, sp)
	_, _, _ = d.Exec(context.Background(), sp.ID, []string{"sh", "-c", "for i in $(seq 1 120); do sleep 1000 & done; wait"})
	testutil.Eventually(t, 10*time.Second, "the sandbox with 120 tasks over a host bound of 160 host tasks stops", func() bool {
		st, err := d.State(context.Background(), sp.ID)
		if err != nil {
			t.Fatal(err)
		}
		return st.State == runtime.StateStopped
	})
	if n := cgroupInt(t, d, sp.ID, "pids.events", "max"); n < 1 {
		t.Errorf("pids.events max = %d, want >= 1", n)
	}
	if r, detail, ok := gvisor.LimitExitForTest(d, sp.ID); !ok || r != runtime.ExitKilled {
		t.Errorf("limitExit = %q %q %v, want killed by the task limit", r, detail, ok)
	} else {
		t.Logf("stopped: %s (%s)", r, detail)
	}
}

// TestCPULimit: two busy loops in a 1-vCPU sandbox get about one core of this host; with 2
// vCPUs about two (on a 2-core host shared with others: logged, only a loose bound asserted).
func TestCPULimit(t *testing.T) {
	testutil.SkipShort(t, "loads the host for 2 x 3 s")
	d := newDriver(t, nil)
	rootfs := drivertest.BusyboxRootFS(t)
	for _, cpus := range []int{1, 2} {
		sp := runtime.Spec{ID: "gv-cpulim0" + strconv.Itoa(cpus), RootFS: rootfs, StateDir: t.TempDir(), Args: []string{"/bin/sleep", "100000"}, CPUCount: cpus}
		startInstance(t, d, sp)
		mustExec(t, d, sp.ID, "(while :; do :; done) >/dev/null 2>&1 </dev/null & (while :; do :; done) >/dev/null 2>&1 </dev/null &")
		time.Sleep(500 * time.Millisecond)
		u0, t0 := cgroupInt(t, d, sp.ID, "cpuacct.usage", ""), time.Now()
		th0 := cgroupInt(t, d, sp.ID, "cpu.stat", "throttled_time")
		quota := cgroupInt(t, d, sp.ID, "cpu.cfs_quota_us", "")
		time.Sleep(3 * time.Second)
		u1, el := cgroupInt(t, d, sp.ID, "cpuacct.usage", ""), time.Since(t0)
		th1 := cgroupInt(t, d, sp.ID, "cpu.stat", "throttled_time")
		cores := float64(u1-u0) / float64(el.Nanoseconds())
		t.Logf("CPUCount=%d (cfs_quota_us %d), 2 busy loops: %.2f cores over %v, throttled %v (host: %d CPUs, loadavg %s)",
			cpus, quota, cores, el.Round(time.Millisecond), time.Duration(th1-th0).Round(time.Millisecond), hostCPUs(), loadavg())
		if cpus == 1 && cores > 1.5 {
			t.Errorf("1-vCPU sandbox used %.2f cores", cores)
		}
		if err := d.Delete(context.Background(), sp.ID); err != nil {
			t.Fatal(err)
		}
	}
}

func hostCPUs() int {
	var set unix.CPUSet
	if unix.SchedGetaffinity(0, &set) != nil {
		return 0
	}
	return set.Count()
}

func loadavg() string {
	b, _ := os.ReadFile("/proc/loadavg")
	f := strings.Fields(string(b))
	if len(f) < 1 {
		return "?"
	}
	return f[0]
}

// TestDiskLimitCosts logs what a disk limit adds to start, pause (checkpoint that moves the
// layer), resume (consuming restore) and fork (leave-running checkpoint + restore of a clone),
// with 64 MiB written to the layer, against an unlimited layer. Medians of 3; no assertions.
func TestDiskLimitCosts(t *testing.T) {
	testutil.SkipShort(t, "measurement")
	d := newDriver(t, nil)
	rootfs := drivertest.BusyboxRootFS(t)
	args := []string{"/bin/sleep", "100000"}
	ctx := context.Background()
	for _, diskMB := range []int{0, 10240} {
		var start, pause, resume, fork []time.Duration
		for i := 0; i < 3; i++ {
			id := "gv-dcost" + strconv.Itoa(min(diskMB, 1)) + strconv.Itoa(i)
			sp := runtime.Spec{ID: id, RootFS: rootfs, StateDir: t.TempDir(), Args: args, DiskMB: diskMB}
			t0 := time.Now()
			startInstance(t, d, sp)
			start = append(start, time.Since(t0))
			mustExec(t, d, id, "dd if=/dev/urandom of=/data bs=1M count=64 2>/dev/null")
			img := t.TempDir()
			t0 = time.Now()
			if err := d.Checkpoint(ctx, id, img, runtime.CheckpointOptions{LeaveRunning: true}); err != nil {
				t.Fatal(err)
			}
			child := runtime.Spec{ID: id + "c", RootFS: rootfs, StateDir: t.TempDir(), Args: args, DiskMB: diskMB}
			if err := d.Restore(ctx, child, img); err != nil {
				t.Fatal(err)
			}
			fork = append(fork, time.Since(t0))
			_ = d.Delete(ctx, child.ID)
			pimg := t.TempDir()
			t0 = time.Now()
			if err := d.Checkpoint(ctx, id, pimg, runtime.CheckpointOptions{}); err != nil {
				t.Fatal(err)
			}
			pause = append(pause, time.Since(t0))
			sp.ConsumeImage = true
			sp.StateDir = t.TempDir()
			t0 = time.Now()
			if err := d.Restore(ctx, sp, pimg); err != nil {
				t.Fatal(err)
			}
			resume = append(resume, time.Since(t0))
			_ = d.Delete(ctx, id)
		}
		t.Logf("DiskMB=%d, 64 MiB written: start %v, pause %v, resume %v, fork (checkpoint+clone+restore) %v",
			diskMB, median(start), median(pause), median(resume), median(fork))
	}
}

func median(ds []time.Duration) time.Duration {
	s := append([]time.Duration(nil), ds...)
	for i := range s {
		for j := i + 1; j < len(s); j++ {
			if s[j] < s[i] {
				s[i], s[j] = s[j], s[i]
			}
		}
	}
	return s[len(s)/2].Round(time.Millisecond)
}

// TestDiskLimitOnUnlimitedImage: an image taken without a limit restores into a limited layer
// (its files, whiteouts included, are copied into the new image); one that holds more than the
// limit is refused with ErrInvalid.
func TestDiskLimitOnUnlimitedImage(t *testing.T) {
	d := newDriver(t, nil)
	rootfs := drivertest.BusyboxRootFS(t)
	args := []string{"/bin/sleep", "100000"}
	ctx := context.Background()
	sp := runtime.Spec{ID: "gv-diskcnv1", RootFS: rootfs, StateDir: t.TempDir(), Args: args}
	startInstance(t, d, sp)
	mustExec(t, d, sp.ID, "dd if=/dev/zero of=/f bs=1M count=40 2>/dev/null && rm /etc/hostname")
	img := t.TempDir()
	if err := d.Checkpoint(ctx, sp.ID, img, runtime.CheckpointOptions{LeaveRunning: true}); err != nil {
		t.Fatal(err)
	}
	child := runtime.Spec{ID: "gv-diskcnv2", RootFS: rootfs, StateDir: t.TempDir(), Args: args, DiskMB: 64}
	if err := d.Restore(ctx, child, img); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Delete(context.Background(), child.ID) })
	if got := mustExec(t, d, child.ID, "stat -c %s /f; test -e /etc/hostname || echo gone"); got != "41943040\ngone\n" {
		t.Fatalf("converted layer: %q", got)
	}
	if out, code, _ := d.Exec(ctx, child.ID, []string{"sh", "-c", "dd if=/dev/zero of=/g bs=1M count=40"}); code == 0 || !strings.Contains(string(out), "No space left") {
		t.Errorf("converted layer: write past the limit: exit %d %q", code, out)
	}
	small := runtime.Spec{ID: "gv-diskcnv3", RootFS: rootfs, StateDir: t.TempDir(), Args: args, DiskMB: 32}
	if err := d.Restore(ctx, small, img); !errors.Is(err, errdefs.ErrInvalid) {
		_ = d.Delete(ctx, small.ID)
		t.Fatalf("restore of a 40 MiB layer into DiskMB=32: %v, want ErrInvalid", err)
	}
}

// TestDiskLimitParallel restores one limited image into 8 instances at once (fork): each gets a
// loop device and a filesystem of its own.
func TestDiskLimitParallel(t *testing.T) {
	d := newDriver(t, nil)
	rootfs := drivertest.BusyboxRootFS(t)
	args := []string{"/bin/sleep", "100000"}
	ctx := context.Background()
	sp := runtime.Spec{ID: "gv-diskpar00", RootFS: rootfs, StateDir: t.TempDir(), Args: args, DiskMB: 64}
	startInstance(t, d, sp)
	mustExec(t, d, sp.ID, "echo parent > /p")
	img := t.TempDir()
	if err := d.Checkpoint(ctx, sp.ID, img, runtime.CheckpointOptions{LeaveRunning: true}); err != nil {
		t.Fatal(err)
	}
	const n = 8
	errs := make(chan error, n)
	t0 := time.Now()
	for i := 1; i <= n; i++ {
		c := runtime.Spec{ID: "gv-diskpar0" + strconv.Itoa(i), RootFS: rootfs, StateDir: t.TempDir(), Args: args, DiskMB: 64}
		t.Cleanup(func() { _ = d.Delete(context.Background(), c.ID) })
		go func() { errs <- d.Restore(ctx, c, img) }()
	}
	for i := 0; i < n; i++ {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
	t.Logf("%d limited children restored at once: %v", n, time.Since(t0))
	for i := 1; i <= n; i++ {
		id := "gv-diskpar0" + strconv.Itoa(i)
		if got := mustExec(t, d, id, "cat /p; echo "+id+" > /me; cat /me"); got != "parent\n"+id+"\n" {
			t.Errorf("%s: %q", id, got)
		}
	}
	if got := loopDevices(filepath.Dir(sp.StateDir)); got != n+1 {
		t.Errorf("loop devices: %d, want %d", got, n+1)
	}
}
