package image

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// overlayfs's xattrs in an upper directory: opaque marks a directory whose lower contents are
// hidden; metacopy a file whose data is in a lower layer; redirect a directory renamed from
// elsewhere in the lower layers.
const (
	overlayOpaque   = "trusted.overlay.opaque"
	overlayMetacopy = "trusted.overlay.metacopy"
	overlayRedirect = "trusted.overlay.redirect"
)

// FromUpper makes the overlayfs upper directory upper (a sandbox's writable layer, no longer
// mounted) into a layer Compose can stack, in the layer format the image store writes: its
// whiteouts (0:0 character devices) and opaque directories (trusted.overlay.opaque=y) stay,
// recorded in Meta.Whiteouts and Meta.Opaque; overlayfs's other private xattrs (origin,
// impure, ...) go; other device nodes and sockets are removed (Meta.Skipped). Paths in Meta
// are relative to upper. Bytes counts regular files' content. An upper whose entries depend
// on the lower layers (metacopy files, redirected directories) is refused.
func FromUpper(upper string) (Meta, error) {
	var m Meta
	err := filepath.WalkDir(upper, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(upper, p)
		if rel == "." {
			return stripOverlayXattrs(p)
		}
		rel = filepath.ToSlash(rel)
		m.Entries++
		for _, x := range []string{overlayMetacopy, overlayRedirect} {
			if _, err := getXattr(p, x); err == nil {
				// The entry's data or contents are still in the lower layers, under a path the
				// xattr names: stacked elsewhere it would be empty. Refuse rather than lose it.
				return fmt.Errorf("/%s holds %s (overlayfs metacopy or redirect_dir is on): its data stays in the lower layer; mount the sandbox layers with metacopy=off,redirect_dir=off: %w", rel, x, errdefs.ErrInvalid)
			}
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFDIR:
			opaque := false
			if v, err := getXattr(p, overlayOpaque); err == nil && v == "y" {
				m.Opaque = append(m.Opaque, rel)
				opaque = true
			}
			if err := stripOverlayXattrs(p); err != nil {
				return err
			}
			if opaque {
				if err := unix.Lsetxattr(p, overlayOpaque, []byte("y"), 0); err != nil {
					return fmt.Errorf("keep /%s opaque: %w", rel, err)
				}
			}
			return nil
		case unix.S_IFCHR:
			if st.Rdev == 0 {
				m.Whiteouts = append(m.Whiteouts, rel)
				return stripOverlayXattrs(p)
			}
			m.Skipped = append(m.Skipped, rel)
			return os.Remove(p)
		case unix.S_IFBLK, unix.S_IFSOCK:
			m.Skipped = append(m.Skipped, rel)
			return os.Remove(p)
		case unix.S_IFREG:
			m.Bytes += st.Size
			return stripOverlayXattrs(p)
		}
		return nil
	})
	if err != nil {
		return m, fmt.Errorf("layer from %s: %w", upper, err)
	}
	return m, nil
}

func getXattr(p, name string) (string, error) {
	buf := make([]byte, 64)
	n, err := unix.Lgetxattr(p, name, buf)
	if err != nil {
		return "", err
	}
	return string(buf[:n]), nil
}

// stripOverlayXattrs removes overlayfs's private xattrs (opaque, origin, redirect, ...) of p:
// stacked as a lower layer they would mean something else to the next overlay mount.
func stripOverlayXattrs(p string) error {
	sz, err := unix.Llistxattr(p, nil)
	if err != nil || sz == 0 {
		return nil
	}
	buf := make([]byte, sz)
	if sz, err = unix.Llistxattr(p, buf); err != nil {
		return nil
	}
	for _, name := range strings.Split(strings.TrimRight(string(buf[:sz]), "\x00"), "\x00") {
		if strings.HasPrefix(name, "trusted.overlay.") || strings.HasPrefix(name, "user.overlay.") {
			if err := unix.Lremovexattr(p, name); err != nil && err != unix.ENODATA {
				return fmt.Errorf("remove xattr %s of %s: %w", name, p, err)
			}
		}
	}
	return nil
}
