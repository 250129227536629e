package gvisor

// quota: runtime.Spec.DiskMB, a bound on an instance's writable layer.
//
// A limited layer is a filesystem of its own: <StateDir>/layer holds a sparse ext4 image
// (.disk.img, DiskMB MiB) and, while the instance exists, that image is loop-mounted over the
// layer directory itself (nosuid,nodev), so upper/ and work/ live inside it and PrepareRootFS,
// overlayfs and runsc see the usual layout. A write past the limit fails with ENOSPC inside the
// sandbox ("No space left on device"); nothing outside the image is touched, and the sparse
// image never takes more host disk than DiskMB. Usable space is DiskMB less ext4's metadata
// (54 of 64 MiB; about 97% at GiB sizes). Images are sparse, so the sum of DiskMB may exceed
// the host's free space: if the host filesystem fills, sandboxes see EIO, not ENOSPC.
//
// Why an image and not quotas: this kernel has no CONFIG_QUOTA (ext4 and xfs refuse prjquota),
// btrfs qgroups answer EDQUOT rather than ENOSPC and exist only on btrfs, and the default data
// directory is ext4 (qgroups on a btrfs loop: 2-6 ms per subvolume + limit, cheap, but EDQUOT).
// Measured (TestDiskLimitCosts, 10 GiB image, 64 MiB written, ext4 data dir, medians): start
// +13 ms (a copy of a formatted image from a per-size cache, loop attach, mount; mkfs.ext4 itself
// costs 40-115 ms and runs once per size), pause +0 ms (unmount + rename), resume +11 ms (loop
// attach + mount), fork +113 ms (freeze, which writes back dirty data, then a clone of the image
// file: FICLONE where the filesystem can, else a sparse copy of the blocks in use).
//
// Unmounted, the directory is a plain tree (layer/.disk.img) that moves with the existing
// rename/clone code. The image's bytes are a filesystem the host kernel mounts: only images the
// driver made may ever be mounted. ImportImage must not accept a .disk.img from a store (export
// the files inside it instead, see DiskLayerFiles).

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/overlayfs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

const (
	// diskImageName is the filesystem image inside a limited layer directory.
	diskImageName = ".disk.img"
	// CloneDiskImage is CloneUpper's method for a limited layer: the image file was cloned
	// (reflink where possible, else a sparse copy).
	CloneDiskImage = "disk-image"

	fiFreeze = 0xc0045877 // FIFREEZE: _IOWR('X', 119, int)
	fiThaw   = 0xc0045878 // FITHAW: _IOWR('X', 120, int)
)

// layerFrozenName marks an instance directory whose disk-limited layer is frozen (FIFREEZE)
// for a clone; layersFrozenHere are those this process froze (and thaws itself).
const layerFrozenName = ".layer-frozen"

var layersFrozenHere sync.Map

// thawCutLayer thaws the disk-limited layer of instance directory dir if a clone that a crash
// of an earlier daemon cut left it frozen (its writes, and the instance with them, would wait
// forever).
func thawCutLayer(dir string) bool {
	marker := filepath.Join(dir, layerFrozenName)
	if _, err := os.Stat(marker); err != nil {
		return false
	}
	if _, here := layersFrozenHere.Load(dir); here {
		return false
	}
	if fd, err := unix.Open(filepath.Join(dir, layerDirName), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0); err == nil {
		unix.IoctlRetInt(fd, fiThaw) // EINVAL when not frozen
		unix.Close(fd)
	}
	os.Remove(marker)
	return true
}

var (
	diskTemplateMu   sync.Mutex
	diskUnsupported  sync.Once // logs once that limits cannot be enforced on this host
	errNoDiskSupport = errors.New("this host cannot loop-mount an ext4 image (no loop devices, mkfs.ext4 or privilege)")
)

