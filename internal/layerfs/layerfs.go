// Package layerfs gives the data directory a filesystem that can clone files, so that a
// snapshot, fork or checkpoint captures a sandbox's writable layer in O(1) instead of copying it.
//
// The capture code (internal/runtime/gvisor fsdelta.go, quota.go) clones a layer as a btrfs
// subvolume snapshot, or with reflinks (FICLONE) on xfs, and copies it elsewhere. Where the
// data directory's own filesystem cannot clone (ext4, the default on most hosts; tmpfs), Setup
// creates a sparse btrfs filesystem image inside the data directory, attaches it to a loop
// device and mounts it over the data directory itself. Everything between which a clone or a
// rename happens (sandbox layers, disk-limited layer images, fork layers, checkpoint and
// snapshot images, templates) then lives on that one filesystem, under the same paths as before.
//
// btrfs rather than reflink xfs: a layer on btrfs is a subvolume, and its capture is one
// snapshot ioctl whatever the number of files (xfs clones file by file); btrfs also grows
// online and returns freed space to the host file through discard on the loop device.
//
// The mount outlives the daemon (sandboxes keep running across restarts, and their overlay
// mounts stack on it): a start finds it and reuses it, and mounts the image again after a
// reboot. The loop device is attached with autoclear, so unmounting the data directory
// (Unmount) detaches it; it is never attached twice for one image.
package layerfs

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/overlayfs"
)

// Modes of Config.Mode (`ember serve --layer-fs`).
const (
	ModeAuto  = "auto"  // btrfs image when the data directory's filesystem cannot clone
	ModeHost  = "host"  // the data directory's own filesystem, whatever it is
	ModeBtrfs = "btrfs" // always the btrfs image (a new data directory only)
)

// ImageName is the btrfs image's file name in the data directory (hidden under the mount
// while it is mounted).
const ImageName = ".layerfs.btrfs"

// minSize is the smallest image mkfs.btrfs makes comfortably (single profiles).
const minSize = 512 << 20

// Config of Setup.
type Config struct {
	DataDir string
	Mode    string // ModeAuto when empty
	// Size of the image in bytes (sparse: only what is written takes host space). 0 = the space
	// available on the host filesystem when the image is made. An existing image smaller than
	// Size is grown when it is mounted.
	Size int64
}

// Result says what Setup did.
type Result struct {
	// FS is "btrfs" when the data directory is the loop-mounted image, else "host".
	FS string
	// HostFS is the type of the filesystem under the data directory (ext4, xfs, ...).
	HostFS string
	// Action: "created" (new image, mounted), "mounted" (existing image, mounted again),
	// "reused" (already mounted), "clones" (the host filesystem clones: nothing to do),
	// "host" (mode host, or auto on a data directory that already holds data of the host fs).
	Action string
	Image  string // the image file (btrfs only)
	Device string // the loop device (btrfs only)
	Size   int64  // the image's size (btrfs only)
	Grown  bool   // the image was grown to Config.Size
	Reason string // why the host filesystem is used, or why the image was needed
}

// String is a line for the log and the user.
func (r Result) String() string {
	switch r.FS {
	case "btrfs":
		what := map[string]string{
			"created": "created a sparse btrfs image of " + gib(r.Size),
			"mounted": "mounted the btrfs image (" + gib(r.Size) + ")",
			"reused":  "reusing the mounted btrfs image (" + gib(r.Size) + ")",
		}[r.Action]
		if r.Grown {
			what += ", grown"
		}
		return fmt.Sprintf("layer filesystem: %s: %s on %s over the data directory (%s): snapshots, forks and checkpoints clone layers in O(1)",
			what, r.Image, r.Device, r.Reason)
	default:
		return fmt.Sprintf("layer filesystem: the data directory's own (%s): %s", r.HostFS, r.Reason)
	}
}

func gib(n int64) string { return strconv.FormatFloat(float64(n)/(1<<30), 'f', 1, 64) + " GiB" }

