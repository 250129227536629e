package gvisor

// fsdelta: a sandbox's writable layer as host files instead of gVisor's memory-backed overlay.
//
// With runsc --overlay2=none and a rootfs that is a kernel overlayfs mount (lower = the shared
// template rootfs, upper = a directory private to the sandbox), everything the sandbox writes is a
// host file, and a checkpoint image holds only memory: after the sandbox wrote 1 GiB the image
// stays at ~0.3 MiB and checkpoint --leave-running takes ~50 ms (the memory overlay: 1.1 GiB,
// 0.4-2.2 s). A snapshot or fork is then: pause, checkpoint --leave-running, CloneUpper, resume;
// each child gets PrepareRootFS on its clone and is restored there (runsc accepts a rootfs path
// that differs from the checkpointed one).
//
// CloneUpper is O(1) in the data on btrfs (a subvolume snapshot), O(files) on xfs with reflink
// (FICLONE per file via cp --reflink), and O(bytes) elsewhere. Any CoW clone first writes back
// the layer's dirty pages, so data written just before a snapshot costs disk bandwidth once.

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/overlayfs"
)

// Layout of a sandbox directory used by PrepareRootFS and CloneUpper.
const (
	layerDirName  = "layer"  // the sandbox's writable layer: a btrfs subvolume when possible
	upperDirName  = "upper"  // overlayfs upperdir, inside layer
	workDirName   = "work"   // overlayfs workdir, inside layer (same filesystem as upper)
	mergedDirName = "rootfs" // the mount point handed to runsc as the OCI root
)

// Clone methods reported by CloneUpper.
const (
	CloneBtrfsSnapshot = "btrfs-snapshot" // a writable btrfs subvolume snapshot: O(1)
	CloneReflink       = "reflink"        // a tree copy sharing extents (xfs reflink=1, btrfs)
	CloneCopy          = "copy"           // a full copy: O(bytes)
)

// PrepareRootFS makes sandboxDir's writable root: an overlayfs mount at <sandboxDir>/rootfs with
// the read-only stack lowers (top first; the template's layer directories, never written) below
// upper/work in <sandboxDir>/layer. An existing layer (one made by CloneUpper) is reused;
// otherwise an empty one is created, as a btrfs subvolume when sandboxDir is on btrfs. Run the
// instance with runsc --overlay2=none and merged as its rootfs. cleanup unmounts merged; the
// layer stays until RemoveLayer.
func PrepareRootFS(lowers []string, sandboxDir string) (merged string, cleanup func() error, err error) {
	if len(lowers) == 0 {
		return "", nil, fmt.Errorf("gvisor: fsdelta: no lower layer: %w", errdefs.ErrInvalid)
	}
	for _, p := range append([]string{sandboxDir}, lowers...) {
		if !filepath.IsAbs(p) || strings.ContainsAny(p, ",:\\\n") {
			return "", nil, fmt.Errorf("gvisor: fsdelta: path %q: must be absolute without , : or \\: %w", p, errdefs.ErrInvalid)
		}
	}
	var lfi os.FileInfo
	for i, l := range lowers {
		fi, err := os.Stat(l)
		if err != nil || !fi.IsDir() {
			return "", nil, fmt.Errorf("gvisor: fsdelta: lower %q: not a directory: %w", l, errdefs.ErrInvalid)
		}
		if i == 0 {
			lfi = fi
		}
	}
	// The instance's directory holds its files and memory: only root may look inside.
	if err := os.MkdirAll(sandboxDir, 0o700); err != nil {
		return "", nil, fmt.Errorf("gvisor: fsdelta: %w", err)
	}
	if err := os.Chmod(sandboxDir, 0o700); err != nil {
		return "", nil, fmt.Errorf("gvisor: fsdelta: %w", err)
	}
	layer := filepath.Join(sandboxDir, layerDirName)
	if _, err := os.Lstat(layer); errors.Is(err, os.ErrNotExist) {
		if err := createLayer(layer); err != nil {
			return "", nil, err
		}
	} else if err != nil {
		return "", nil, fmt.Errorf("gvisor: fsdelta: %w", err)
	}
	upper := filepath.Join(layer, upperDirName)
	work := filepath.Join(layer, workDirName)
	merged = filepath.Join(sandboxDir, mergedDirName)
	// A layer that came from an image (possibly a restored, tampered snapshot) must be made of
	// real directories: an upper that is a symlink to a host directory would hand it to the
	// sandbox. Checked before anything is created in them.
	if err := checkLayerDir(layer); err != nil {
		return "", nil, err
	}
	for _, d := range []string{upper, work} {
		if err := checkLayerDir(d); err != nil && !errors.Is(err, os.ErrNotExist) {
			return "", nil, err
		}
	}
	// The root of the merged tree takes upper's attributes: give it the top layer's mode.
	for _, d := range []string{upper, work, merged} {
		if err := os.Mkdir(d, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
			return "", nil, fmt.Errorf("gvisor: fsdelta: %w", err)
		}
	}
	for _, d := range []string{upper, work} {
		if err := checkLayerDir(d); err != nil {
			return "", nil, err
		}
	}
	if err := os.Chmod(upper, lfi.Mode().Perm()); err != nil {
		return "", nil, fmt.Errorf("gvisor: fsdelta: %w", err)
	}
	// nosuid, nodev: root in the sandbox can leave setuid-root files and device nodes in its
	// layer; through this mount they give a host user nothing (the sandbox sees its own mount).
	if err := overlayfs.Mount(merged, lowers, upper, work); err != nil {
		return "", nil, fmt.Errorf("gvisor: fsdelta: %w", err)
	}
	cleanup = func() error {
		err := unix.Unmount(merged, 0)
		if errors.Is(err, unix.EBUSY) {
			err = unix.Unmount(merged, unix.MNT_DETACH)
		}
		if err != nil && !errors.Is(err, unix.EINVAL) { // EINVAL: not mounted any more
			return fmt.Errorf("gvisor: fsdelta: unmount %s: %w", merged, err)
		}
		return nil
	}
	return merged, cleanup, nil
}