// applyDiskLimit gives spec's instance a limited layer before PrepareRootFS runs: a layer that
// already carries an image (moved or cloned from a checkpoint) is mounted whatever DiskMB says;
// with DiskMB > 0 a new image is made, and a plain layer (from an image taken without a limit)
// is copied into it. Where the host cannot (no loop devices, no mkfs.ext4, not permitted) a
// fresh layer stays unlimited and the driver logs it once.
func (d *Driver) applyDiskLimit(spec runtime.Spec) error {
	layer := filepath.Join(spec.StateDir, layerDirName)
	img := filepath.Join(layer, diskImageName)
	if _, err := os.Stat(img); err == nil {
		if overlayfs.IsMountPoint(layer) {
			return nil
		}
		if err := growImage(img, spec.DiskMB); err != nil {
			return err
		}
		return mountDiskLayer(layer)
	}
	if spec.DiskMB <= 0 {
		return nil
	}
	if spec.DiskMB < 16 {
		return fmt.Errorf("gvisor: spec.DiskMB %d: must be 0 or at least 16: %w", spec.DiskMB, errdefs.ErrInvalid)
	}
	plain := ""
	if _, err := os.Lstat(layer); err == nil {
		// A layer without a limit (restored from an unlimited image): move its files in.
		plain = layer + ".plain"
		if err := os.Rename(layer, plain); err != nil {
			return fmt.Errorf("gvisor: disk limit: %w", err)
		}
	}
	err := d.newDiskLayer(layer, spec.DiskMB)
	if err != nil {
		_ = unmount(layer)
		_ = os.RemoveAll(layer)
		if plain != "" {
			_ = os.Rename(plain, layer)
		}
		if errors.Is(err, errNoDiskSupport) {
			diskUnsupported.Do(func() {
				d.log.Warn("disk limits not enforced on this host", "err", err)
			})
			return nil
		}
		return err
	}
	if plain == "" {
		return nil
	}
	if _, err := os.Stat(filepath.Join(plain, upperDirName)); err == nil {
		out, err := exec.Command("cp", "-a", "--", filepath.Join(plain, upperDirName), filepath.Join(layer, upperDirName)).CombinedOutput()
		if err != nil {
			_ = unmount(layer)
			_ = os.RemoveAll(layer)
			_ = os.Rename(plain, layer)
			msg := strings.TrimSpace(string(out))
			if strings.Contains(msg, "No space left") {
				return fmt.Errorf("gvisor: disk limit: the layer holds more than %d MiB: %w", spec.DiskMB, errdefs.ErrInvalid)
			}
			return fmt.Errorf("gvisor: disk limit: copy layer in: %v: %s", err, msg)
		}
	}
	if err := overlayfs.RemoveTree(plain, overlayfs.DetachMounts); err != nil {
		d.log.Warn("disk limit: remove old layer", "path", plain, "err", err)
	}
	return nil
}

// newDiskLayer creates layer as a directory holding a fresh image of sizeMB and mounts it there.
func (d *Driver) newDiskLayer(layer string, sizeMB int) error {
	tmpl, err := d.diskTemplate(sizeMB)
	if err != nil {
		return err
	}
	if err := os.Mkdir(layer, 0o700); err != nil {
		return fmt.Errorf("gvisor: disk limit: %w", err)
	}
	if err := copyImage(tmpl, filepath.Join(layer, diskImageName)); err != nil {
		return err
	}
	return mountDiskLayer(layer)
}

// diskTemplate returns a formatted, empty image of sizeMB under the driver's root, making it
// the first time (mkfs.ext4 costs 40-115 ms here; copying the result a few ms).
func (d *Driver) diskTemplate(sizeMB int) (string, error) {
	dir := filepath.Join(d.cfg.Root, "disk-templates")
	p := filepath.Join(dir, fmt.Sprintf("ext4-%dm.img", sizeMB))
	diskTemplateMu.Lock()
	defer diskTemplateMu.Unlock()
	if _, err := os.Stat(p); err == nil {
		return p, nil
	}
	if _, err := os.Stat("/dev/loop-control"); err != nil {
		return "", fmt.Errorf("%w: %v", errNoDiskSupport, err)
	}
	mkfs, err := exec.LookPath("mkfs.ext4")
	if err != nil {
		return "", fmt.Errorf("%w: %v", errNoDiskSupport, err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", fmt.Errorf("gvisor: disk limit: %w", err)
	}
	tmp, err := os.CreateTemp(dir, ".mkfs-*")
	if err != nil {
		return "", fmt.Errorf("gvisor: disk limit: %w", err)
	}
	defer os.Remove(tmp.Name())
	err = tmp.Truncate(int64(sizeMB) << 20)
	tmp.Close()
	if err != nil {
		return "", fmt.Errorf("gvisor: disk limit: %w", err)
	}
	// -m 0: the gofer writes as host root, so reserved blocks would only blur the limit.
	// Lazy inode-table and journal init keep the image ~4 MiB; noinit_itable at mount stops the
	// kernel zeroing them later.
	out, err := exec.Command(mkfs, "-q", "-F", "-b", "4096", "-m", "0",
		"-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard", tmp.Name()).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("gvisor: disk limit: mkfs.ext4: %v: %s", err, strings.TrimSpace(string(out)))
	}
	if err := os.Rename(tmp.Name(), p); err != nil {
		return "", fmt.Errorf("gvisor: disk limit: %w", err)
	}
	return p, nil
}

