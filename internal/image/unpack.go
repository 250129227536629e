package image

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"path"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/overlayfs"
)

// Meta is what a layer says beyond its files: the whiteouts and opaque directories that hide
// lower layers' entries (also in the layer directory, in overlayfs's format), and hard links
// whose target lives in a lower layer. Paths are relative
// to the image root, cleaned, without a leading slash.
type Meta struct {
	Whiteouts []string `json:"whiteouts,omitempty"`
	Opaque    []string `json:"opaque,omitempty"`
	Links     []Link   `json:"links,omitempty"`
	// Skipped lists entries that were not written (device nodes, sockets).
	Skipped []string `json:"skipped,omitempty"`
	// Bytes is the file content written; Entries the number of tar entries.
	Bytes   int64 `json:"bytes"`
	Entries int   `json:"entries"`
	// Format is the store's layer format the directory was written in (LayerFormat).
	Format int `json:"format,omitempty"`
}

// Link is a hard link Name -> Target, both relative to the image root.
type Link struct {
	Name   string `json:"name"`
	Target string `json:"target"`
}

// Limits bound one layer's unpacked size. Zero means unlimited.
type Limits struct {
	MaxBytes   int64 // file content
	MaxEntries int   // tar entries
}

const (
	whiteoutPrefix = ".wh."
	opaqueMarker   = ".wh..wh..opq"
)

// resolveFlags keep every lookup under the layer root and refuse to cross any symlink, so
// nothing an entry names can lead a write outside the directory being unpacked.
const resolveFlags = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS

