package layerfs_test

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/layerfs"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// hostDir is a fresh directory on a filesystem that cannot clone (the host's, when it is ext4
// or tmpfs), or the test skips.
func hostDir(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	ok, err := layerfs.CanClone(dir)
	if err != nil {
		t.Fatal(err)
	}
	testutil.Need(t, !ok, dir+" must be on a filesystem that cannot clone files, as ext4")
	return dir
}

// setup runs Setup and unmounts at the end of the test (before the temp dir goes).
func setup(t *testing.T, cfg layerfs.Config) layerfs.Result {
	t.Helper()
	r, err := layerfs.Setup(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := layerfs.Unmount(cfg.DataDir, 10*time.Second); err != nil {
			t.Error(err)
		}
	})
	return r
}

// loops lists the loop devices backed by path.
func loops(t *testing.T, path string) []string {
	t.Helper()
	out, err := exec.Command("losetup", "-j", path).Output()
	if err != nil {
		t.Fatalf("losetup -j: %v", err)
	}
	var devs []string
	for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if dev, _, ok := strings.Cut(l, ":"); ok {
			devs = append(devs, dev)
		}
	}
	return devs
}

func TestCanCloneProbe(t *testing.T) {
	testutil.RequireRoot(t)
	dir := hostDir(t) // ext4 / tmpfs: false (else skipped)
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Fatalf("the probe left %d files behind", len(ents))
	}
	data := filepath.Join(dir, "data")
	os.Mkdir(data, 0o700)
	setup(t, layerfs.Config{DataDir: data, Mode: layerfs.ModeBtrfs, Size: 1 << 30})
	ok, err := layerfs.CanClone(data)
	if err != nil || !ok {
		t.Fatalf("CanClone on the btrfs image = %v, %v; want true", ok, err)
	}
	if _, err := layerfs.CanClone(filepath.Join(dir, "missing")); err == nil {
		t.Fatal("CanClone of a missing directory: no error")
	}
}

// TestSetupMountsOnceAndAgain: the first start creates and mounts the image; a second start
// (the daemon restarted or killed) reuses the mount without a second loop device; after the
// unmount (a reboot) the next start mounts the same image again, files kept.
func TestSetupMountsOnceAndAgain(t *testing.T) {
	testutil.RequireRoot(t)
	data := filepath.Join(hostDir(t), "data")
	os.Mkdir(data, 0o700)
	cfg := layerfs.Config{DataDir: data, Size: 1 << 30}
	r := setup(t, cfg)
	if r.FS != "btrfs" || r.Action != "created" || r.Size != 1<<30 || !strings.HasPrefix(r.Device, "/dev/loop") {
		t.Fatalf("first start: %+v", r)
	}
	image := filepath.Join(data, layerfs.ImageName)
	if r.Image != image {
		t.Fatalf("image %s, want %s", r.Image, image)
	}
	if got := loops(t, image); len(got) != 1 {
		t.Fatalf("loop devices of the image: %v", got)
	}
	if fi, err := os.Stat(data); err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("data dir on the image: %v %v, want 0700", fi.Mode(), err)
	}
	if ok, _ := layerfs.CanClone(data); !ok {
		t.Fatal("the mounted data dir cannot clone")
	}
	if err := os.WriteFile(filepath.Join(data, "kept"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 3; i++ {
		r2, err := layerfs.Setup(cfg)
		if err != nil {
			t.Fatal(err)
		}
		if r2.Action != "reused" || r2.Device != r.Device || r2.Image != image {
			t.Fatalf("start %d on the mounted dir: %+v, want reused %s", i+2, r2, r.Device)
		}
	}
	// The same data dir through a symlink is the same mount.
	link := filepath.Join(filepath.Dir(data), "link")
	if err := os.Symlink(data, link); err != nil {
		t.Fatal(err)
	}
	if r2, err := layerfs.Setup(layerfs.Config{DataDir: link}); err != nil || r2.Action != "reused" || r2.Device != r.Device {
		t.Fatalf("start through a symlink: %+v %v, want reused %s", r2, err, r.Device)
	}
	if got := loops(t, image); len(got) != 1 {
		t.Fatalf("after restarts, loop devices of the image: %v", got)
	}
	// "Reboot": nothing mounted, nothing attached.
	if err := layerfs.Unmount(data, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	if got := loops(t, image); len(got) != 0 {
		t.Fatalf("after the unmount, loop devices of the image: %v", got)
	}
	if _, err := os.Stat(filepath.Join(data, "kept")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("unmounted, the image's file is still seen: %v", err)
	}
	// A host-mode start must not start over on the underlying (empty) directory.
	if _, err := layerfs.Setup(layerfs.Config{DataDir: data, Mode: layerfs.ModeHost}); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("host mode over an unmounted image: %v, want a conflict", err)
	}
	// Grown on the way: a larger size at the next mount.
	r3, err := layerfs.Setup(layerfs.Config{DataDir: data, Size: 2 << 30})
	if err != nil {
		t.Fatal(err)
	}
	if r3.Action != "mounted" || !r3.Grown || r3.Size != 2<<30 {
		t.Fatalf("after the reboot: %+v, want mounted, grown to 2 GiB", r3)
	}
	if b, err := os.ReadFile(filepath.Join(data, "kept")); err != nil || string(b) != "x" {
		t.Fatalf("file written before the reboot: %q %v", b, err)
	}
	out, err := exec.Command("btrfs", "filesystem", "show", "--raw", data).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "size 2147483648") {
		t.Fatalf("btrfs filesystem show after growing: %v\n%s", err, out)
	}
}

