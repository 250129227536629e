package e2e

import (
	"fmt"
	"github.com/ember-sandbox/ember/internal/testutil"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/layerfs"
)

// extent is one FIEMAP extent of a file.
type extent struct {
	logical, physical, length uint64
	flags                     uint32
}

// fileExtents maps path's data (FS_IOC_FIEMAP, synced first).
func fileExtents(t *testing.T, path string) []extent {
	t.Helper()
	const (
		fsIocFiemap   = 0xC020660B
		fiemapSync    = 0x1
		extentLast    = 0x1
		extentsPerRun = 64
	)
	type fiemapExtent struct {
		Logical, Physical, Length uint64
		_                         [2]uint64
		Flags                     uint32
		_                         [3]uint32
	}
	type fiemap struct {
		Start, Length                  uint64
		Flags, Mapped, Count, Reserved uint32
		Extents                        [extentsPerRun]fiemapExtent
	}
	f, err := os.Open(path)
	if err != nil {
		out, _ := exec.Command("find", filepath.Dir(filepath.Dir(filepath.Dir(filepath.Dir(filepath.Dir(path))))), "-maxdepth", "4").CombinedOutput()
		t.Fatalf("%v\n%s", err, out)
	}
	defer f.Close()
	var out []extent
	for start := uint64(0); ; {
		fm := fiemap{Start: start, Length: ^uint64(0) - start, Flags: fiemapSync, Count: extentsPerRun}
		if _, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), fsIocFiemap, uintptr(unsafe.Pointer(&fm))); errno != 0 {
			t.Fatalf("FIEMAP %s: %v", path, errno)
		}
		if fm.Mapped == 0 {
			return out
		}
		for _, e := range fm.Extents[:fm.Mapped] {
			out = append(out, extent{e.Logical, e.Physical, e.Length, e.Flags})
			if e.Flags&extentLast != 0 {
				return out
			}
			start = e.Logical + e.Length
		}
	}
}

// captured is the file a capture holds the sandbox's layer in: the disk-limited layer's ext4
// image (the default), else the file itself in the captured upper directory.
func captured(layer, file string) string {
	if img := filepath.Join(layer, ".disk.img"); fileExists(img) {
		return img
	}
	return filepath.Join(layer, "upper", file)
}

// requireClone fails unless the capture's data extents are shared (FIEMAP_EXTENT_SHARED) and
// at least min bytes of them are the very extents of other (another capture of the same
// layer): the capture is a clone, not a copy (no timing involved).
func requireClone(t *testing.T, what, path, other string, min uint64) {
	t.Helper()
	const extentShared = 0x2000
	a := fileExtents(t, path)
	var shared, total uint64
	phys := map[uint64]uint64{}
	for _, e := range a {
		total += e.length
		if e.flags&extentShared != 0 {
			shared += e.length
		}
		phys[e.physical] = e.length
	}
	if shared < min {
		t.Fatalf("%s: %d of %d bytes in shared extents, want at least %d: a copy, not a clone", what, shared, total, min)
	}
	var common uint64
	for _, e := range fileExtents(t, other) {
		if l, ok := phys[e.physical]; ok && l == e.length {
			common += e.length
		}
	}
	if common < min {
		t.Fatalf("%s: %d bytes on the same extents as %s, want at least %d", what, common, other, min)
	}
	t.Logf("%s: %s: %d MiB of %d MiB shared, %d MiB on the very extents of %s", what, path, shared>>20, total>>20, common>>20, other)
}

// underMount returns where the files of dir/name that a mount at dir/name hides can be read:
// dir bind-mounted (without its submounts) on a temporary directory, until release (the bind
// holds the data dir's filesystem: it must go before the data dir is unmounted).
func underMount(t *testing.T, dir, name string) (path string, release func()) {
	t.Helper()
	tmp := t.TempDir()
	if err := unix.Mount(dir, tmp, "", unix.MS_BIND, ""); err != nil {
		t.Fatalf("bind %s: %v", dir, err)
	}
	release = func() { unix.Unmount(tmp, unix.MNT_DETACH) }
	t.Cleanup(release)
	return filepath.Join(tmp, name), release
}

// imageLoops lists the loop devices attached to the data dir's layer filesystem image.
func (d *daemon) imageLoops(t *testing.T) []string {
	t.Helper()
	out, err := exec.Command("losetup", "-n", "-O", "NAME", "-j", filepath.Join(d.dataDir, layerfs.ImageName)).Output()
	if err != nil {
		t.Fatalf("losetup: %v", err)
	}
	return strings.Fields(string(out))
}

