package image

import (
	"context"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// ComposeStats counts what Compose made.
type ComposeStats struct {
	Dirs, Links int
}

// Compose writes into dest (an existing, empty directory) the merged tree of layers, bottom
// layer first: each layer's whiteouts and opaque directories hide what lower layers put there,
// then its entries are added. Directories are created (with the topmost layer's owner, mode,
// xattrs and time); every other entry is a hard link to the layer's own inode, so the layer's
// bytes are shared, never copied. dest must be on the layers' filesystem. Nothing in dest is
// ever written through: a later entry replaces the link, it does not open it. Lookups in dest
// never follow symlinks (an image's symlinks point anywhere on the host).
func Compose(ctx context.Context, dest string, layers []LayerDir) (ComposeStats, error) {
	var st ComposeStats
	root, err := unix.Open(dest, unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err != nil {
		return st, fmt.Errorf("open %s: %w", dest, err)
	}
	defer unix.Close(root)
	times := map[string]unix.Timespec{}
	for _, l := range layers {
		if err := ctx.Err(); err != nil {
			return st, err
		}
		short := strings.TrimPrefix(l.Digest, "sha256:")
		if len(short) > 12 {
			short = short[:12]
		}
		if err := checkMeta(l.Meta); err != nil {
			return st, fmt.Errorf("layer %s: %w", short, err)
		}
		for _, d := range l.Meta.Opaque {
			fd, err := openBeneath(root, d)
			if err != nil {
				continue // nothing below to hide, or hidden behind a symlink: nothing to do
			}
			err = removeChildren(fd)
			unix.Close(fd)
			if err != nil {
				return st, fmt.Errorf("layer %s: opaque /%s: %w", short, d, err)
			}
		}
		for _, w := range l.Meta.Whiteouts {
			dir, base := path.Split(w)
			fd, err := openBeneath(root, strings.TrimSuffix(dir, "/"))
			if err != nil {
				continue
			}
			err = removeAllAt(fd, base)
			unix.Close(fd)
			if err != nil {
				return st, fmt.Errorf("layer %s: whiteout /%s: %w", short, w, err)
			}
		}
		src := l.RootDir()
		err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			rel, _ := filepath.Rel(src, p)
			if rel == "." {
				return nil
			}
			dir, base := path.Split(filepath.ToSlash(rel))
			parent, err := openBeneath(root, strings.TrimSuffix(dir, "/"))
			if err != nil {
				return pathError(rel, err)
			}
			defer unix.Close(parent)
			if d.IsDir() {
				var sst unix.Stat_t
				if err := unix.Lstat(p, &sst); err != nil {
					return err
				}
				if err := clear(parent, base, true); err != nil {
					return err
				}
				if err := unix.Mkdirat(parent, base, 0o700); err != nil && err != unix.EEXIST {
					return err
				} else if err == nil {
					st.Dirs++
				}
				fd, err := unix.Openat2(parent, base, &unix.OpenHow{Flags: unix.O_DIRECTORY | unix.O_RDONLY | unix.O_CLOEXEC, Resolve: resolveFlags})
				if err != nil {
					return pathError(rel, err)
				}
				defer unix.Close(fd)
				if err := unix.Fchown(fd, int(sst.Uid), int(sst.Gid)); err != nil {
					return err
				}
				if err := unix.Fchmod(fd, sst.Mode&0o7777); err != nil {
					return err
				}
				if err := copyXattrs(p, fd); err != nil {
					return err
				}
				times[rel] = sst.Mtim
				return nil
			}
			if err := clear(parent, base, false); err != nil {
				return err
			}
			err = unix.Linkat(unix.AT_FDCWD, p, parent, base, 0)
			if err == unix.EMLINK && d.Type().IsRegular() {
				// The layer's inode has as many links as its filesystem allows: this tree
				// gets its own copy.
				return copyInto(p, parent, base)
			}
			if err != nil {
				return fmt.Errorf("link /%s: %w", rel, err)
			}
			st.Links++
			return nil
		})
		if err != nil {
			return st, fmt.Errorf("layer %s: %w", short, err)
		}
		for _, ln := range l.Meta.Links {
			dir, base := path.Split(ln.Name)
			parent, err := openBeneath(root, strings.TrimSuffix(dir, "/"))
			if err != nil {
				return st, fmt.Errorf("layer %s: hard link /%s: %w", short, ln.Name, pathError(ln.Name, err))
			}
			if err := clear(parent, base, false); err != nil {
				unix.Close(parent)
				return st, err
			}
			ok, err := linkBeneath(root, ln.Target, parent, base)
			unix.Close(parent)
			if err != nil {
				return st, fmt.Errorf("layer %s: hard link /%s -> /%s: %w", short, ln.Name, ln.Target, err)
			}
			if !ok {
				return st, fmt.Errorf("layer %s: hard link /%s: target /%s is in no layer: %w", short, ln.Name, ln.Target, errdefs.ErrInvalid)
			}
			st.Links++
		}
	}
	for rel, ts := range times {
		_ = unix.UtimesNanoAt(root, rel, []unix.Timespec{ts, ts}, unix.AT_SYMLINK_NOFOLLOW)
	}
	if err := unix.Fchown(root, 0, 0); err != nil {
		return st, err
	}
	return st, unix.Fchmod(root, 0o755)
}