// Setup makes sure cfg.DataDir (created by the caller) is on a filesystem that clones, as
// cfg.Mode asks. It is idempotent: an image already mounted over the data directory is
// reused, one not mounted (after a reboot) is mounted again.
func Setup(cfg Config) (Result, error) {
	dir, err := realPath(cfg.DataDir)
	if err != nil {
		return Result{}, fmt.Errorf("layer fs: %w", err)
	}
	mode := cfg.Mode
	if mode == "" {
		mode = ModeAuto
	}
	if mode != ModeAuto && mode != ModeHost && mode != ModeBtrfs {
		return Result{}, fmt.Errorf("layer fs: mode %q: must be auto, host or btrfs: %w", mode, errdefs.ErrInvalid)
	}
	if cfg.Size != 0 && cfg.Size < minSize {
		return Result{}, fmt.Errorf("layer fs: size %d: at least %d bytes (or 0: the host filesystem's free space): %w", cfg.Size, int64(minSize), errdefs.ErrInvalid)
	}
	if m, ok := mountedImage(dir); ok {
		// An earlier start's mount (the daemon was restarted or killed): reuse it as it is.
		r := Result{FS: "btrfs", Action: "reused", Image: m.image, Device: m.device, Size: m.size,
			Reason: "mounted by an earlier start"}
		if mode == ModeHost {
			r.Reason += "; --layer-fs=host ignored: unmount it (no sandbox running) to leave it"
		}
		return r, nil
	}
	hostFS := fsTypeName(dir)
	image := filepath.Join(dir, ImageName)
	_, statErr := os.Lstat(image)
	hasImage := statErr == nil
	switch {
	case hasImage && mode == ModeHost:
		return Result{}, fmt.Errorf("layer fs: %s holds the data directory's files: with --layer-fs=host they would not be seen; use --layer-fs=auto: %w", image, errdefs.ErrConflict)
	case hasImage:
		return mount(dir, image, cfg.Size, false, "existing image")
	case mode == ModeHost:
		return Result{FS: "host", HostFS: hostFS, Action: "host", Reason: "--layer-fs=host (captures clone only if this filesystem can, else copy)"}, nil
	}
	reason := "--layer-fs=btrfs"
	if mode == ModeAuto {
		ok, err := CanClone(dir)
		if err != nil {
			return Result{}, err
		}
		if ok {
			return Result{FS: "host", HostFS: hostFS, Action: "clones", Reason: "it clones files (FICLONE): captures are O(1) there"}, nil
		}
		reason = hostFS + " cannot clone files"
	}
	if used, err := inUse(dir); err != nil {
		return Result{}, err
	} else if used != "" {
		if mode == ModeBtrfs {
			return Result{}, fmt.Errorf("layer fs: the data directory %s already holds %s: a btrfs image would hide it; use an empty data directory: %w", dir, used, errdefs.ErrConflict)
		}
		return Result{FS: "host", HostFS: hostFS, Action: "host",
			Reason: reason + ", but the data directory already holds " + used + " from an earlier ember (captures copy; start on a new data directory for O(1) captures)"}, nil
	}
	r, err := mount(dir, image, cfg.Size, true, reason)
	if err != nil && mode == ModeAuto {
		if _, mounted := mountedImage(dir); !mounted {
			// No loop devices (a container), no btrfs in the kernel, no mkfs.btrfs: start on
			// the host filesystem, and say why.
			os.Remove(image)
			return Result{FS: "host", HostFS: hostFS, Action: "host",
				Reason: reason + ", and the btrfs image could not be set up (" + err.Error() + "): captures copy"}, nil
		}
	}
	return r, err
}

// realPath is p absolute with its symlinks resolved, as /proc/self/mountinfo names mounts.
func realPath(p string) (string, error) {
	abs, err := filepath.Abs(p)
	if err != nil {
		return "", err
	}
	return filepath.EvalSymlinks(abs)
}

// inUse names an entry of the data directory (ember's files from a start on the host
// filesystem), or "" when it is empty.
func inUse(dir string) (string, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return "", fmt.Errorf("layer fs: %w", err)
	}
	for _, e := range ents {
		if e.Name() != "lost+found" && !strings.HasPrefix(e.Name(), ImageName) {
			return e.Name(), nil
		}
	}
	return "", nil
}

