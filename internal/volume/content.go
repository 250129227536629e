package volume

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// The content API's file operations. Every path is resolved beneath the volume's root with
// openat2(RESOLVE_BENEATH): `..` is refused outright, and a symlink (written by a sandbox) that
// leads out of the volume fails to resolve instead of being followed; the last component is
// never followed for writes, metadata changes and removals.

// EntryType is an entry's kind, as E2B names them.
type EntryType string

// The entry types.
const (
	TypeFile      EntryType = "file"
	TypeDirectory EntryType = "directory"
	TypeSymlink   EntryType = "symlink"
	TypeUnknown   EntryType = "unknown"
)

// Entry is a file's or directory's stat (E2B's VolumeEntryStat).
type Entry struct {
	Name   string
	Type   EntryType
	Path   string
	Size   int64
	Mode   uint32 // permission bits (and setuid/setgid/sticky)
	UID    uint32
	GID    uint32
	Atime  time.Time
	Mtime  time.Time
	Ctime  time.Time
	Target string // symlinks
}

// Attrs are optional owner and mode to set.
type Attrs struct {
	UID, GID, Mode *uint32
}

const resolveBeneath = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV

// vpath is a cleaned path inside a volume.
type vpath struct{ comps []string }

func (p vpath) rel() string {
	if len(p.comps) == 0 {
		return "."
	}
	return strings.Join(p.comps, "/")
}
func (p vpath) abs() string  { return "/" + strings.Join(p.comps, "/") }
func (p vpath) isRoot() bool { return len(p.comps) == 0 }
func (p vpath) parent() vpath {
	return vpath{comps: p.comps[:len(p.comps)-1]}
}
func (p vpath) base() string { return p.comps[len(p.comps)-1] }

// cleanPath checks a path given to the content API ("/a/b", "a/b", "/" for the root).
func cleanPath(p string) (vpath, error) {
	if p == "" {
		return vpath{}, errorf(errdefs.ErrInvalid, "path is required")
	}
	if strings.IndexByte(p, 0) >= 0 {
		return vpath{}, errorf(errdefs.ErrInvalid, "invalid path %q", p)
	}
	var out []string
	for _, c := range strings.Split(p, "/") {
		switch c {
		case "", ".":
		case "..":
			return vpath{}, errorf(errdefs.ErrInvalid, "invalid path %q: '..' is not allowed", p)
		default:
			out = append(out, c)
		}
	}
	return vpath{comps: out}, nil
}

// pathError turns a syscall error on p into the domain's errors.
func pathError(p vpath, err error) error {
	switch {
	case errors.Is(err, unix.ENOENT), errors.Is(err, unix.ENOTDIR):
		return errorf(errdefs.ErrNotFound, "path '%s' not found", p.abs())
	case errors.Is(err, unix.EEXIST):
		return errorf(errdefs.ErrConflict, "path '%s' already exists", p.abs())
	case errors.Is(err, unix.EXDEV), errors.Is(err, unix.ELOOP):
		return errorf(errdefs.ErrInvalid, "path '%s' leads outside the volume or through a link", p.abs())
	case errors.Is(err, unix.EISDIR):
		return errorf(errdefs.ErrInvalid, "path '%s' is a directory", p.abs())
	case errors.Is(err, unix.ENOTEMPTY):
		return errorf(errdefs.ErrConflict, "directory '%s' is not empty", p.abs())
	case errors.Is(err, unix.ENOSPC), errors.Is(err, unix.EDQUOT):
		return errorf(errdefs.ErrExhausted, "volume is full")
	case errors.Is(err, unix.ENAMETOOLONG), errors.Is(err, unix.EINVAL):
		return errorf(errdefs.ErrInvalid, "invalid path '%s'", p.abs())
	}
	return fmt.Errorf("path '%s': %w", p.abs(), err)
}

