package envd

import (
	"errors"
	"fmt"
	"net/http"
	"os"
	"strings"
	"unicode/utf8"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// File metadata (envd >= 0.6.2) lives in extended attributes under metadataPrefix, so it moves
// with the file on rename and anything in the sandbox can read or set it (setfattr, os.setxattr).
// The `user.` namespace is the one unprivileged processes may use; `e2b.` keeps other tools'
// user xattrs out of the metadata.
const metadataPrefix = "user.e2b."

// metadataHeaderPrefix starts the upload headers that carry metadata: X-Metadata-<key>: <value>.
const metadataHeaderPrefix = "X-Metadata-"

// Limits: the whole xattr name is at most 255 bytes (VFS); the set is kept within one 4 KiB
// block, which is what ext4 can hold per inode.
const (
	maxMetadataKeyLen   = 255 - len(metadataPrefix)
	maxMetadataTotalLen = 4096
)

// metadataFromHeaders collects X-Metadata-* headers, keys lower-cased (HTTP header names are
// case-insensitive, so the stored key must not depend on the client's spelling). Of repeated
// headers the first value wins; an empty key is dropped.
func metadataFromHeaders(h http.Header) map[string]string {
	var md map[string]string
	for name, values := range h {
		if len(name) <= len(metadataHeaderPrefix) || !strings.EqualFold(name[:len(metadataHeaderPrefix)], metadataHeaderPrefix) {
			continue
		}
		if len(values) == 0 {
			continue
		}
		if md == nil {
			md = map[string]string{}
		}
		md[strings.ToLower(name[len(metadataHeaderPrefix):])] = values[0]
	}
	return md
}

// validateMetadata refuses metadata the xattrs cannot hold, before any file is touched.
func validateMetadata(md map[string]string) error {
	total := 0
	for k, v := range md {
		if k == "" {
			return errorf(errdefs.ErrInvalid, "metadata key must not be empty")
		}
		if len(k) > maxMetadataKeyLen {
			return errorf(errdefs.ErrInvalid, "metadata key %q exceeds %d bytes", k, maxMetadataKeyLen)
		}
		if i := nonPrintable(k); i >= 0 {
			return errorf(errdefs.ErrInvalid, "metadata key %q contains a non-printable-ASCII byte at offset %d", k, i)
		}
		if i := nonPrintable(v); i >= 0 {
			return errorf(errdefs.ErrInvalid, "metadata value for key %q contains a non-printable-ASCII byte at offset %d", k, i)
		}
		total += len(metadataPrefix) + len(k) + len(v)
	}
	if total > maxMetadataTotalLen {
		return errorf(errdefs.ErrInvalid, "total metadata size %d exceeds %d bytes", total, maxMetadataTotalLen)
	}
	return nil
}

func nonPrintable(s string) int {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return i
		}
	}
	return -1
}

// xattrUnsupported: the filesystem has no extended attributes (procfs, sysfs, some FUSE).
func xattrUnsupported(err error) bool {
	return errors.Is(err, unix.ENOTSUP) || errors.Is(err, unix.EOPNOTSUPP)
}

// readMetadata returns the user.e2b.* xattrs of path (following a final symlink) with the
// prefix stripped, or nil when there are none or the filesystem has no xattrs. Values set from
// inside the sandbox can be any bytes; those that are not UTF-8 are skipped, since protobuf
// strings must be valid UTF-8 and one bad value must not fail a whole listing.
func readMetadata(path string) map[string]string {
	names, err := listXattrs(path)
	if err != nil {
		return nil
	}
	var md map[string]string
	for _, name := range names {
		key, ok := strings.CutPrefix(name, metadataPrefix)
		if !ok || key == "" {
			continue
		}
		val, err := getXattr(path, name)
		if err != nil || !utf8.ValidString(key) || !utf8.Valid(val) {
			continue
		}
		if md == nil {
			md = map[string]string{}
		}
		md[key] = string(val)
	}
	return md
}

func listXattrs(path string) ([]string, error) {
	return xattrNames(func(b []byte) (int, error) { return unix.Listxattr(path, b) })
}

func flistXattrs(fd int) ([]string, error) {
	return xattrNames(func(b []byte) (int, error) { return unix.Flistxattr(fd, b) })
}

// xattrNames calls a listxattr(2)-style list twice (size, then names) and splits the names.
func xattrNames(list func([]byte) (int, error)) ([]string, error) {
	for {
		n, err := list(nil)
		if err != nil || n == 0 {
			return nil, err
		}
		buf := make([]byte, n)
		n, err = list(buf)
		if errors.Is(err, unix.ERANGE) {
			continue // grew meanwhile
		}
		if err != nil {
			return nil, err
		}
		var names []string
		for _, s := range strings.Split(string(buf[:n]), "\x00") {
			if s != "" {
				names = append(names, s)
			}
		}
		return names, nil
	}
}

func getXattr(path, name string) ([]byte, error) {
	for {
		n, err := unix.Getxattr(path, name, nil)
		if err != nil {
			return nil, err
		}
		buf := make([]byte, n)
		n, err = unix.Getxattr(path, name, buf)
		if errors.Is(err, unix.ERANGE) {
			continue
		}
		if err != nil {
			return nil, err
		}
		return buf[:n], nil
	}
}

// replaceMetadata makes md the file's whole metadata: user.e2b.* xattrs not in md are removed
// (an overwritten file keeps its xattrs across O_TRUNC, and stale metadata must not survive an
// upload), the rest set. On a filesystem without xattrs, clearing is a no-op and setting fails.
func replaceMetadata(f *os.File, md map[string]string) error {
	fd := int(f.Fd())
	existing, err := flistXattrs(fd)
	switch {
	case err != nil && len(md) == 0:
		return nil // nothing to set; a file that cannot list xattrs (a device, procfs) has none
	case err != nil && xattrUnsupported(err):
		return errorf(errdefs.ErrInvalid, "the filesystem of '%s' does not support file metadata (extended attributes)", f.Name())
	case err != nil:
		return fmt.Errorf("list xattrs of %s: %w", f.Name(), err)
	}
	for _, name := range existing {
		key, ok := strings.CutPrefix(name, metadataPrefix)
		if !ok {
			continue
		}
		if _, keep := md[key]; keep {
			continue
		}
		if err := unix.Fremovexattr(fd, name); err != nil && !errors.Is(err, unix.ENODATA) {
			return fmt.Errorf("remove xattr %s of %s: %w", name, f.Name(), err)
		}
	}
	for k, v := range md {
		if err := unix.Fsetxattr(fd, metadataPrefix+k, []byte(v), 0); err != nil {
			if xattrUnsupported(err) {
				return errorf(errdefs.ErrInvalid, "the filesystem of '%s' does not support file metadata (extended attributes)", f.Name())
			}
			return fmt.Errorf("set xattr %s of %s: %w", metadataPrefix+k, f.Name(), err)
		}
	}
	return nil
}