// Unpack writes the uncompressed layer tar r into root (an existing, empty directory) and
// returns the layer's Meta. The input is treated as hostile: names with `..` components or
// absolute names are refused, no lookup follows a symlink, hard links must point inside the
// layer (or, recorded in Meta.Links, at a lower layer's file, resolved later the same way),
// device nodes are skipped and reported through logf, whiteouts and opaque directories are
// written in overlayfs's format (a 0:0 character device, the xattr trusted.overlay.opaque=y;
// the only device nodes Unpack makes) and recorded in Meta, and lim bounds the content. On error root may hold part of the layer; the caller
// owns removing it.
func Unpack(ctx context.Context, r io.Reader, root string, lim Limits, logf func(string)) (Meta, error) {
	if logf == nil {
		logf = func(string) {}
	}
	var meta Meta
	rootFD, err := unix.Open(root, unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err != nil {
		return meta, fmt.Errorf("open %s: %w", root, err)
	}
	defer unix.Close(rootFD)
	u := &unpacker{root: rootFD}
	tr := tar.NewReader(r)
	for {
		if err := ctx.Err(); err != nil {
			return meta, err
		}
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return meta, fmt.Errorf("read layer tar: %w: %w", err, errdefs.ErrInvalid)
		}
		meta.Entries++
		if lim.MaxEntries > 0 && meta.Entries > lim.MaxEntries {
			return meta, fmt.Errorf("layer has more than %d entries: %w", lim.MaxEntries, errdefs.ErrExhausted)
		}
		name, err := cleanName(hdr.Name)
		if err != nil {
			return meta, err
		}
		if name == "" {
			continue // the layer root itself
		}
		dir, base := path.Split(name)
		dir = strings.TrimSuffix(dir, "/")
		if base == opaqueMarker {
			meta.Opaque = append(meta.Opaque, dir)
			fd, err := u.mkdirAll(dir)
			if err != nil {
				return meta, fmt.Errorf("entry %q: %w", hdr.Name, err)
			}
			if dir != "" { // the layer root is always merged with the layers below
				err = unix.Fsetxattr(fd, overlayfs.OpaqueXattr, []byte("y"), 0)
			}
			unix.Close(fd)
			if err != nil {
				return meta, fmt.Errorf("entry %q: opaque directory: %w", hdr.Name, err)
			}
			continue
		}
		if strings.HasPrefix(base, whiteoutPrefix) {
			target := strings.TrimPrefix(base, whiteoutPrefix)
			if target == "" || target == "." || target == ".." || strings.HasPrefix(target, whiteoutPrefix) {
				return meta, fmt.Errorf("layer entry %q: whiteout of %q: %w", hdr.Name, target, errdefs.ErrInvalid)
			}
			meta.Whiteouts = append(meta.Whiteouts, path.Join(dir, target))
			parent, err := u.mkdirAll(dir)
			if err != nil {
				return meta, fmt.Errorf("entry %q: %w", hdr.Name, err)
			}
			err = whiteout(parent, target)
			unix.Close(parent)
			if err != nil {
				return meta, fmt.Errorf("entry %q: whiteout: %w", hdr.Name, err)
			}
			continue
		}
		switch hdr.Typeflag {
		case tar.TypeChar, tar.TypeBlock, tar.TypeFifo:
			if hdr.Typeflag != tar.TypeFifo {
				meta.Skipped = append(meta.Skipped, name)
				logf(fmt.Sprintf("skipped device node /%s", name))
				continue
			}
		case tar.TypeReg, tar.TypeDir, tar.TypeSymlink, tar.TypeLink:
		case tar.TypeXGlobalHeader:
			continue
		default:
			meta.Skipped = append(meta.Skipped, name)
			logf(fmt.Sprintf("skipped /%s (tar type %q)", name, hdr.Typeflag))
			continue
		}
		if hdr.Typeflag == tar.TypeReg {
			if hdr.Size < 0 || (lim.MaxBytes > 0 && meta.Bytes+hdr.Size > lim.MaxBytes) {
				return meta, fmt.Errorf("layer content exceeds the limit of %d bytes at /%s: %w", lim.MaxBytes, name, errdefs.ErrExhausted)
			}
			meta.Bytes += hdr.Size
		}
		parent, err := u.mkdirAll(dir)
		if err != nil {
			return meta, fmt.Errorf("entry %q: %w", hdr.Name, err)
		}
		err = u.entry(parent, base, name, hdr, tr, &meta)
		unix.Close(parent)
		if err != nil {
			return meta, fmt.Errorf("entry %q: %w", hdr.Name, err)
		}
	}
	// Directory times last: writing into a directory changes its mtime. A later entry may have
	// replaced a directory on the way with a symlink: the parent is opened beneath the root
	// without following any, and the time set on the entry itself (not what it points to).
	for _, d := range u.dirTimes {
		ts := []unix.Timespec{unix.NsecToTimespec(d.mtime), unix.NsecToTimespec(d.mtime)}
		if d.name == "" {
			continue
		}
		dir, base := path.Split(d.name)
		parent, err := openBeneath(rootFD, strings.TrimSuffix(dir, "/"))
		if err != nil {
			continue // no longer a directory there
		}
		_ = unix.UtimesNanoAt(parent, base, ts, unix.AT_SYMLINK_NOFOLLOW)
		unix.Close(parent)
	}
	return meta, nil
}

// whiteout writes an overlay whiteout of name in parent, unless the layer itself has an entry
// there: a layer's own entry wins over its whiteout of the same name, whichever comes first,
// and a directory of its own then hides the lower layers' (opaque), as when the whiteout hid
// them before the layer's entries were added.
func whiteout(parent int, name string) error {
	var st unix.Stat_t
	if err := unix.Fstatat(parent, name, &st, unix.AT_SYMLINK_NOFOLLOW); err == nil {
		if st.Mode&unix.S_IFMT == unix.S_IFDIR {
			return setOpaque(parent, name)
		}
		return nil
	} else if err != unix.ENOENT {
		return err
	}
	return unix.Mknodat(parent, name, unix.S_IFCHR|0o600, 0)
}

// setOpaque marks the directory name in parent opaque (never following a symlink).
func setOpaque(parent int, name string) error {
	fd, err := unix.Openat2(parent, name, &unix.OpenHow{Flags: unix.O_DIRECTORY | unix.O_RDONLY | unix.O_CLOEXEC, Resolve: resolveFlags})
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.Fsetxattr(fd, overlayfs.OpaqueXattr, []byte("y"), 0)
}