// TestSetupLeavesExistingDataDir: a data directory ember already used on the host filesystem
// keeps it (auto), or refuses the image (btrfs); host mode never mounts.
func TestSetupLeavesExistingDataDir(t *testing.T) {
	testutil.RequireRoot(t)
	dir := hostDir(t)
	used := filepath.Join(dir, "used")
	os.MkdirAll(filepath.Join(used, "sandboxes"), 0o700)
	r, err := layerfs.Setup(layerfs.Config{DataDir: used})
	if err != nil || r.FS != "host" || !strings.Contains(r.Reason, "sandboxes") {
		t.Fatalf("auto on a used data dir: %+v %v, want host", r, err)
	}
	if _, err := layerfs.Setup(layerfs.Config{DataDir: used, Mode: layerfs.ModeBtrfs}); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("btrfs on a used data dir: %v, want a conflict", err)
	}
	empty := filepath.Join(dir, "empty")
	os.Mkdir(empty, 0o700)
	if r, err := layerfs.Setup(layerfs.Config{DataDir: empty, Mode: layerfs.ModeHost}); err != nil || r.FS != "host" || r.Action != "host" {
		t.Fatalf("host mode: %+v %v", r, err)
	}
	if _, err := os.Stat(filepath.Join(empty, layerfs.ImageName)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("host mode made an image: %v", err)
	}
	if _, err := layerfs.Setup(layerfs.Config{DataDir: empty, Mode: "zfs"}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("unknown mode: %v", err)
	}
	if _, err := layerfs.Setup(layerfs.Config{DataDir: empty, Size: 1 << 20}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("tiny size: %v", err)
	}
}

func TestParseSize(t *testing.T) {
	for in, want := range map[string]int64{"": 0, "0": 0, "4096": 4096, "2G": 2 << 30, "512M": 512 << 20, "1TiB": 1 << 40, "3gb": 3 << 30, "7k": 7 << 10} {
		if got, err := layerfs.ParseSize(in); err != nil || got != want {
			t.Errorf("ParseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"x", "-1G", "1.5G", "99999999999T"} {
		if _, err := layerfs.ParseSize(in); err == nil {
			t.Errorf("ParseSize(%q): no error", in)
		}
	}
}

// A start cut during mkfs leaves a half-made image under its temporary name: the next start
// makes the image anew.
func TestSetupAfterACutMkfs(t *testing.T) {
	testutil.RequireRoot(t)
	data := filepath.Join(hostDir(t), "data")
	os.Mkdir(data, 0o700)
	if err := os.WriteFile(filepath.Join(data, layerfs.ImageName+".new"), []byte("half"), 0o600); err != nil {
		t.Fatal(err)
	}
	r := setup(t, layerfs.Config{DataDir: data, Size: 1 << 30})
	if r.Action != "created" || r.FS != "btrfs" {
		t.Fatalf("start after a cut mkfs: %+v", r)
	}
	if err := layerfs.Unmount(data, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	if ents, _ := os.ReadDir(data); len(ents) != 1 || ents[0].Name() != layerfs.ImageName {
		t.Fatalf("under the mount: %v, want the image only", ents)
	}
}

// Where the image cannot be made (here: no mkfs.btrfs on PATH), auto starts on the host
// filesystem and says why; btrfs fails.
func TestSetupFallsBackWithoutBtrfs(t *testing.T) {
	testutil.RequireRoot(t)
	dir := hostDir(t)
	t.Setenv("PATH", t.TempDir())
	auto := filepath.Join(dir, "auto")
	os.Mkdir(auto, 0o700)
	r, err := layerfs.Setup(layerfs.Config{DataDir: auto, Size: 1 << 30})
	if err != nil || r.FS != "host" || !strings.Contains(r.Reason, "mkfs.btrfs") {
		t.Fatalf("auto without mkfs.btrfs: %+v %v, want host with the reason", r, err)
	}
	if ents, _ := os.ReadDir(auto); len(ents) != 0 {
		t.Fatalf("left behind: %v", ents)
	}
	forced := filepath.Join(dir, "forced")
	os.Mkdir(forced, 0o700)
	if _, err := layerfs.Setup(layerfs.Config{DataDir: forced, Mode: layerfs.ModeBtrfs, Size: 1 << 30}); err == nil {
		layerfs.Unmount(forced, 10*time.Second)
		t.Fatal("btrfs without mkfs.btrfs: no error")
	}
}