// growImage extends img to sizeMB when that is larger (the filesystem grows at mount). A
// smaller sizeMB keeps the image as it is: a filesystem is not shrunk under its files.
func growImage(img string, sizeMB int) error {
	fi, err := os.Stat(img)
	if err != nil {
		return fmt.Errorf("gvisor: disk limit: %w", err)
	}
	want := int64(sizeMB) << 20
	if sizeMB <= 0 || want <= fi.Size() {
		return nil
	}
	if err := os.Truncate(img, want); err != nil {
		return fmt.Errorf("gvisor: disk limit: grow: %w", err)
	}
	if out, err := exec.Command("resize2fs", "-f", img).CombinedOutput(); err != nil {
		return fmt.Errorf("gvisor: disk limit: resize2fs: %v: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}

// mountDiskLayer attaches layer/.disk.img to a free loop device (auto-cleared when unmounted)
// and mounts it over layer.
func mountDiskLayer(layer string) error {
	img := filepath.Join(layer, diskImageName)
	dev, lfd, err := attachLoop(img)
	if err != nil {
		return err
	}
	defer unix.Close(lfd) // the mount keeps the device; autoclear detaches it at unmount
	if err := unix.Mount(dev, layer, "ext4", unix.MS_NOSUID|unix.MS_NODEV, "noinit_itable"); err != nil {
		if errors.Is(err, unix.EPERM) || errors.Is(err, unix.ENODEV) { // no privilege, no ext4
			return fmt.Errorf("gvisor: disk limit: mount %s on %s: %w: %v", dev, layer, errNoDiskSupport, err)
		}
		return fmt.Errorf("gvisor: disk limit: mount %s on %s: %w", dev, layer, err)
	}
	return nil
}

// attachLoop binds file to a free loop device (overlayfs.AttachLoop) with direct I/O where the
// backing filesystem allows it, so data is not cached twice. It returns the device and an open
// descriptor on it: close it once the device is mounted.
// On btrfs, where a capture clones the image (FICLONE, whose cost grows with the file's extent
// items), the device is buffered instead: direct I/O makes an extent item of every write
// (~70 ms to clone 1 GiB written), writeback makes few large ones (~1 ms).
func attachLoop(file string) (string, int, error) {
	ffd, err := unix.Open(file, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", -1, fmt.Errorf("gvisor: disk limit: %w", err)
	}
	defer unix.Close(ffd)
	dev, lfd, err := overlayfs.AttachLoop(ffd, !overlayfs.IsBtrfs(filepath.Dir(file)))
	if errors.Is(err, overlayfs.ErrNoLoop) {
		return "", -1, fmt.Errorf("gvisor: disk limit: %w: %v", errNoDiskSupport, err)
	} else if err != nil {
		return "", -1, fmt.Errorf("gvisor: disk limit: %w", err)
	}
	return dev, lfd, nil
}

// hasDiskImage reports whether the layer directory carries a disk image (mounted or not).
func hasDiskImage(layer string) bool {
	if overlayfs.IsMountPoint(layer) {
		return true
	}
	_, err := os.Stat(filepath.Join(layer, diskImageName))
	return err == nil
}

// cloneDiskLayerFrozen is CloneUpper for a limited layer: dst/layer gets a copy of src's image. A
// mounted source (a running, paused instance) is frozen while its image is copied, so the copy
// is a clean filesystem. ok is false when src is not a limited layer.
// frozen (when not nil) is called once a mounted source is frozen, before its image is copied:
// from then on until the copy is done, writes to the layer wait, so the source may run again
// meanwhile (checkpointLayer resumes it there).
func cloneDiskLayerFrozen(srcSandboxDir, dstSandboxDir string, frozen func()) (ok bool, err error) {
	src := filepath.Join(srcSandboxDir, layerDirName)
	dst := filepath.Join(dstSandboxDir, layerDirName)
	if !hasDiskImage(src) {
		return false, nil
	}
	if _, err := os.Lstat(dst); err == nil {
		return true, fmt.Errorf("gvisor: disk limit: clone: %s exists: %w", dst, errdefs.ErrConflict)
	}
	if err := os.MkdirAll(dstSandboxDir, 0o755); err != nil {
		return true, fmt.Errorf("gvisor: disk limit: clone: %w", err)
	}
	srcImg := filepath.Join(src, diskImageName)
	if overlayfs.IsMountPoint(src) {
		// The image is hidden under its own mount: reach it through a detached, non-recursive
		// clone of the parent's mount, where layer is the plain directory.
		fd, err := unix.Open(src, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return true, fmt.Errorf("gvisor: disk limit: clone: %w", err)
		}
		defer unix.Close(fd)
		if frozen != nil {
			// The instance is paused (its caller holds it so until frozen): nothing writes the
			// layer, so where the image can be reflinked a sync and a clone are enough, without
			// the freeze below (whose three barriers cost ~40 ms of the instance's stop).
			if ok, err := clonePausedDiskLayer(fd, srcSandboxDir, dst, frozen); ok {
				return true, err
			}
		}
		// The kernel keeps a filesystem frozen after the process that froze it dies: the marker
		// lets a later daemon thaw a layer a crash left frozen (thawCutLayer).
		marker := filepath.Join(srcSandboxDir, layerFrozenName)
		if err := os.WriteFile(marker, nil, 0o600); err != nil {
			return true, fmt.Errorf("gvisor: disk limit: clone: %w", err)
		}
		layersFrozenHere.Store(srcSandboxDir, true)
		if _, err := unix.IoctlRetInt(fd, fiFreeze); err != nil {
			layersFrozenHere.Delete(srcSandboxDir)
			os.Remove(marker)
			return true, fmt.Errorf("gvisor: disk limit: clone: freeze: %w", err)
		}
		defer func() {
			unix.IoctlRetInt(fd, fiThaw)
			os.Remove(marker)
			layersFrozenHere.Delete(srcSandboxDir)
		}()
		if frozen != nil {
			frozen()
		}
		tree, err := unix.OpenTree(unix.AT_FDCWD, srcSandboxDir, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
		if err != nil {
			return true, fmt.Errorf("gvisor: disk limit: clone: open_tree: %w", err)
		}
		defer unix.Close(tree)
		srcImg = fmt.Sprintf("/proc/self/fd/%d/%s/%s", tree, layerDirName, diskImageName)
	}
	if err := os.Mkdir(dst, 0o700); err != nil {
		return true, fmt.Errorf("gvisor: disk limit: clone: %w", err)
	}
	if err := copyImage(srcImg, filepath.Join(dst, diskImageName)); err != nil {
		_ = os.RemoveAll(dst)
		return true, err
	}
	return true, nil
}

// clonePausedDiskLayer is cloneDiskLayerFrozen for the mounted limited layer of a paused
// instance (fd: its mount) where the filesystem shares extents: the layer's filesystem is synced
// (its journal committed, its data on the image), the image reflinked into dst, frozen called
// (the instance may run again: the clone no longer changes), and then the clone's journal
// replayed by a mount and unmount of it, so that it is a clean filesystem as a frozen copy is
// (read-only mounts of it skip the journal). ok is false, with nothing made, where the image
// cannot be reflinked: the caller freezes and copies instead.
func clonePausedDiskLayer(fd int, srcSandboxDir, dst string, frozen func()) (ok bool, err error) {
	tree, err := unix.OpenTree(unix.AT_FDCWD, srcSandboxDir, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	if err != nil {
		return true, fmt.Errorf("gvisor: disk limit: clone: open_tree: %w", err)
	}
	defer unix.Close(tree)
	in, err := os.Open(fmt.Sprintf("/proc/self/fd/%d/%s/%s", tree, layerDirName, diskImageName))
	if err != nil {
		return true, fmt.Errorf("gvisor: disk limit: clone: %w", err)
	}
	defer in.Close()
	if err := os.Mkdir(dst, 0o700); err != nil {
		return true, fmt.Errorf("gvisor: disk limit: clone: %w", err)
	}
	img := filepath.Join(dst, diskImageName)
	out, err := os.OpenFile(img, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		os.RemoveAll(dst)
		return true, fmt.Errorf("gvisor: disk limit: clone: %w", err)
	}
	if err := unix.Syncfs(fd); err != nil {
		out.Close()
		os.RemoveAll(dst)
		return true, fmt.Errorf("gvisor: disk limit: clone: sync: %w", err)
	}
	cerr := unix.IoctlFileClone(int(out.Fd()), int(in.Fd()))
	out.Close()
	if cerr != nil {
		os.RemoveAll(dst)
		return false, nil
	}
	frozen()
	// The clone is the image as a crash would leave it: committed, with its journal to replay.
	if err := mountDiskLayer(dst); err != nil {
		os.RemoveAll(dst)
		return true, fmt.Errorf("gvisor: disk limit: clone: replay the journal: %w", err)
	}
	if err := unmountStrict(dst, 15*time.Second); err != nil {
		return true, fmt.Errorf("gvisor: disk limit: clone: replay the journal: %w", err)
	}
	return true, nil
}

// copyImage copies a sparse file: a reflink where the filesystem can, else only the data
// ranges (SEEK_DATA/SEEK_HOLE), so a 10 GiB image with 4 MiB written costs 4 MiB.
func copyImage(src, dst string) (err error) {
	in, err := os.Open(src)
	if err != nil {
		return fmt.Errorf("gvisor: disk limit: copy: %w", err)
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("gvisor: disk limit: copy: %w", err)
	}
	defer func() {
		if cerr := out.Close(); err == nil && cerr != nil {
			err = fmt.Errorf("gvisor: disk limit: copy: %w", cerr)
		}
		if err != nil {
			_ = os.Remove(dst)
		}
	}()
	if unix.IoctlFileClone(int(out.Fd()), int(in.Fd())) == nil {
		return nil
	}
	fi, err := in.Stat()
	if err != nil {
		return fmt.Errorf("gvisor: disk limit: copy: %w", err)
	}
	size := fi.Size()
	for off := int64(0); off < size; {
		data, err := unix.Seek(int(in.Fd()), off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // only a hole is left
		} else if err != nil {
			return fmt.Errorf("gvisor: disk limit: copy: seek: %w", err)
		}
		hole, err := unix.Seek(int(in.Fd()), data, unix.SEEK_HOLE)
		if err != nil {
			return fmt.Errorf("gvisor: disk limit: copy: seek: %w", err)
		}
		if _, err := in.Seek(data, io.SeekStart); err != nil {
			return fmt.Errorf("gvisor: disk limit: copy: %w", err)
		}
		if _, err := out.Seek(data, io.SeekStart); err != nil {
			return fmt.Errorf("gvisor: disk limit: copy: %w", err)
		}
		if _, err := io.CopyN(out, in, hole-data); err != nil {
			return fmt.Errorf("gvisor: disk limit: copy: %w", err)
		}
		off = hole
	}
	if err := out.Truncate(size); err != nil {
		return fmt.Errorf("gvisor: disk limit: copy: %w", err)
	}
	return nil
}

// DiskLayerFiles calls fn with the upper directory of the layer in sandboxDir: the directory
// itself for a plain layer, the image's upper mounted read-only (then unmounted) for an
// unmounted limited layer, the live one for a mounted layer. For exporting a layer as files.
// The read-only mount is made on a new directory in mountParent, named ".ember-disk-*": give
// one the caller's clean-up after a crash covers (the mount outlives a killed process).
func DiskLayerFiles(sandboxDir, mountParent string, fn func(upper string) error) error {
	layer := filepath.Join(sandboxDir, layerDirName)
	if overlayfs.IsMountPoint(layer) || !hasDiskImage(layer) {
		return fn(filepath.Join(layer, upperDirName))
	}
	mnt, err := os.MkdirTemp(mountParent, ".ember-disk-*")
	if err != nil {
		return fmt.Errorf("gvisor: disk limit: %w", err)
	}
	defer os.Remove(mnt)
	dev, lfd, err := attachLoop(filepath.Join(layer, diskImageName))
	if err != nil {
		return err
	}
	err = unix.Mount(dev, mnt, "ext4", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "noload")
	unix.Close(lfd)
	if err != nil {
		return fmt.Errorf("gvisor: disk limit: mount %s: %w", dev, err)
	}
	defer unmount(mnt)
	return fn(filepath.Join(mnt, upperDirName))
}