// mount creates (when create) or opens image, grows it to size, attaches it to a loop device
// and mounts it over dir. A lock on dir (the host directory, opened before any mount) serializes
// two starts; the one that waited finds the mount and reuses it. A new image is made under a
// temporary name and renamed into place once mkfs is done, so that a start cut half-way leaves
// no image that does not mount.
func mount(dir, image string, size int64, create bool, reason string) (Result, error) {
	dfd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return Result{}, fmt.Errorf("layer fs: %w", err)
	}
	defer unix.Close(dfd)
	if err := unix.Flock(dfd, unix.LOCK_EX); err != nil {
		return Result{}, fmt.Errorf("layer fs: lock %s: %w", dir, err)
	}
	if m, ok := mountedImage(dir); ok {
		return Result{FS: "btrfs", Action: "reused", Image: m.image, Device: m.device, Size: m.size, Reason: "mounted by a concurrent start"}, nil
	}
	if _, err := os.Lstat(image); err == nil {
		create = false // made by a concurrent start
	}
	if create {
		if size == 0 {
			if size, err = hostSize(dir); err != nil {
				return Result{}, err
			}
		}
		if err := makeImage(image, size); err != nil {
			return Result{}, err
		}
	}
	fd, err := unix.Open(image, unix.O_RDWR|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err != nil {
		return Result{}, fmt.Errorf("layer fs: open %s: %w", image, err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return Result{}, fmt.Errorf("layer fs: %w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Uid != 0 {
		return Result{}, fmt.Errorf("layer fs: %s: not a regular file of root's: %w", image, errdefs.ErrInvalid)
	}
	grown := false
	if size > st.Size {
		if err := unix.Ftruncate(fd, size); err != nil {
			return Result{}, fmt.Errorf("layer fs: grow %s: %w", image, err)
		}
		grown = true
	}
	dev := loopOf(image)
	if dev == "" {
		var lfd int
		if dev, lfd, err = attachLoop(fd); err != nil {
			return Result{}, err
		}
		// autoclear: the mount holds the device from here on, and its unmount detaches it.
		defer unix.Close(lfd)
	} else if grown {
		// An attached device (left by a cut start) learns the new size.
		if lfd, err := unix.Open(dev, unix.O_RDWR|unix.O_CLOEXEC, 0); err == nil {
			unix.IoctlSetInt(lfd, unix.LOOP_SET_CAPACITY, 0)
			unix.Close(lfd)
		}
	}
	// noatime: a read would otherwise rewrite (and unshare) the metadata of cloned layers.
	// discard=async: space freed in btrfs is punched out of the image file.
	if err := unix.Mount(dev, dir, "btrfs", unix.MS_NOATIME, "discard=async"); err != nil {
		return Result{}, fmt.Errorf("layer fs: mount %s (%s) on %s: %w", dev, image, dir, err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return Result{}, fmt.Errorf("layer fs: %w", err)
	}
	if grown {
		if err := resizeMax(dir); err != nil {
			return Result{}, err
		}
	}
	action := "mounted"
	if create {
		action = "created"
	}
	if err := unix.Fstat(fd, &st); err != nil {
		return Result{}, fmt.Errorf("layer fs: %w", err)
	}
	return Result{FS: "btrfs", HostFS: fsTypeName(filepath.Dir(dir)), Action: action, Image: image, Device: dev, Size: st.Size, Grown: grown, Reason: reason}, nil
}

// AvailBytes is the space left for sandboxes in dataDir: on the image, the lesser of what
// btrfs has left and what its host filesystem (the data directory's parent's) has left.
func AvailBytes(dataDir string) int64 {
	avail := func(p string) (int64, bool) {
		var st unix.Statfs_t
		if unix.Statfs(p, &st) != nil {
			return 0, false
		}
		return int64(st.Bavail) * st.Bsize, true
	}
	n, ok := avail(dataDir)
	if !ok {
		return 0
	}
	if dir, err := realPath(dataDir); err == nil {
		if _, mounted := mountedImage(dir); mounted {
			if h, ok := avail(filepath.Dir(dir)); ok && h < n {
				n = h
			}
		}
	}
	return n
}

// makeImage makes a sparse btrfs image of size bytes at image (under a temporary name first).
func makeImage(image string, size int64) error {
	tmp := image + ".new"
	os.Remove(tmp) // left by a start cut during mkfs
	f, err := os.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("layer fs: %w", err)
	}
	err = f.Truncate(size)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("layer fs: size %s: %w", tmp, err)
	}
	// Single profiles: the image lives on one host filesystem, a second copy of its metadata
	// would guard against nothing. -K: no discard of the whole (sparse, empty) image.
	out, err := exec.Command("mkfs.btrfs", "-q", "-K", "-L", "ember-layers", "-m", "single", "-d", "single", tmp).CombinedOutput()
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("layer fs: mkfs.btrfs %s (btrfs-progs: scripts/setup.sh installs it; or --layer-fs=host): %v: %s", tmp, err, strings.TrimSpace(string(out)))
	}
	if err := os.Rename(tmp, image); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("layer fs: %w", err)
	}
	return nil
}