func (m *Manager) openRoot(v *Volume) (int, error) {
	fd, err := unix.Open(m.DataDir(v.ID), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("open volume %s: %w", v.ID, err)
	}
	return fd, nil
}

// openBeneath opens p beneath root.
func openBeneath(root int, p vpath, flags uint64, mode uint64) (int, error) {
	for {
		fd, err := unix.Openat2(root, p.rel(), &unix.OpenHow{Flags: flags | unix.O_CLOEXEC, Mode: mode, Resolve: resolveBeneath})
		if err == unix.EINTR || err == unix.EAGAIN {
			continue
		}
		return fd, err
	}
}

// withParent runs fn with p's parent directory open (O_PATH) and p's last component.
func (m *Manager) withParent(v *Volume, p vpath, fn func(dir int, name string) error) error {
	if p.isRoot() {
		return errorf(errdefs.ErrInvalid, "the volume's root cannot be changed")
	}
	root, err := m.openRoot(v)
	if err != nil {
		return err
	}
	defer unix.Close(root)
	dir, err := openBeneath(root, p.parent(), unix.O_PATH|unix.O_DIRECTORY, 0)
	if err != nil {
		return pathError(p.parent(), err)
	}
	defer unix.Close(dir)
	return fn(dir, p.base())
}

func statEntry(dir int, name string, p vpath) (*Entry, error) {
	var st unix.Stat_t
	flags := unix.AT_SYMLINK_NOFOLLOW
	if name == "" {
		flags |= unix.AT_EMPTY_PATH
	}
	if err := unix.Fstatat(dir, name, &st, flags); err != nil {
		return nil, pathError(p, err)
	}
	e := &Entry{
		Name:  name,
		Path:  p.abs(),
		Size:  st.Size,
		Mode:  st.Mode & 0o7777,
		UID:   st.Uid,
		GID:   st.Gid,
		Atime: time.Unix(st.Atim.Unix()).UTC(),
		Mtime: time.Unix(st.Mtim.Unix()).UTC(),
		Ctime: time.Unix(st.Ctim.Unix()).UTC(),
	}
	if p.isRoot() {
		e.Name = "/"
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		e.Type = TypeFile
	case unix.S_IFDIR:
		e.Type = TypeDirectory
	case unix.S_IFLNK:
		e.Type = TypeSymlink
		buf := make([]byte, unix.PathMax)
		if n, err := unix.Readlinkat(dir, name, buf); err == nil {
			e.Target = string(buf[:n])
		}
	default:
		e.Type = TypeUnknown
	}
	return e, nil
}

// Stat returns p's entry (a symlink is not followed).
func (m *Manager) Stat(v *Volume, path string) (*Entry, error) {
	p, err := cleanPath(path)
	if err != nil {
		return nil, err
	}
	if p.isRoot() {
		root, err := m.openRoot(v)
		if err != nil {
			return nil, err
		}
		defer unix.Close(root)
		return statEntry(root, "", p)
	}
	var e *Entry
	err = m.withParent(v, p, func(dir int, name string) error {
		e, err = statEntry(dir, name, p)
		return err
	})
	return e, err
}

