package overlayfs

// The host's mounts beyond overlays: removing a tree that may hold mounts or btrfs subvolumes
// (one function, its mount policy said by every caller), mount points, loop devices.

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// MountPolicy is what RemoveTree does with what is mounted in the tree it removes.
type MountPolicy int

const (
	// DetachMounts lazily unmounts whatever is mounted under the tree or on it first: for
	// trees that hold ember's own mounts (an instance's rootfs or disk layer a crash left, the
	// read-only mount of an export a crash cut, a sandbox's directory once its instance is gone).
	DetachMounts MountPolicy = iota
	// RefuseMounts removes nothing when something is mounted under the tree (ErrConflict): for
	// trees written from data (a snapshot being fetched or loaded), where ember mounts nothing,
	// so that a mount found there (someone else's) is left with its files.
	RefuseMounts
)

// RemoveTree removes dir and everything under it, following no symlink; a missing dir is not
// an error. Mounts are handled as policy says. A btrfs subvolume is deleted whole (one ioctl
// rather than a walk) where the kernel allows it; directories whose modes forbid the removal (a
// snapshot's restrictive ones) are made the owner's first.
func RemoveTree(dir string, policy MountPolicy) error {
	if _, err := os.Lstat(dir); errors.Is(err, fs.ErrNotExist) {
		return nil
	} else if err != nil {
		return err
	}
	switch policy {
	case DetachMounts:
		points := MountsUnder(dir)
		for i := len(points) - 1; i >= 0; i-- {
			unix.Unmount(points[i], unix.MNT_DETACH)
		}
		for MountedOn(dir) {
			if unix.Unmount(dir, unix.MNT_DETACH) != nil {
				break
			}
		}
	case RefuseMounts:
		// The walk also makes every directory the owner's (before it reads it).
		if err := walkDirs(dir, func(p string) error {
			if p != dir && IsMountPoint(p) {
				return fmt.Errorf("%s is a mount point: %w", p, errdefs.ErrConflict)
			}
			os.Chmod(p, 0o700)
			return nil
		}); err != nil {
			return err
		}
	default:
		return fmt.Errorf("overlayfs: remove %s: mount policy %d: %w", dir, policy, errdefs.ErrInvalid)
	}
	if IsSubvolume(dir) && BtrfsVolIoctl(filepath.Dir(dir), BtrfsIocSnapDestroy, -1, filepath.Base(dir)) == nil {
		return nil // else not allowed (unprivileged without user_subvol_rm_allowed): removed file by file
	}
	err := os.RemoveAll(dir)
	if errors.Is(err, fs.ErrPermission) {
		walkDirs(dir, func(p string) error { os.Chmod(p, 0o700); return nil })
		err = os.RemoveAll(dir)
	}
	return err
}

// walkDirs calls fn on every directory under dir (dir first, a directory before what it holds),
// following no symlink; it stops at fn's first error.
func walkDirs(dir string, fn func(string) error) error {
	return filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return nil
		}
		return fn(p)
	})
}

// IsMountPoint reports whether p is the root of a mount (its mount id differs from its
// parent's; btrfs subvolumes, which differ in st_dev only, are not mount points).
func IsMountPoint(p string) bool {
	id := func(path string) (uint64, bool) {
		var stx unix.Statx_t
		if unix.Statx(unix.AT_FDCWD, path, unix.AT_SYMLINK_NOFOLLOW, unix.STATX_MNT_ID, &stx) != nil {
			return 0, false
		}
		return stx.Mnt_id, stx.Mask&unix.STATX_MNT_ID != 0
	}
	a, ok1 := id(p)
	b, ok2 := id(filepath.Dir(p))
	return ok1 && ok2 && a != b
}

// btrfs ioctls (linux/btrfs.h) that take struct btrfs_ioctl_vol_args {s64 fd; char name[4088]}.
const (
	BtrfsIocSnapCreate   = 0x50009401 // _IOW(0x94, 1, vol_args)
	BtrfsIocResize       = 0x50009403 // _IOW(0x94, 3, vol_args)
	BtrfsIocSubvolCreate = 0x5000940e // _IOW(0x94, 14, vol_args)
	BtrfsIocSnapDestroy  = 0x5000940f // _IOW(0x94, 15, vol_args)
	btrfsFirstFreeObjID  = 256        // inode number of every subvolume's root directory
)