// CloneUpper gives dstSandboxDir a writable layer equal to srcSandboxDir's (as PrepareRootFS made
// it), for a child to be restored on. The source must not change while it runs: pause the
// instance (runsc pause) across checkpoint and clone, so files and memory image agree.
// dstSandboxDir must not have a layer yet. It returns the method used (Clone*).
func CloneUpper(srcSandboxDir, dstSandboxDir string) (method string, err error) {
	return cloneUpper(srcSandboxDir, dstSandboxDir, nil)
}

// cloneUpper is CloneUpper; frozen (when not nil) is called once the source can no longer
// change the clone: a disk-limited layer frozen (its writes wait until the clone is done), a
// plain layer cloned. A paused source may be resumed from there.
func cloneUpper(srcSandboxDir, dstSandboxDir string, frozen func()) (method string, err error) {
	if frozen != nil {
		defer func() {
			if method != CloneDiskImage {
				frozen()
			}
		}()
	}
	src := filepath.Join(srcSandboxDir, layerDirName)
	dst := filepath.Join(dstSandboxDir, layerDirName)
	if ok, err := cloneDiskLayerFrozen(srcSandboxDir, dstSandboxDir, frozen); ok {
		return CloneDiskImage, err
	}
	if _, err := os.Lstat(filepath.Join(src, upperDirName)); err != nil {
		return "", fmt.Errorf("gvisor: fsdelta: clone: source layer: %v: %w", err, errdefs.ErrNotFound)
	}
	for _, d := range []string{src, filepath.Join(src, upperDirName)} {
		if err := checkLayerDir(d); err != nil {
			return "", err
		}
	}
	if _, err := os.Lstat(dst); err == nil {
		return "", fmt.Errorf("gvisor: fsdelta: clone: %s exists: %w", dst, errdefs.ErrConflict)
	}
	if err := os.MkdirAll(dstSandboxDir, 0o700); err != nil {
		return "", fmt.Errorf("gvisor: fsdelta: clone: %w", err)
	}
	if overlayfs.IsSubvolume(src) && overlayfs.IsBtrfs(dstSandboxDir) {
		err := btrfsSnapshot(src, dst)
		if err == nil {
			return CloneBtrfsSnapshot, nil
		}
		if !errors.Is(err, unix.EXDEV) {
			return "", err
		}
		// Another btrfs filesystem: copy.
	}
	// A plain tree: copy upper only (work is overlayfs scratch space) with cp, which keeps what
	// overlayfs stores in the upper: whiteouts (0/0 char devices), trusted.overlay.* xattrs,
	// owners, modes, times and hard links. --reflink=auto shares extents where the fs can.
	method = CloneCopy
	if reflinkCapable(dstSandboxDir) && sameFS(src, dstSandboxDir) {
		method = CloneReflink
	}
	if err := createLayer(dst); err != nil {
		return "", err
	}
	out, err := exec.Command("cp", "-a", "--reflink=auto", "--",
		filepath.Join(src, upperDirName), filepath.Join(dst, upperDirName)).CombinedOutput()
	if err != nil {
		_ = RemoveLayer(dstSandboxDir)
		return "", fmt.Errorf("gvisor: fsdelta: clone: cp: %v: %s", err, strings.TrimSpace(string(out)))
	}
	return method, nil
}