// cleanName turns a tar entry name into a path relative to the root, refusing absolute names
// and any `..` component.
func cleanName(name string) (string, error) {
	if strings.HasPrefix(name, "/") {
		return "", fmt.Errorf("layer entry %q: absolute name: %w", name, errdefs.ErrInvalid)
	}
	for _, el := range strings.Split(name, "/") {
		if el == ".." {
			return "", fmt.Errorf("layer entry %q: `..` in name: %w", name, errdefs.ErrInvalid)
		}
	}
	if strings.ContainsRune(name, 0) {
		return "", fmt.Errorf("layer entry %q: NUL in name: %w", name, errdefs.ErrInvalid)
	}
	p := path.Clean(name)
	if p == "." {
		return "", nil
	}
	return p, nil
}

// entryPath checks a path from a layer's Meta: relative, clean, no `..`, and (unless rootOK)
// not the root itself.
func entryPath(p string, rootOK bool) error {
	if p == "" {
		if rootOK {
			return nil
		}
		return fmt.Errorf("empty path: %w", errdefs.ErrInvalid)
	}
	if strings.HasPrefix(p, "/") || path.Clean(p) != p || p == "." {
		return fmt.Errorf("path %q is not clean and relative: %w", p, errdefs.ErrInvalid)
	}
	for _, el := range strings.Split(p, "/") {
		if el == ".." {
			return fmt.Errorf("path %q: `..`: %w", p, errdefs.ErrInvalid)
		}
	}
	return nil
}

type dirTime struct {
	name  string
	mtime int64
}

type unpacker struct {
	root     int
	dirTimes []dirTime
}

// openBeneath opens the directory rel under the root without following any symlink.
func openBeneath(root int, rel string) (int, error) {
	if rel == "" {
		rel = "."
	}
	for {
		fd, err := unix.Openat2(root, rel, &unix.OpenHow{
			Flags:   unix.O_DIRECTORY | unix.O_RDONLY | unix.O_CLOEXEC,
			Resolve: resolveFlags,
		})
		if err == unix.EINTR || err == unix.EAGAIN {
			continue
		}
		return fd, err
	}
}

// mkdirAll opens directory rel under the root, creating missing components (0755, root-owned)
// one at a time. A component that is a symlink or not a directory is an error.
func (u *unpacker) mkdirAll(rel string) (int, error) {
	fd, err := openBeneath(u.root, rel)
	if err == nil {
		return fd, nil
	}
	if err != unix.ENOENT {
		return -1, pathError(rel, err)
	}
	cur, err := unix.Dup(u.root)
	if err != nil {
		return -1, err
	}
	if rel == "" {
		return cur, nil
	}
	for _, el := range strings.Split(rel, "/") {
		if err := unix.Mkdirat(cur, el, 0o755); err != nil && err != unix.EEXIST {
			unix.Close(cur)
			return -1, pathError(rel, err)
		}
		next, err := unix.Openat2(cur, el, &unix.OpenHow{Flags: unix.O_DIRECTORY | unix.O_RDONLY | unix.O_CLOEXEC, Resolve: resolveFlags})
		unix.Close(cur)
		if err != nil {
			return -1, pathError(rel, err)
		}
		cur = next
	}
	return cur, nil
}

func pathError(rel string, err error) error {
	switch err {
	case unix.ELOOP, unix.EXDEV:
		return fmt.Errorf("/%s: path crosses a symlink: %w", rel, errdefs.ErrInvalid)
	case unix.ENOTDIR:
		return fmt.Errorf("/%s: a parent is not a directory: %w", rel, errdefs.ErrInvalid)
	}
	return fmt.Errorf("/%s: %w", rel, err)
}