// Unmount unmounts the btrfs image mounted over dataDir, which detaches its loop device (for
// tests and scripts that remove a data directory; sandboxes on it must be gone). busy bounds
// the wait for an unmount that is busy; past it the mount is detached lazily and the loop
// device goes when its last user does. Not mounted: nothing to do.
func Unmount(dataDir string, busy time.Duration) error {
	dir, err := realPath(dataDir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	} else if err != nil {
		return err
	}
	m, ok := mountedImage(dir)
	if !ok {
		return nil
	}
	deadline := time.Now().Add(busy)
	for {
		err := unix.Unmount(dir, 0)
		if err == nil {
			break
		}
		if !errors.Is(err, unix.EBUSY) || time.Now().After(deadline) {
			if lerr := unix.Unmount(dir, unix.MNT_DETACH); lerr != nil {
				return fmt.Errorf("layer fs: unmount %s: %w", dir, lerr)
			}
			return fmt.Errorf("layer fs: unmount %s: %w (detached lazily: %s goes with its last user)", dir, err, m.device)
		}
		time.Sleep(50 * time.Millisecond)
	}
	// Autoclear detaches the device as the filesystem releases it; wait for it (bounded). It
	// stays while the filesystem is mounted elsewhere too (a bind mount of a directory in it).
	for i := 0; loopBacking(m.device) != ""; i++ {
		if i == 100 {
			return fmt.Errorf("layer fs: %s unmounted, but %s stays attached: the filesystem is mounted elsewhere too: %w", dir, m.device, errdefs.ErrConflict)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return nil
}

// CanClone reports whether dir's filesystem can share extents between two files (FICLONE on
// two temporary files): btrfs, xfs with reflink=1, bcachefs, ... but not ext4 or tmpfs.
func CanClone(dir string) (bool, error) {
	src, err := os.CreateTemp(dir, ".clone-probe-*")
	if err != nil {
		return false, fmt.Errorf("layer fs: clone probe: %w", err)
	}
	defer os.Remove(src.Name())
	defer src.Close()
	if _, err := src.Write(make([]byte, 4096)); err != nil {
		return false, fmt.Errorf("layer fs: clone probe: %w", err)
	}
	dst, err := os.CreateTemp(dir, ".clone-probe-*")
	if err != nil {
		return false, fmt.Errorf("layer fs: clone probe: %w", err)
	}
	defer os.Remove(dst.Name())
	defer dst.Close()
	err = unix.IoctlFileClone(int(dst.Fd()), int(src.Fd()))
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, unix.EOPNOTSUPP), errors.Is(err, unix.ENOTTY), errors.Is(err, unix.EINVAL),
		errors.Is(err, unix.EXDEV), errors.Is(err, unix.ENOSYS), errors.Is(err, unix.EPERM):
		return false, nil
	default:
		return false, fmt.Errorf("layer fs: clone probe in %s: %w", dir, err)
	}
}

// mounted describes the image mounted over a data directory.
type mounted struct {
	image, device string
	size          int64
}

// mountedImage reports the loop-backed btrfs mounted exactly at dir, if any.
func mountedImage(dir string) (mounted, bool) {
	if !overlayfs.IsMountPoint(dir) {
		return mounted{}, false
	}
	src, fstype, ok := mountAt(dir)
	if !ok || fstype != "btrfs" || !strings.HasPrefix(src, "/dev/loop") {
		return mounted{}, false
	}
	m := mounted{device: src, image: strings.TrimSuffix(loopBacking(src), " (deleted)")}
	if m.image == "" {
		m.image = filepath.Join(dir, ImageName)
	}
	var st unix.Statfs_t
	if unix.Statfs(dir, &st) == nil {
		m.size = int64(st.Blocks) * st.Bsize
	}
	if b, err := os.ReadFile("/sys/block/" + filepath.Base(src) + "/size"); err == nil {
		if n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64); err == nil {
			m.size = n * 512
		}
	}
	return m, true
}