// RemoveLayer deletes sandboxDir's writable layer (unmount its rootfs first).
func RemoveLayer(sandboxDir string) error {
	layer := filepath.Join(sandboxDir, layerDirName)
	// Its data is discarded: a lazy detach (when still busy) is fine here.
	if overlayfs.IsMountPoint(layer) {
		if err := unmount(layer); err != nil {
			return err
		}
	}
	if err := overlayfs.RemoveTree(layer, overlayfs.DetachMounts); err != nil {
		return fmt.Errorf("gvisor: fsdelta: remove layer: %w", err)
	}
	return nil
}

// createLayer makes an empty layer directory: a subvolume on btrfs, a directory elsewhere.
func createLayer(layer string) error {
	parent := filepath.Dir(layer)
	if overlayfs.IsBtrfs(parent) {
		if err := overlayfs.BtrfsVolIoctl(parent, overlayfs.BtrfsIocSubvolCreate, -1, filepath.Base(layer)); err == nil {
			if err := os.Chmod(layer, 0o700); err != nil {
				return fmt.Errorf("gvisor: fsdelta: layer: %w", err)
			}
			return nil
		}
	}
	if err := os.Mkdir(layer, 0o700); err != nil {
		return fmt.Errorf("gvisor: fsdelta: layer: %w", err)
	}
	return nil
}

// checkLayerDir makes sure p is a real directory (not a symlink, not followed) owned by the
// driver's user (root): a layer from an image must not lead anywhere else on the host.
func checkLayerDir(p string) error {
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("gvisor: fsdelta: %s: %w", p, os.ErrNotExist)
		}
		return fmt.Errorf("gvisor: fsdelta: %s: %w", p, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return fmt.Errorf("gvisor: fsdelta: layer path %s is not a directory (mode %#o): %w", p, st.Mode, errdefs.ErrInvalid)
	}
	if int(st.Uid) != os.Geteuid() {
		return fmt.Errorf("gvisor: fsdelta: layer path %s is owned by uid %d: %w", p, st.Uid, errdefs.ErrInvalid)
	}
	return nil
}

// btrfsSnapshot makes dst a writable snapshot of the subvolume src.
func btrfsSnapshot(src, dst string) error {
	s, err := unix.Open(src, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("gvisor: fsdelta: open %s: %w", src, err)
	}
	defer unix.Close(s)
	return overlayfs.BtrfsVolIoctl(filepath.Dir(dst), overlayfs.BtrfsIocSnapCreate, s, filepath.Base(dst))
}

// sameFS reports whether a and b are on the same filesystem. btrfs subvolumes differ in st_dev
// (and statfs fsid), so two btrfs paths count as the same: cp falls back to copying if not.
func sameFS(a, b string) bool {
	if overlayfs.IsBtrfs(a) && overlayfs.IsBtrfs(b) {
		return true
	}
	var sa, sb unix.Stat_t
	return unix.Stat(a, &sa) == nil && unix.Stat(b, &sb) == nil && sa.Dev == sb.Dev
}

// reflinkCapable reports whether dir's filesystem can share extents between files (FICLONE).
func reflinkCapable(dir string) bool {
	src, err := os.CreateTemp(dir, ".reflink-probe-*")
	if err != nil {
		return false
	}
	defer os.Remove(src.Name())
	defer src.Close()
	if _, err := src.Write([]byte("x")); err != nil {
		return false
	}
	dst, err := os.CreateTemp(dir, ".reflink-probe-*")
	if err != nil {
		return false
	}
	defer os.Remove(dst.Name())
	defer dst.Close()
	return unix.IoctlFileClone(int(dst.Fd()), int(src.Fd())) == nil
}
