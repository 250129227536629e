package gvisor_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/runtime/drivertest"
	"github.com/ember-sandbox/ember/internal/runtime/gvisor"
)

// asNobody runs argv as uid/gid 65534 without groups and returns its output and error.
func asNobody(t *testing.T, argv ...string) (string, error) {
	t.Helper()
	setpriv, err := exec.LookPath("setpriv")
	if err != nil {
		t.Fatalf("setpriv (util-linux) is needed: %v", err)
	}
	// The program is started by an unprivileged shell: setpriv's own exec of it is not subject
	// to the directory permissions (measured).
	args := append([]string{"--reuid=65534", "--regid=65534", "--clear-groups", "--", "/bin/sh", "-c", `exec "$@"`, "sh"}, argv...)
	out, err := exec.Command(setpriv, args...).CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

// TestSetuidInLayerGivesHostNothing: root in a sandbox leaves a setuid-root copy of a program in
// its layer. It is there on the host, but a non-root host user can neither reach the instance's
// directory nor gain euid 0 through the overlay mount (nosuid), and the mount is nodev (gVisor
// refuses mknod of devices inside the sandbox anyway: checked too).
func TestSetuidInLayerGivesHostNothing(t *testing.T) {
	d := newDriver(t, nil)
	rootfs := drivertest.BusyboxRootFS(t)
	// A host program that prints its effective uid (coreutils id -u): it runs on the host, so it
	// shows what a host user would get from the setuid copy.
	idBin, err := exec.LookPath("id")
	if err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(idBin)
	must(t, err)
	must(t, os.WriteFile(filepath.Join(rootfs, "bin", "euid-probe"), data, 0o755))
	// A parent every user may traverse (t.TempDir is 0700 and would hide the problem).
	base, err := os.MkdirTemp("", "driver-setuid-")
	must(t, err)
	must(t, os.Chmod(base, 0o755))
	t.Cleanup(func() { os.RemoveAll(base) })
	sp := runtime.Spec{ID: "gv-setuid01", RootFS: rootfs, StateDir: filepath.Join(base, "sbx"), Args: []string{"/bin/sleep", "1000"}}
	ctx := context.Background()
	must(t, d.Start(ctx, sp))
	t.Cleanup(func() { _ = d.Delete(context.Background(), sp.ID) })
	out, code, err := d.Exec(ctx, sp.ID, []string{"sh", "-c", "cp /bin/euid-probe /x && chmod 4755 /x && ls -ln /x && ! mknod /nulldev c 1 3 2>/dev/null"})
	if err != nil || code != 0 {
		t.Fatalf("in the sandbox: %d %v: %s", code, err, out)
	}
	upperX := filepath.Join(sp.StateDir, "layer", "upper", "x")
	mergedX := filepath.Join(sp.StateDir, "rootfs", "x")
	var st unix.Stat_t
	must(t, unix.Lstat(upperX, &st))
	if st.Mode&unix.S_ISUID == 0 || st.Uid != 0 {
		t.Fatalf("the sandbox's setuid file on the host: mode %o uid %d; want setuid root (the premise)", st.Mode, st.Uid)
	}
	// The sandbox's kernel keeps the file open for writing (ETXTBSY on exec): stop the instance;
	// its layer and mount stay until Delete.
	must(t, d.Kill(ctx, sp.ID))
	if out, err := asNobody(t, "ls", sp.StateDir); err == nil {
		t.Errorf("a non-root user lists the state dir: %s", out)
	}
	for _, p := range []string{upperX, mergedX} {
		if out, err := asNobody(t, p, "-u"); err == nil && out == "0" {
			t.Errorf("a non-root user gained euid 0 through %s", p)
		}
	}
	var sfs unix.Statfs_t
	must(t, unix.Statfs(filepath.Join(sp.StateDir, "rootfs"), &sfs))
	if sfs.Flags&unix.ST_NOSUID == 0 || sfs.Flags&unix.ST_NODEV == 0 {
		t.Errorf("overlay mount flags %#x: want nosuid and nodev", sfs.Flags)
	}
	// nosuid on its own: open the directory up and run the copy through the mount.
	must(t, os.Chmod(sp.StateDir, 0o755))
	out2, err := asNobody(t, mergedX, "-u")
	must(t, os.Chmod(sp.StateDir, 0o700))
	if err != nil || out2 != "65534" {
		t.Errorf("through the nosuid mount the copy runs as %q (%v), want 65534", out2, err)
	}
	// Directories the driver made are private.
	for _, p := range []string{sp.StateDir, filepath.Join(sp.StateDir, "layer"), filepath.Join(sp.StateDir, "bundle"), filepath.Join(sp.StateDir, "logs")} {
		fi, err := os.Stat(p)
		must(t, err)
		if fi.Mode().Perm()&0o077 != 0 {
			t.Errorf("%s has mode %v, want 0700", p, fi.Mode())
		}
	}
}

// TestWaitAdopted: a second driver on the same runsc root (a restarted daemon) waits for an
// instance the first one started, and gets its exit status.
func TestWaitAdopted(t *testing.T) {
	root := filepath.Join(t.TempDir(), "runsc-root")
	d1 := newDriverRoot(t, root)
	rootfs := drivertest.BusyboxRootFS(t)
	ctx := context.Background()
	a := runtime.Spec{ID: "gv-adopt001", RootFS: rootfs, StateDir: t.TempDir(), Args: []string{"/bin/sh", "-c", "sleep 1; exit 5"}}
	b := runtime.Spec{ID: "gv-adopt002", RootFS: rootfs, StateDir: t.TempDir(), Args: []string{"/bin/sleep", "1000"}}
	for _, sp := range []runtime.Spec{a, b} {
		must(t, d1.Start(ctx, sp))
		t.Cleanup(func() { _ = d1.Delete(context.Background(), sp.ID) })
	}
	d2 := newDriverRoot(t, root) // the restarted daemon
	ea, err := d2.Wait(ctx, a.ID)
	if err != nil || ea.Reason != runtime.ExitExited || ea.Code != 5 {
		t.Errorf("adopted Wait(init exits 5) = %+v, %v", ea, err)
	}
	st, err := d2.State(ctx, b.ID)
	must(t, err)
	ch := make(chan runtime.Exit, 1)
	go func() { e, _ := d2.Wait(ctx, b.ID); ch <- e }()
	time.Sleep(100 * time.Millisecond)
	killed := time.Now()
	must(t, syscall.Kill(st.Pid, syscall.SIGKILL))
	select {
	case e := <-ch:
		if e.Reason != runtime.ExitKilled {
			t.Errorf("adopted Wait after kill -9 = %+v", e)
		}
		t.Logf("adopted Wait latency after kill -9: %v", time.Since(killed))
	case <-time.After(2 * time.Second):
		t.Fatal("adopted Wait did not return within 2 s of kill -9")
	}
}

func newDriverRoot(t *testing.T, root string) runtime.Driver {
	t.Helper()
	return newDriver(t, func(c *gvisor.Config) { c.Root = root })
}

// TestRestoreRefusesSymlinkedUpper: an image whose layer/upper is a symlink to a host directory
// (issue 8 finding 1: a tampered snapshot unpacked by an older loader) is refused by Restore,
// whether its layer is moved (resume) or cloned (fork), and the host directory is untouched.
func TestRestoreRefusesSymlinkedUpper(t *testing.T) {
	d := newDriver(t, nil)
	rootfs := drivertest.BusyboxRootFS(t)
	for i, consume := range []bool{false, true} {
		t.Run(fmt.Sprintf("consume=%v", consume), func(t *testing.T) {
			base := t.TempDir()
			sentinel := filepath.Join(base, "sentinel")
			must(t, os.Mkdir(sentinel, 0o755))
			must(t, os.WriteFile(filepath.Join(sentinel, "keep"), []byte("keep"), 0o644))
			before := treeOf(t, sentinel)
			img := filepath.Join(base, "img")
			must(t, os.MkdirAll(filepath.Join(img, "layer"), 0o700))
			must(t, os.WriteFile(filepath.Join(img, "checkpoint.img"), []byte("x"), 0o600))
			must(t, os.Symlink(sentinel, filepath.Join(img, "layer", "upper")))
			sp := runtime.Spec{ID: fmt.Sprintf("gv-symup%03d", i), RootFS: rootfs, StateDir: filepath.Join(base, "sbx"),
				Args: []string{"/bin/sleep", "1000"}, ConsumeImage: consume}
			err := d.Restore(context.Background(), sp, img)
			if err == nil {
				_ = d.Delete(context.Background(), sp.ID)
				t.Fatal("Restore accepted an image whose layer/upper is a symlink")
			}
			t.Logf("refused: %v", err)
			if got := treeOf(t, sentinel); strings.Join(got, "\n") != strings.Join(before, "\n") {
				t.Errorf("the host directory changed: %v", got)
			}
			var sfs unix.Statfs_t
			if unix.Statfs(filepath.Join(sp.StateDir, "rootfs"), &sfs) == nil && sfs.Type == unix.OVERLAYFS_SUPER_MAGIC {
				t.Errorf("an overlay is mounted on %s", filepath.Join(sp.StateDir, "rootfs"))
			}
		})
	}
}
