package gvisor_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/runtime/drivertest"
	"github.com/ember-sandbox/ember/internal/runtime/gvisor"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// layerBackend is a filesystem the sandbox layers live on, and the clone method it must give.
type layerBackend struct {
	name   string
	mkfs   string // "" for the test's temp dir (the host filesystem)
	method string // expected CloneUpper method; "" accepts copy or reflink (host fs varies)
}

var layerBackends = []layerBackend{
	{name: "hostfs"},
	{name: "xfs", mkfs: "xfs", method: gvisor.CloneReflink},
	{name: "btrfs", mkfs: "btrfs", method: gvisor.CloneBtrfsSnapshot},
}

// backendDir returns an empty directory on the backend's filesystem: the test's temp dir, or a
// loop-mounted filesystem made for the test. xfs and btrfs are optional backends: without their
// mkfs tools (xfsprogs, btrfs-progs) the subtest is skipped.
func backendDir(t *testing.T, b layerBackend) string {
	t.Helper()
	if b.mkfs == "" {
		return t.TempDir()
	}
	mkfs, err := exec.LookPath("mkfs." + b.mkfs)
	testutil.Need(t, err == nil, "backend "+b.name+": mkfs."+b.mkfs+" not installed (make setup installs it)")
	dir := t.TempDir()
	img := filepath.Join(dir, "fs.img")
	mnt := filepath.Join(dir, "mnt")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	err = f.Truncate(1 << 30) // sparse
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	args := []string{"-q", img}
	if b.mkfs == "xfs" {
		args = []string{"-q", "-m", "reflink=1", img}
	}
	if out, err := exec.Command(mkfs, args...).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.%s: %v: %s", b.mkfs, err, out)
	}
	if out, err := exec.Command("mount", "-o", "loop", img, mnt).CombinedOutput(); err != nil {
		t.Fatalf("mount %s: %v: %s", b.name, err, out)
	}
	t.Cleanup(func() { _ = unix.Unmount(mnt, unix.MNT_DETACH) })
	return mnt
}

