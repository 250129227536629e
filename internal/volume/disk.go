package volume

import (
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

const imageName = "disk.img"

// provision makes a new volume's directory: the image, formatted and mounted, with its data
// directory (world-traversable, root's: the sandbox's users create their own files in it).
func (m *Manager) provision(v *Volume) error {
	if m.cfg.Shared != "" {
		return mkdirOpen(m.DataDir(v.ID))
	}
	dir := m.volDir(v.ID)
	if err := os.MkdirAll(filepath.Join(dir, "mnt"), 0o700); err != nil {
		return err
	}
	if !m.cfg.NoDiskLimit {
		if err := makeImage(dir, v.SizeMB); err != nil {
			return err
		}
		if err := m.attach(v.ID); err != nil {
			return err
		}
	}
	return mkdirOpen(m.DataDir(v.ID))
}

// mkdirOpen makes a volume's root directory, open to every user (the sandbox's users create
// their own files in it).
func mkdirOpen(data string) error {
	if err := os.Mkdir(data, 0o755); err != nil && !os.IsExist(err) {
		return err
	}
	return os.Chmod(data, 0o777)
}

// attach mounts the volume's image at <id>/mnt unless it is mounted already.
func (m *Manager) attach(id string) error {
	if m.cfg.Shared != "" {
		return nil
	}
	dir := m.volDir(id)
	img := filepath.Join(dir, imageName)
	if _, err := os.Stat(img); os.IsNotExist(err) {
		return nil // a plain directory (NoDiskLimit)
	}
	return mountImage(img, filepath.Join(dir, "mnt"))
}

// detach unmounts the volume's image. A sandbox still running with the volume keeps its own
// reference (runsc's gofer holds the directory open), so the filesystem lives on until it ends.
func (m *Manager) detach(id string) error {
	mnt := filepath.Join(m.volDir(id), "mnt")
	if !isMountPoint(mnt) {
		return nil
	}
	if err := unix.Unmount(mnt, unix.MNT_DETACH); err != nil {
		return fmt.Errorf("unmount volume %s: %w", id, err)
	}
	return nil
}

// remove unmounts and deletes a volume's directory.
func (m *Manager) remove(id string) error {
	if m.cfg.Shared != "" {
		return os.RemoveAll(m.DataDir(id))
	}
	if err := m.detach(id); err != nil {
		return err
	}
	return os.RemoveAll(m.volDir(id))
}

// isMountPoint reports whether p is the root of a mount (its device differs from its parent's).
func isMountPoint(p string) bool {
	var st, pst unix.Stat_t
	if unix.Lstat(p, &st) != nil || unix.Lstat(filepath.Dir(p), &pst) != nil {
		return false
	}
	return st.Dev != pst.Dev
}