type btrfsVolArgs struct {
	Fd   int64
	Name [4088]byte
}

// BtrfsVolIoctl runs a vol_args ioctl on the directory dir with fd and name.
func BtrfsVolIoctl(dir string, req uintptr, fd int, name string) error {
	if len(name) >= 4088 || strings.Contains(name, "/") {
		return fmt.Errorf("btrfs name %q: %w", name, errdefs.ErrInvalid)
	}
	d, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("btrfs: open %s: %w", dir, err)
	}
	defer unix.Close(d)
	args := btrfsVolArgs{Fd: int64(fd)}
	copy(args.Name[:], name)
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(d), req, uintptr(unsafe.Pointer(&args))); errno != 0 {
		return fmt.Errorf("btrfs ioctl %#x %s/%s: %w", req, dir, name, errno)
	}
	return nil
}

// IsBtrfs reports whether path is on btrfs.
func IsBtrfs(path string) bool {
	var st unix.Statfs_t
	return unix.Statfs(path, &st) == nil && uint32(st.Type) == uint32(unix.BTRFS_SUPER_MAGIC)
}

// IsSubvolume reports whether path is the root of a btrfs subvolume.
func IsSubvolume(path string) bool {
	var st unix.Stat_t
	return IsBtrfs(path) && unix.Stat(path, &st) == nil && st.Ino == btrfsFirstFreeObjID
}

// ErrNoLoop is returned (wrapped) by AttachLoop where the host gives no loop devices: no
// /dev/loop-control, or no permission to open it or a device.
var ErrNoLoop = errors.New("no loop devices")

// AttachLoop attaches the open file fd to a free loop device with autoclear, and, with
// directIO, direct I/O where the backing filesystem has it (the page cache then holds the
// data only once; it falls back to buffered where it has not). It returns the device and an
// open descriptor of it: the device is detached when that closes unless something (a mount)
// holds it.
func AttachLoop(fd int, directIO bool) (string, int, error) {
	ctl, err := unix.Open("/dev/loop-control", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", -1, fmt.Errorf("loop-control: %w: %v", ErrNoLoop, err)
	}
	defer unix.Close(ctl)
	for attempt := 0; attempt < 20; attempt++ {
		n, err := unix.IoctlRetInt(ctl, unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return "", -1, fmt.Errorf("loop-control: %w", err)
		}
		dev := "/dev/loop" + strconv.Itoa(n)
		var lfd int
		for i := 0; i < 50; i++ { // devtmpfs may add the node a moment later
			lfd, err = unix.Open(dev, unix.O_RDWR|unix.O_CLOEXEC, 0)
			if !errors.Is(err, unix.ENOENT) {
				break
			}
			time.Sleep(2 * time.Millisecond)
		}
		if errors.Is(err, unix.EACCES) || errors.Is(err, unix.EPERM) {
			return "", -1, fmt.Errorf("open %s: %w: %v", dev, ErrNoLoop, err)
		} else if err != nil {
			return "", -1, fmt.Errorf("open %s: %w", dev, err)
		}
		cfg := unix.LoopConfig{Fd: uint32(fd)}
		cfg.Info.Flags = unix.LO_FLAGS_AUTOCLEAR
		if directIO {
			cfg.Info.Flags |= unix.LO_FLAGS_DIRECT_IO
			cfg.Size = 4096
		}
		err = unix.IoctlLoopConfigure(lfd, &cfg)
		if directIO && errors.Is(err, unix.EINVAL) { // no direct I/O on this backing filesystem
			cfg.Info.Flags, cfg.Size = unix.LO_FLAGS_AUTOCLEAR, 0
			err = unix.IoctlLoopConfigure(lfd, &cfg)
		}
		if err == nil {
			return dev, lfd, nil
		}
		unix.Close(lfd)
		if !errors.Is(err, unix.EBUSY) { // EBUSY: another process took it first
			return "", -1, fmt.Errorf("configure %s: %w", dev, err)
		}
	}
	return "", -1, fmt.Errorf("no free loop device: %w", errdefs.ErrUnavailable)
}