// prepare calls PrepareRootFS and unmounts at the end of the test.
func prepare(t *testing.T, lower, dir string) string {
	t.Helper()
	merged, cleanup, err := gvisor.PrepareRootFS([]string{lower}, dir)
	if err != nil {
		t.Fatalf("PrepareRootFS: %v", err)
	}
	t.Cleanup(func() {
		if err := cleanup(); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
	return merged
}

func readString(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// A clone carries the parent's files and deletions (overlayfs whiteouts), the lower layer is
// never written, and parent and clone diverge afterwards.
func TestCloneUpper(t *testing.T) {
	testutil.RequireRoot(t)
	for _, b := range layerBackends {
		t.Run(b.name, func(t *testing.T) {
			lower := t.TempDir()
			if err := os.WriteFile(filepath.Join(lower, "template"), []byte("tmpl"), 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(lower, "gone"), []byte("x"), 0o644); err != nil {
				t.Fatal(err)
			}
			base := backendDir(t, b)
			parentDir, childDir := filepath.Join(base, "parent"), filepath.Join(base, "child")
			pm := prepare(t, lower, parentDir)
			if err := os.WriteFile(filepath.Join(pm, "hello"), []byte("parent"), 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.Remove(filepath.Join(pm, "gone")); err != nil {
				t.Fatal(err)
			}

			method, err := gvisor.CloneUpper(parentDir, childDir)
			if err != nil {
				t.Fatalf("CloneUpper: %v", err)
			}
			if b.method != "" && method != b.method {
				t.Errorf("method = %q, want %q", method, b.method)
			}
			if _, err := gvisor.CloneUpper(parentDir, childDir); err == nil {
				t.Error("second CloneUpper into the same dir: no error")
			}
			cm := prepare(t, lower, childDir)
			if got := readString(t, filepath.Join(cm, "hello")); got != "parent" {
				t.Errorf("child hello = %q, want parent", got)
			}
			if _, err := os.Stat(filepath.Join(cm, "gone")); !os.IsNotExist(err) {
				t.Errorf("child sees the file the parent deleted: %v", err)
			}
			if got := readString(t, filepath.Join(cm, "template")); got != "tmpl" {
				t.Errorf("child template = %q", got)
			}

			if err := os.WriteFile(filepath.Join(cm, "hello"), []byte("child"), 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(pm, "template"), []byte("parent-edit"), 0o644); err != nil {
				t.Fatal(err)
			}
			if got := readString(t, filepath.Join(pm, "hello")); got != "parent" {
				t.Errorf("parent hello = %q after the child wrote", got)
			}
			if got := readString(t, filepath.Join(cm, "template")); got != "tmpl" {
				t.Errorf("child template = %q after the parent wrote", got)
			}
			if got := readString(t, filepath.Join(lower, "template")); got != "tmpl" {
				t.Errorf("lower written: %q", got)
			}
			if _, err := os.Stat(filepath.Join(lower, "gone")); err != nil {
				t.Errorf("lower file removed: %v", err)
			}
		})
	}
}

// Fork with host-file layers: a sandbox run with --overlay2=none on PrepareRootFS is paused,
// checkpointed and its layer cloned; a child restored from the image onto the clone (a different
// rootfs path) sees the parent's files, and afterwards their writes diverge.
func TestForkOnClonedUpper(t *testing.T) {
	for _, b := range layerBackends {
		t.Run(b.name, func(t *testing.T) { forkOnClonedUpper(t, b, 0) })
	}
}

// The same with a disk-limited layer (an ext4 image): where the image can be reflinked (xfs,
// btrfs) the paused parent's layer is synced and its image cloned without a freeze, and the
// clone's journal replayed; the child must see every file the parent wrote.
func TestForkOnClonedDiskLayer(t *testing.T) {
	for _, b := range layerBackends {
		t.Run(b.name, func(t *testing.T) { forkOnClonedUpper(t, b, 64) })
	}
}

func forkOnClonedUpper(t *testing.T, b layerBackend, diskMB int) {
	d := newDriver(t, func(c *gvisor.Config) {
		c.Overlay = gvisor.OverlayHost
		c.IgnoreCgroups = true
		c.ExtraFlags = []string{"--network=none"}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	lower := drivertest.BusyboxRootFS(t)
	base := backendDir(t, b)
	parentDir, childDir := filepath.Join(base, "parent"), filepath.Join(base, "child")

	start := func(id, dir string, restoreFrom string) {
		t.Helper()
		spec := runtime.Spec{ID: id, RootFS: lower, StateDir: dir, Args: []string{"/bin/sleep", "1000000"}, DiskMB: diskMB}
		var err error
		if restoreFrom == "" {
			err = d.Start(ctx, spec)
		} else {
			err = d.Restore(ctx, spec, restoreFrom)
		}
		if err != nil {
			t.Fatalf("start %s: %v", id, err)
		}
		t.Cleanup(func() { _ = d.Delete(context.Background(), id) })
	}
	sh := func(id, script string) string {
		t.Helper()
		out, code, err := d.Exec(ctx, id, []string{"/bin/sh", "-c", script})
		if err != nil || code != 0 {
			t.Fatalf("exec %s %q: code %d, err %v: %s", id, script, code, err, out)
		}
		return strings.TrimSpace(string(out))
	}
	const parent, child = "fsdp0001", "fsdc0001"
	start(parent, parentDir, "")
	sh(parent, "echo parent > /hello; head -c 1048576 /dev/urandom > /blob; rm /etc/passwd")

	// On the layers' filesystem, so the layer clone can share extents.
	img := filepath.Join(base, "img")
	if err := os.Mkdir(img, 0o755); err != nil {
		t.Fatal(err)
	}
	// The driver pauses the parent across checkpoint and layer clone, then resumes it.
	if err := d.Checkpoint(ctx, parent, img, runtime.CheckpointOptions{LeaveRunning: true}); err != nil {
		t.Fatalf("Checkpoint: %v", err)
	}
	if st, err := d.State(ctx, parent); err != nil || st.State != runtime.StateRunning {
		t.Fatalf("parent after checkpoint: %+v %v, want running", st, err)
	}

	// The image holds memory only: the 1 MiB file is not in it.
	if fi, err := os.Stat(filepath.Join(img, "pages.img")); err == nil && fi.Size() > 1<<20 {
		t.Errorf("pages.img is %d bytes: file data went into the image", fi.Size())
	}

	start(child, childDir, img)
	if got := sh(child, "cat /hello"); got != "parent" {
		t.Errorf("child /hello = %q, want parent", got)
	}
	if got := sh(child, "wc -c < /blob"); got != "1048576" {
		t.Errorf("child /blob size = %q", got)
	}
	if got := sh(child, "md5sum < /blob"); got != sh(parent, "md5sum < /blob") {
		t.Errorf("child /blob differs from the parent's")
	}
	if got := sh(child, "test -e /etc/passwd && echo present || echo absent"); got != "absent" {
		t.Errorf("child /etc/passwd %s, want absent (deleted by the parent)", got)
	}

	sh(child, "echo child > /hello; echo only-child > /c")
	sh(parent, "echo parent2 > /hello")
	if got := sh(child, "cat /hello"); got != "child" {
		t.Errorf("child /hello = %q, want child", got)
	}
	if got := sh(parent, "cat /hello; test -e /c && echo leaked || true"); got != "parent2" {
		t.Errorf("parent sees %q, want parent2 and no /c", got)
	}
	if _, err := os.Stat(filepath.Join(lower, "etc", "passwd")); err != nil {
		t.Errorf("template rootfs changed: %v", err)
	}
}