// Open opens file p for reading (symlinks inside the volume are followed).
func (m *Manager) Open(v *Volume, path string) (*os.File, error) {
	p, err := cleanPath(path)
	if err != nil {
		return nil, err
	}
	root, err := m.openRoot(v)
	if err != nil {
		return nil, err
	}
	defer unix.Close(root)
	fd, err := openBeneath(root, p, unix.O_RDONLY|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, pathError(p, err)
	}
	f := os.NewFile(uintptr(fd), p.abs())
	fi, err := f.Stat()
	if err == nil && !fi.Mode().IsRegular() {
		err = errorf(errdefs.ErrInvalid, "path '%s' is not a file", p.abs())
	}
	if err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// WriteFile writes r to file p, creating it (and, with force, its missing parents). An
// existing file is replaced unless force is false (then it is a conflict).
func (m *Manager) WriteFile(v *Volume, path string, r io.Reader, a Attrs, force *bool) (*Entry, error) {
	p, err := cleanPath(path)
	if err != nil {
		return nil, err
	}
	if force != nil && *force && len(p.comps) > 1 {
		if _, err := m.mkdirAll(v, p.parent(), Attrs{}); err != nil {
			return nil, err
		}
	}
	var e *Entry
	err = m.withParent(v, p, func(dir int, name string) error {
		flags := unix.O_WRONLY | unix.O_CREAT | unix.O_TRUNC | unix.O_NOFOLLOW | unix.O_CLOEXEC
		if force != nil && !*force {
			flags |= unix.O_EXCL
		}
		mode := uint32(0o644)
		if a.Mode != nil {
			mode = *a.Mode & 0o7777
		}
		fd, err := unix.Openat(dir, name, flags, mode)
		if err != nil {
			return pathError(p, err)
		}
		f := os.NewFile(uintptr(fd), p.abs())
		defer f.Close()
		if err := applyAttrs(fd, a); err != nil {
			return pathError(p, err)
		}
		if _, err := io.Copy(f, r); err != nil {
			var pe *os.PathError
			if errors.As(err, &pe) {
				return pathError(p, pe.Err)
			}
			return err // the request body
		}
		if err := f.Close(); err != nil {
			return pathError(p, err)
		}
		e, err = statEntry(dir, name, p)
		return err
	})
	return e, err
}

func applyAttrs(fd int, a Attrs) error {
	if a.UID != nil || a.GID != nil {
		uid, gid := -1, -1
		if a.UID != nil {
			uid = int(*a.UID)
		}
		if a.GID != nil {
			gid = int(*a.GID)
		}
		if err := unix.Fchown(fd, uid, gid); err != nil {
			return err
		}
	}
	if a.Mode != nil {
		// After chown, which clears setuid/setgid.
		if err := unix.Fchmod(fd, *a.Mode&0o7777); err != nil {
			return err
		}
	}
	return nil
}

// MakeDir creates directory p; with force its missing parents too, and an existing directory
// is not an error.
func (m *Manager) MakeDir(v *Volume, path string, a Attrs, force bool) (*Entry, error) {
	p, err := cleanPath(path)
	if err != nil {
		return nil, err
	}
	if p.isRoot() {
		return nil, errorf(errdefs.ErrConflict, "the volume's root already exists")
	}
	if force {
		return m.mkdirAll(v, p, a)
	}
	var e *Entry
	err = m.withParent(v, p, func(dir int, name string) error {
		if err := unix.Mkdirat(dir, name, 0o755); err != nil {
			return pathError(p, err)
		}
		if err := setAttrsAt(dir, name, a); err != nil {
			return pathError(p, err)
		}
		e, err = statEntry(dir, name, p)
		return err
	})
	return e, err
}

// mkdirAll creates p and its missing parents, one component at a time beneath the root; the
// attributes go to the directories it creates.
func (m *Manager) mkdirAll(v *Volume, p vpath, a Attrs) (*Entry, error) {
	root, err := m.openRoot(v)
	if err != nil {
		return nil, err
	}
	dir := root
	defer func() { unix.Close(dir) }()
	for i, c := range p.comps {
		sub := vpath{comps: p.comps[:i+1]}
		created := true
		if err := unix.Mkdirat(dir, c, 0o755); err != nil {
			if !errors.Is(err, unix.EEXIST) {
				return nil, pathError(sub, err)
			}
			created = false
		}
		if created {
			if err := setAttrsAt(dir, c, a); err != nil {
				return nil, pathError(sub, err)
			}
		}
		if i == len(p.comps)-1 {
			e, err := statEntry(dir, c, sub)
			if err == nil && e.Type != TypeDirectory {
				err = errorf(errdefs.ErrConflict, "path '%s' exists and is not a directory", sub.abs())
			}
			return e, err
		}
		next, err := unix.Openat2(dir, c, &unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC, Resolve: resolveBeneath | unix.RESOLVE_NO_SYMLINKS})
		if err != nil {
			return nil, pathError(sub, err)
		}
		unix.Close(dir)
		dir = next
	}
	return nil, nil // not reached: p has components
}