// mountAt returns the source and type of the topmost mount at dir (/proc/self/mountinfo).
func mountAt(dir string) (source, fstype string, ok bool) {
	mounts, err := overlayfs.Mounts()
	if err != nil {
		return "", "", false
	}
	for _, mt := range mounts {
		if mt.Point == dir {
			source, fstype, ok = mt.Source, mt.FSType, true // the last one is on top
		}
	}
	return source, fstype, ok
}

// loopBacking is the backing file of a loop device ("" when it has none).
func loopBacking(dev string) string {
	b, err := os.ReadFile("/sys/block/" + filepath.Base(dev) + "/loop/backing_file")
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// loopOf returns a loop device already attached to image (a start cut between attach and
// mount, or a mount made elsewhere), or "".
func loopOf(image string) string {
	devs, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, f := range devs {
		b, err := os.ReadFile(f)
		if err == nil && strings.TrimSpace(string(b)) == image {
			return "/dev/" + filepath.Base(filepath.Dir(filepath.Dir(f)))
		}
	}
	return ""
}

// attachLoop attaches the open file fd to a free loop device (overlayfs.AttachLoop) with
// direct I/O where the host filesystem has it: the page cache then holds btrfs's pages only
// once.
func attachLoop(fd int) (string, int, error) {
	dev, lfd, err := overlayfs.AttachLoop(fd, true)
	if err != nil {
		return "", -1, fmt.Errorf("layer fs: %w", err)
	}
	return dev, lfd, nil
}

// hostSize is the space available on the filesystem holding dir: the default image size
// (sparse, so it costs only what is written). Sized so, btrfs runs out of space (ENOSPC to the
// sandbox) before its host does while ember is the host's main writer: a host that fills
// under the image fails the loop device's writes instead, and btrfs turns read-only.
func hostSize(dir string) (int64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, fmt.Errorf("layer fs: statfs %s: %w", dir, err)
	}
	size := int64(st.Bavail) * st.Bsize
	if size < minSize {
		size = minSize
	}
	return size &^ (1<<20 - 1), nil
}

// resizeMax grows the btrfs mounted at dir to its device's size (BTRFS_IOC_RESIZE "max").
func resizeMax(dir string) error {
	if err := overlayfs.BtrfsVolIoctl(dir, overlayfs.BtrfsIocResize, 0, "max"); err != nil {
		return fmt.Errorf("layer fs: grow: %w", err)
	}
	return nil
}

// FSType names the filesystem holding p (ext4, xfs, btrfs, tmpfs, ...).
func FSType(p string) string { return fsTypeName(p) }

// fsTypeName names the filesystem holding p.
func fsTypeName(p string) string {
	var st unix.Statfs_t
	if err := unix.Statfs(p, &st); err != nil {
		return "unknown"
	}
	switch uint32(st.Type) {
	case unix.EXT4_SUPER_MAGIC:
		return "ext4"
	case unix.XFS_SUPER_MAGIC:
		return "xfs"
	case unix.BTRFS_SUPER_MAGIC:
		return "btrfs"
	case unix.TMPFS_MAGIC:
		return "tmpfs"
	case unix.OVERLAYFS_SUPER_MAGIC:
		return "overlayfs"
	}
	return fmt.Sprintf("fs %#x", uint32(st.Type))
}

// ParseSize reads a size for Config.Size: bytes, or a number with K, M, G or T (binary units,
// an optional "iB"/"B"); "0" or "" = the default.
func ParseSize(s string) (int64, error) {
	t := strings.TrimSpace(s)
	if t == "" {
		return 0, nil
	}
	t = strings.TrimSuffix(strings.TrimSuffix(strings.ToUpper(t), "B"), "I")
	shift := 0
	if n := len(t); n > 0 {
		switch t[n-1] {
		case 'K':
			shift = 10
		case 'M':
			shift = 20
		case 'G':
			shift = 30
		case 'T':
			shift = 40
		}
		if shift > 0 {
			t = t[:n-1]
		}
	}
	v, err := strconv.ParseInt(t, 10, 64)
	if err != nil || v < 0 || v > (1<<62)>>shift {
		return 0, fmt.Errorf("layer fs: size %q: want bytes or a number with K, M, G or T: %w", s, errdefs.ErrInvalid)
	}
	return v << shift, nil
}