// clear removes whatever is at base in parent, unless it is a directory and keepDir is set.
func clear(parent int, base string, keepDir bool) error {
	var st unix.Stat_t
	if err := unix.Fstatat(parent, base, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		if err == unix.ENOENT {
			return nil
		}
		return err
	}
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		if keepDir {
			return nil
		}
		return removeAllAt(parent, base)
	}
	return unix.Unlinkat(parent, base, 0)
}

// removeAllAt removes base (a file or a whole tree) under parent without following symlinks.
func removeAllAt(parent int, base string) error {
	if base == "" || base == "." || base == ".." || strings.Contains(base, "/") {
		return fmt.Errorf("remove %q: not a name in its directory: %w", base, errdefs.ErrInvalid)
	}
	err := unix.Unlinkat(parent, base, 0)
	if err == nil || err == unix.ENOENT {
		return nil
	}
	if err != unix.EISDIR && err != unix.EPERM {
		return err
	}
	fd, err := unix.Openat(parent, base, unix.O_DIRECTORY|unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	if err := removeChildren(fd); err != nil {
		unix.Close(fd)
		return err
	}
	unix.Close(fd)
	return unix.Unlinkat(parent, base, unix.AT_REMOVEDIR)
}

// removeChildren empties the directory open at fd.
func removeChildren(fd int) error {
	for {
		names, err := readNames(fd)
		if err != nil {
			return err
		}
		if len(names) == 0 {
			return nil
		}
		for _, n := range names {
			if err := removeAllAt(fd, n); err != nil {
				return err
			}
		}
	}
}

func readNames(fd int) ([]string, error) {
	dup, err := unix.Openat(fd, ".", unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer unix.Close(dup)
	var names []string
	buf := make([]byte, 32*1024)
	for {
		n, err := unix.ReadDirent(dup, buf)
		if err != nil {
			return nil, err
		}
		if n == 0 {
			return names, nil
		}
		_, _, names = unix.ParseDirent(buf[:n], -1, names)
	}
}

func (u *unpacker) entry(parent int, base, name string, hdr *tar.Header, r io.Reader, meta *Meta) error {
	mode := uint32(hdr.Mode) & 0o7777
	switch hdr.Typeflag {
	case tar.TypeDir:
		var old unix.Stat_t
		replacesWhiteout := unix.Fstatat(parent, base, &old, unix.AT_SYMLINK_NOFOLLOW) == nil && overlayfs.IsWhiteout(&old)
		if err := clear(parent, base, true); err != nil {
			return err
		}
		if err := unix.Mkdirat(parent, base, 0o700); err != nil && err != unix.EEXIST {
			return err
		}
		if replacesWhiteout {
			if err := setOpaque(parent, base); err != nil {
				return err
			}
		}
		fd, err := unix.Openat2(parent, base, &unix.OpenHow{Flags: unix.O_DIRECTORY | unix.O_RDONLY | unix.O_CLOEXEC, Resolve: resolveFlags})
		if err != nil {
			return pathError(name, err)
		}
		defer unix.Close(fd)
		if err := fdAttrs(fd, hdr, mode); err != nil {
			return err
		}
		u.dirTimes = append(u.dirTimes, dirTime{name: name, mtime: hdr.ModTime.UnixNano()})
		return nil
	case tar.TypeReg:
		if err := clear(parent, base, false); err != nil {
			return err
		}
		fd, err := unix.Openat(parent, base, unix.O_CREAT|unix.O_EXCL|unix.O_WRONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return err
		}
		f := fdFile{fd}
		n, err := io.Copy(f, io.LimitReader(r, hdr.Size))
		if err == nil && n != hdr.Size {
			err = fmt.Errorf("short file: %d of %d bytes: %w", n, hdr.Size, errdefs.ErrInvalid)
		}
		if err == nil {
			err = fdAttrs(fd, hdr, mode)
		}
		if err == nil {
			ts := []unix.Timespec{unix.NsecToTimespec(hdr.ModTime.UnixNano()), unix.NsecToTimespec(hdr.ModTime.UnixNano())}
			err = unix.UtimesNanoAt(parent, base, ts, unix.AT_SYMLINK_NOFOLLOW)
		}
		unix.Close(fd)
		return err
	case tar.TypeSymlink:
		if err := clear(parent, base, false); err != nil {
			return err
		}
		if err := unix.Symlinkat(hdr.Linkname, parent, base); err != nil {
			return err
		}
		if err := unix.Fchownat(parent, base, hdr.Uid, hdr.Gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
		ts := []unix.Timespec{unix.NsecToTimespec(hdr.ModTime.UnixNano()), unix.NsecToTimespec(hdr.ModTime.UnixNano())}
		return unix.UtimesNanoAt(parent, base, ts, unix.AT_SYMLINK_NOFOLLOW)
	case tar.TypeFifo:
		if err := clear(parent, base, false); err != nil {
			return err
		}
		if err := unix.Mkfifoat(parent, base, 0o600); err != nil {
			return err
		}
		fd, err := unix.Openat(parent, base, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		if err := unix.Fchownat(parent, base, hdr.Uid, hdr.Gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
		return unix.Fchmodat(parent, base, mode, 0)
	case tar.TypeLink:
		target, err := cleanName(hdr.Linkname)
		if err != nil {
			return fmt.Errorf("hard link target: %w", err)
		}
		if target == "" {
			return fmt.Errorf("hard link to the root: %w", errdefs.ErrInvalid)
		}
		if err := clear(parent, base, false); err != nil {
			return err
		}
		ok, err := linkBeneath(u.root, target, parent, base)
		if err != nil {
			return fmt.Errorf("hard link to /%s: %w", target, err)
		}
		if !ok {
			meta.Links = append(meta.Links, Link{Name: name, Target: target})
		}
		return nil
	}
	return nil
}

// linkBeneath hard-links target (relative to root, resolved without following symlinks) as
// base in newParent. It reports false, nil when target does not exist under root. A target
// that is a directory, or one reached through a symlink, is refused.
func linkBeneath(root int, target string, newParent int, base string) (bool, error) {
	tdir, tbase := path.Split(target)
	tfd, err := openBeneath(root, strings.TrimSuffix(tdir, "/"))
	if err == unix.ENOENT {
		return false, nil
	}
	if err != nil {
		return false, pathError(target, err)
	}
	defer unix.Close(tfd)
	var st unix.Stat_t
	if err := unix.Fstatat(tfd, tbase, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		if err == unix.ENOENT {
			return false, nil
		}
		return false, err
	}
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		return false, fmt.Errorf("target is a directory: %w", errdefs.ErrInvalid)
	}
	// flags 0: a symlink target is linked itself, never followed.
	if err := unix.Linkat(tfd, tbase, newParent, base, 0); err != nil {
		return false, err
	}
	return true, nil
}

// fdAttrs sets ownership, mode (after chown, which clears set-id bits) and xattrs on fd.
func fdAttrs(fd int, hdr *tar.Header, mode uint32) error {
	if err := unix.Fchown(fd, hdr.Uid, hdr.Gid); err != nil {
		return err
	}
	if err := unix.Fchmod(fd, mode); err != nil {
		return err
	}
	for k, v := range hdr.PAXRecords {
		name, ok := strings.CutPrefix(k, "SCHILY.xattr.")
		if !ok || !allowedXattr(name) {
			continue
		}
		if err := unix.Fsetxattr(fd, name, []byte(v), 0); err != nil && !errors.Is(err, unix.ENOTSUP) {
			return fmt.Errorf("xattr %s: %w", name, err)
		}
	}
	return nil
}

// allowedXattr keeps user attributes and file capabilities; trusted.* (overlayfs's own
// markers among them) and security labels of the image's host are not applied.
func allowedXattr(name string) bool {
	return strings.HasPrefix(name, "user.") || name == "security.capability"
}

type fdFile struct{ fd int }

func (f fdFile) Write(p []byte) (int, error) {
	n := 0
	for n < len(p) {
		m, err := unix.Write(f.fd, p[n:])
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return n, err
		}
		n += m
	}
	return n, nil
}