// On a host whose filesystem cannot clone (ext4), ember's default start mounts a btrfs image
// over the data dir: a named snapshot and a fork capture the sandbox's layer as a clone (the
// same extents, shared), a kill -9 and start reuses the mount (no second loop device) with every
// sandbox's files, and after a "reboot" (everything gone but the files) the image is mounted
// again and the snapshot still creates sandboxes with the same file.
func TestLayerFSCaptureIsACloneAndSurvivesRestarts(t *testing.T) {
	ok, err := layerfs.CanClone(buildDir)
	testutil.Need(t, err == nil && !ok, fmt.Sprintf("a test dir on a filesystem that cannot clone files, as ext4 (clones: %v, probe: %v)", ok, err))
	// A node id and CIDR of its own, named: EMBER_E2E_NODE_PREFIX and EMBER_E2E_NET_OFFSET
	// apply to named ones only (automatic ones collide between e2e runs sharing a host).
	d := newDaemonWith(t, daemonOpts{NodeID: "clfs", CIDR: nodeCIDR(40)})
	if l := d.logLines("Layer filesystem: created a sparse btrfs image", 1); l == "" {
		t.Fatalf("no layer filesystem line in the start's output\n%s", d.logs())
	}
	var st unix.Statfs_t
	if err := unix.Statfs(d.dataDir, &st); err != nil || uint32(st.Type) != uint32(unix.BTRFS_SUPER_MAGIC) {
		t.Fatalf("data dir %s: fs type %#x (%v), want btrfs", d.dataDir, st.Type, err)
	}
	if loops := d.imageLoops(t); len(loops) != 1 {
		t.Fatalf("loop devices of the image after the first start: %v", loops)
	}

	s := d.create(t, map[string]any{"timeout": 600})
	sum := d.run(t, s, "head -c 64M /dev/urandom > /home/user/big && sync && sha256sum /home/user/big | cut -c1-64").stdout
	if len(strings.TrimSpace(sum)) != 64 {
		t.Fatalf("sha256 of the file: %q", sum)
	}
	runs, _ := filepath.Glob(filepath.Join(d.dataDir, "sandboxes", s.SandboxID, "run-*"))
	if len(runs) != 1 {
		t.Fatalf("the sandbox's instance dirs: %v", runs)
	}
	// The sandbox's own layer (a disk-limited layer's image is mounted over its directory).
	srcLayer, releaseSrc := underMount(t, runs[0], "layer")
	srcFile := captured(srcLayer, "home/user/big")

	var snap struct {
		SnapshotID string `json:"snapshotID"`
	}
	if code := d.api(t, "POST", "/sandboxes/"+s.SandboxID+"/snapshots", map[string]any{"name": "layerfs-snap"}, &snap); code != 201 {
		t.Fatalf("snapshot: %d\n%s", code, d.logs())
	}
	snapFile := captured(filepath.Join(d.dataDir, "images", snap.SnapshotID, "layer"), "home/user/big")

	before := d.forkLayers()
	var items []forkItem
	if code := d.api(t, "POST", "/sandboxes/"+s.SandboxID+"/fork", map[string]any{"count": 1, "timeout": 600}, &items); code != 201 || len(items) != 1 || items[0].Sandbox == nil {
		t.Fatalf("fork: %d %+v\n%s", code, items, d.logs())
	}
	kid := *items[0].Sandbox
	t.Cleanup(func() { d.api(t, "DELETE", "/sandboxes/"+kid.SandboxID, nil, nil) })
	var forkLayer string
	for l := range d.forkLayers() {
		if !before[l] {
			forkLayer = l
		}
	}
	if forkLayer == "" {
		t.Fatal("no fork layer after the fork")
	}
	// A captured disk image is mounted read-only over its layer directory while children stack it.
	forkDir, releaseFork := underMount(t, forkLayer, "layer")
	forkFile := captured(forkDir, "home/user/big")
	// Both captures of the 64 MiB written are on the sandbox's very extents.
	requireClone(t, "named snapshot", snapFile, srcFile, 64<<20)
	requireClone(t, "fork", forkFile, srcFile, 64<<20)
	releaseSrc()
	releaseFork()

	check := func(when string, sb sbx) {
		t.Helper()
		if got := d.run(t, sb, "sha256sum /home/user/big | cut -c1-64").stdout; got != sum {
			t.Errorf("%s: sandbox %s reads sha256 %q, want %q", when, sb.SandboxID, got, sum)
		}
	}

	// kill -9, start: the mount is reused, the sandboxes keep their files.
	d.restart(t, syscall.SIGKILL)
	if l := d.logLines("reusing the mounted btrfs image", 1); l == "" {
		t.Fatalf("the start after kill -9 did not reuse the mount\n%s", d.logs())
	}
	if loops := d.imageLoops(t); len(loops) != 1 {
		t.Fatalf("loop devices of the image after kill -9 and start: %v", loops)
	}
	check("after kill -9 and start", s)
	check("after kill -9 and start", kid)

	// "Reboot": daemon, sandboxes, mounts and the loop device gone; the image file stays.
	d.stop()
	if left := d.purge(); len(left) > 0 {
		t.Fatalf("after the purge: %v", left)
	}
	if loops := d.imageLoops(t); len(loops) != 0 {
		t.Fatalf("loop devices of the image after the unmount: %v", loops)
	}
	if err := d.start(); err != nil {
		t.Fatalf("start after the reboot: %v\n%s", err, d.logs())
	}
	if l := d.logLines("mounted the btrfs image", 1); l == "" {
		t.Fatalf("the start after the reboot did not mount the image again\n%s", d.logs())
	}
	if loops := d.imageLoops(t); len(loops) != 1 {
		t.Fatalf("loop devices of the image after the reboot: %v", loops)
	}
	child := d.create(t, map[string]any{"templateID": snap.SnapshotID})
	check("from the snapshot after the reboot", child)
}