// copyXattrs copies the xattrs of the layer directory p (ember's own tree) onto fd.
func copyXattrs(p string, fd int) error {
	sz, err := unix.Llistxattr(p, nil)
	if err != nil || sz == 0 {
		return nil
	}
	buf := make([]byte, sz)
	sz, err = unix.Llistxattr(p, buf)
	if err != nil {
		return nil
	}
	for _, name := range strings.Split(strings.TrimRight(string(buf[:sz]), "\x00"), "\x00") {
		if !allowedXattr(name) {
			continue
		}
		vsz, err := unix.Lgetxattr(p, name, nil)
		if err != nil {
			continue
		}
		val := make([]byte, vsz)
		if vsz, err = unix.Lgetxattr(p, name, val); err != nil {
			continue
		}
		if err := unix.Fsetxattr(fd, name, val[:vsz], 0); err != nil {
			return fmt.Errorf("xattr %s: %w", name, err)
		}
	}
	return nil
}

// copyInto copies the layer file p (ember's own tree) as a new file base in parent, with its
// owner, mode, xattrs and times.
func copyInto(p string, parent int, base string) error {
	var sst unix.Stat_t
	if err := unix.Lstat(p, &sst); err != nil {
		return err
	}
	src, err := os.Open(p)
	if err != nil {
		return err
	}
	defer src.Close()
	fd, err := unix.Openat(parent, base, unix.O_CREAT|unix.O_EXCL|unix.O_WRONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if _, err := io.Copy(fdFile{fd}, src); err != nil {
		return err
	}
	if err := unix.Fchown(fd, int(sst.Uid), int(sst.Gid)); err != nil {
		return err
	}
	if err := unix.Fchmod(fd, sst.Mode&0o7777); err != nil {
		return err
	}
	if err := copyXattrs(p, fd); err != nil {
		return err
	}
	return unix.UtimesNanoAt(parent, base, []unix.Timespec{sst.Atim, sst.Mtim}, unix.AT_SYMLINK_NOFOLLOW)
}

// checkMeta refuses a Meta whose paths could name anything but an entry inside the tree.
func checkMeta(m Meta) error {
	for _, d := range m.Opaque {
		if err := entryPath(d, true); err != nil {
			return fmt.Errorf("opaque directory: %w", err)
		}
	}
	for _, w := range m.Whiteouts {
		if err := entryPath(w, false); err != nil {
			return fmt.Errorf("whiteout: %w", err)
		}
	}
	for _, l := range m.Links {
		if err := entryPath(l.Name, false); err != nil {
			return fmt.Errorf("hard link: %w", err)
		}
		if err := entryPath(l.Target, false); err != nil {
			return fmt.Errorf("hard link target: %w", err)
		}
	}
	return nil
}
