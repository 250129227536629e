package image

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path"
	"strings"

	"golang.org/x/sys/unix"
)

// Tree edits a composed rootfs safely: every lookup stays under the root without following
// symlinks, and every write makes a new inode (written beside the target, then renamed over
// it), so a file that is a hard link into a shared layer is replaced, never written through.
type Tree struct {
	fd   int
	Path string
}

// OpenTree opens the rootfs at p.
func OpenTree(p string) (*Tree, error) {
	fd, err := unix.Open(p, unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err != nil {
		return nil, err
	}
	return &Tree{fd: fd, Path: p}, nil
}

// Close releases the tree.
func (t *Tree) Close() error { return unix.Close(t.fd) }

func splitRel(rel string) (string, string) {
	rel = strings.Trim(path.Clean("/"+rel), "/")
	dir, base := path.Split(rel)
	return strings.TrimSuffix(dir, "/"), base
}

// Lstat reports what is at rel (no symlink followed, on the way or at the end).
func (t *Tree) Lstat(rel string) (unix.Stat_t, error) {
	var st unix.Stat_t
	dir, base := splitRel(rel)
	fd, err := openBeneath(t.fd, dir)
	if err != nil {
		return st, err
	}
	defer unix.Close(fd)
	err = unix.Fstatat(fd, base, &st, unix.AT_SYMLINK_NOFOLLOW)
	return st, err
}

// Exists reports whether rel exists (a symlink on the way counts as absent).
func (t *Tree) Exists(rel string) bool {
	_, err := t.Lstat(rel)
	return err == nil
}

// ReadFile reads the regular file rel; a symlink is refused.
func (t *Tree) ReadFile(rel string) ([]byte, error) {
	rel = strings.Trim(path.Clean("/"+rel), "/")
	fd, err := unix.Openat2(t.fd, rel, &unix.OpenHow{Flags: unix.O_RDONLY | unix.O_CLOEXEC | unix.O_NOFOLLOW, Resolve: resolveFlags})
	if err != nil {
		if err == unix.ENOENT {
			return nil, os.ErrNotExist
		}
		return nil, pathError(rel, err)
	}
	f := os.NewFile(uintptr(fd), rel)
	defer f.Close()
	return io.ReadAll(io.LimitReader(f, 64<<20))
}

// MkdirAll makes directory rel and missing parents with mode and owner (existing ones are
// left as they are).
func (t *Tree) MkdirAll(rel string, mode uint32, uid, gid int) error {
	rel = strings.Trim(path.Clean("/"+rel), "/")
	u := &unpacker{root: t.fd}
	if fd, err := openBeneath(t.fd, rel); err == nil {
		unix.Close(fd)
		return nil
	}
	fd, err := u.mkdirAll(rel)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := unix.Fchown(fd, uid, gid); err != nil {
		return err
	}
	return unix.Fchmod(fd, mode)
}

// Chown sets the owner of rel (no symlink followed, on the way or at the end).
func (t *Tree) Chown(rel string, uid, gid int) error {
	dir, base := splitRel(rel)
	fd, err := openBeneath(t.fd, dir)
	if err != nil {
		return pathError(dir, err)
	}
	defer unix.Close(fd)
	if base == "" {
		return unix.Fchown(fd, uid, gid)
	}
	return unix.Fchownat(fd, base, uid, gid, unix.AT_SYMLINK_NOFOLLOW)
}

// WriteFile writes data as a new file rel (mode, owner), replacing whatever was there.
func (t *Tree) WriteFile(rel string, data []byte, mode uint32, uid, gid int) error {
	return t.replace(rel, func(parent int, tmp string) error {
		fd, err := unix.Openat(parent, tmp, unix.O_CREAT|unix.O_EXCL|unix.O_WRONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		if _, err := (fdFile{fd}).Write(data); err != nil {
			return err
		}
		if err := unix.Fchown(fd, uid, gid); err != nil {
			return err
		}
		return unix.Fchmod(fd, mode)
	})
}

// Link makes rel a hard link to the host file src (ember's own, e.g. envd in the store).
func (t *Tree) Link(rel, src string) error {
	return t.replace(rel, func(parent int, tmp string) error {
		return unix.Linkat(unix.AT_FDCWD, src, parent, tmp, 0)
	})
}

func (t *Tree) replace(rel string, mk func(parent int, tmp string) error) error {
	dir, base := splitRel(rel)
	if base == "" {
		return fmt.Errorf("write /: %w", os.ErrInvalid)
	}
	parent, err := openBeneath(t.fd, dir)
	if err != nil {
		return pathError(dir, err)
	}
	defer unix.Close(parent)
	var st unix.Stat_t
	if err := unix.Fstatat(parent, base, &st, unix.AT_SYMLINK_NOFOLLOW); err == nil && st.Mode&unix.S_IFMT == unix.S_IFDIR {
		if err := removeAllAt(parent, base); err != nil {
			return err
		}
	}
	var b [6]byte
	rand.Read(b[:])
	tmp := ".ember-" + hex.EncodeToString(b[:])
	if err := mk(parent, tmp); err != nil {
		unix.Unlinkat(parent, tmp, 0)
		return fmt.Errorf("write /%s: %w", rel, err)
	}
	if err := unix.Renameat(parent, tmp, parent, base); err != nil {
		unix.Unlinkat(parent, tmp, 0)
		return fmt.Errorf("write /%s: %w", rel, err)
	}
	return nil
}