// setAttrsAt sets a on name in dir without following a symlink: the entry is opened with
// O_NOFOLLOW (a symlink fails with ELOOP) and changed through its descriptor.
func setAttrsAt(dir int, name string, a Attrs) error {
	if a.UID == nil && a.GID == nil && a.Mode == nil {
		return nil
	}
	fd, err := unix.Openat(dir, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return applyAttrs(fd, a)
}

// SetAttrs changes p's owner and mode (E2B's metadata update).
func (m *Manager) SetAttrs(v *Volume, path string, a Attrs) (*Entry, error) {
	p, err := cleanPath(path)
	if err != nil {
		return nil, err
	}
	var e *Entry
	err = m.withParent(v, p, func(dir int, name string) error {
		if err := setAttrsAt(dir, name, a); err != nil {
			return pathError(p, err)
		}
		e, err = statEntry(dir, name, p)
		return err
	})
	return e, err
}

// Remove deletes p; a directory with everything in it.
func (m *Manager) Remove(v *Volume, path string) error {
	p, err := cleanPath(path)
	if err != nil {
		return err
	}
	return m.withParent(v, p, func(dir int, name string) error {
		err := unix.Unlinkat(dir, name, 0)
		if errors.Is(err, unix.EISDIR) {
			err = removeAllAt(dir, name)
		}
		if err != nil {
			return pathError(p, err)
		}
		return nil
	})
}

// removeAllAt removes directory name in dir and everything under it, never following a link.
func removeAllAt(dir int, name string) error {
	fd, err := unix.Openat(dir, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	f := os.NewFile(uintptr(fd), name)
	defer f.Close()
	for {
		names, err := f.Readdirnames(256)
		for _, n := range names {
			e := unix.Unlinkat(fd, n, 0)
			if errors.Is(e, unix.EISDIR) {
				e = removeAllAt(fd, n)
			}
			if e != nil && !errors.Is(e, unix.ENOENT) {
				return e
			}
		}
		if err == io.EOF || len(names) == 0 {
			break
		}
		if err != nil {
			return err
		}
	}
	return unix.Unlinkat(dir, name, unix.AT_REMOVEDIR)
}

// ListDir returns the entries of directory p, to depth levels (1: its own entries).
func (m *Manager) ListDir(v *Volume, path string, depth int) ([]Entry, error) {
	p, err := cleanPath(path)
	if err != nil {
		return nil, err
	}
	if depth < 1 {
		depth = 1
	}
	root, err := m.openRoot(v)
	if err != nil {
		return nil, err
	}
	defer unix.Close(root)
	fd, err := openBeneath(root, p, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		return nil, pathError(p, err)
	}
	out := []Entry{}
	err = listAt(fd, p, depth, &out)
	return out, err
}

// listAt appends the entries of the open directory fd (closed here) at p.
func listAt(fd int, p vpath, depth int, out *[]Entry) error {
	f := os.NewFile(uintptr(fd), p.abs())
	defer f.Close()
	names, err := f.Readdirnames(-1)
	if err != nil {
		return pathError(p, err)
	}
	for _, n := range names {
		sub := vpath{comps: append(append([]string(nil), p.comps...), n)}
		e, err := statEntry(fd, n, sub)
		if err != nil {
			continue // removed meanwhile
		}
		*out = append(*out, *e)
		if e.Type == TypeDirectory && depth > 1 {
			cfd, err := unix.Openat(fd, n, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
			if err != nil {
				continue
			}
			if err := listAt(cfd, sub, depth-1, out); err != nil {
				return err
			}
		}
	}
	return nil
}
