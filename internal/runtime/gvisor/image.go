package gvisor

// The driver's exported image format (ExportImage, ImportImage).
//
// An image directory (Checkpoint) holds runsc's memory image files (checkpoint.img, pages*.img:
// flat regular files) and, with host layers, the instance's writable layer at layer/upper: an
// overlayfs upper directory with whiteouts (char 0:0), opaque directories
// (trusted.overlay.opaque), other xattrs, owners, modes, times, hard links and symlinks.
//
// Exported, it is a flat set of regular files: the memory image files as they are (hard-linked,
// else reflinked or copied with their holes) and layer.tar, the layer as a POSIX (PAX) tar written with archive/tar.
// Sparse files keep their holes: a file whose data covers less than its size carries the
// records EMBER.sparse ("off:len,off:len,..." of its data extents, found with
// SEEK_DATA/SEEK_HOLE) and EMBER.size (its apparent size), and its tar data is the extents only,
// so a 16 TiB file that is one hole costs nothing to export or import.
//
// ImportImage treats its input as hostile (it may come from a shared bucket). Every path is
// created by *at system calls relative to a parent directory opened with openat2
// RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS|RESOLVE_NO_MAGICLINKS beneath the new upper directory, and
// every final component is created exclusively (O_EXCL, mkdirat, symlinkat, linkat, mknodat), so
// nothing outside imageDir is ever opened for writing and no symlink is followed. Accepted: regular
// files, directories, symlinks (created as links, never followed), hard links to regular files
// earlier in the same archive, and whiteouts (char 0:0). Refused: device nodes, fifos, sockets,
// absolute names, "..", duplicates, GNU sparse entries, malformed sparse maps, data over
// ImportOptions.MaxBytes, more than maxImportEntries entries. On error imageDir is removed.

import (
	"archive/tar"
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

const (
	layerArchiveName = "layer.tar"
	paxSparse        = "EMBER.sparse"
	paxSize          = "EMBER.size"
	paxXattr         = "SCHILY.xattr."
	// maxImageFiles bounds the memory image files of an imported image.
	maxImageFiles = 64
	// maxSparseExtents bounds a sparse map; Export merges extents across the smallest holes to
	// stay within it.
	maxSparseExtents = 4096
)

// maxImportEntries bounds the entries of an imported layer (a variable for tests).
var maxImportEntries = 1 << 20

// imageFileName is what a memory image file of runsc may be called.
var imageFileName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)

// xattrAllowed says which extended attributes a layer carries: user ones, the overlayfs one a
// sandbox's writes produce (opaque directories; the driver's mounts create no redirects, and a
// planted one would be followed), file capabilities and ACLs. Others are dropped.
func xattrAllowed(name string) bool {
	switch {
	case strings.HasPrefix(name, "user."):
		return true
	case name == "trusted.overlay.opaque":
		return true
	case name == "security.capability", name == "system.posix_acl_access", name == "system.posix_acl_default":
		return true
	}
	return false
}

// ExportImage implements runtime.Driver.
func (d *Driver) ExportImage(ctx context.Context, imageDir, dstDir string) error {
	ents, err := os.ReadDir(dstDir)
	if err != nil {
		return fmt.Errorf("gvisor: export: %w", err)
	}
	if len(ents) > 0 {
		return fmt.Errorf("gvisor: export: %s not empty: %w", dstDir, errdefs.ErrInvalid)
	}
	ents, err = os.ReadDir(imageDir)
	if err != nil {
		return fmt.Errorf("gvisor: export: %v: %w", err, errdefs.ErrNotFound)
	}
	fail := func(err error) error {
		if ents, rerr := os.ReadDir(dstDir); rerr == nil {
			for _, e := range ents {
				_ = os.RemoveAll(filepath.Join(dstDir, e.Name()))
			}
		}
		return err
	}
	for _, e := range ents {
		if err := ctx.Err(); err != nil {
			return fail(err)
		}
		name := e.Name()
		switch {
		case name == layerDirName && e.IsDir():
			// A disk-limited layer is an ext4 image: its files are exported, never the image
			// itself (a filesystem the host kernel would mount on import).
			// Mounted next to dstDir: a crash mid-export leaves the mount where the caller
			// cleans up the export's leftovers.
			err := DiskLayerFiles(imageDir, filepath.Dir(dstDir), func(upper string) error {
				return exportLayer(ctx, upper, filepath.Join(dstDir, layerArchiveName))
			})
			if err != nil {
				return fail(err)
			}
		case e.Type().IsRegular() && imageFileName.MatchString(name) && name != layerArchiveName:
			// Memory image files as they are: a hard link where possible (Checkpoint made them
			// 0600; nothing writes them again), else a reflink or a copy that keeps holes.
			src := filepath.Join(imageDir, name)
			if fi, err := os.Lstat(src); err == nil && fi.Mode().Perm() == 0o600 && os.Link(src, filepath.Join(dstDir, name)) == nil {
				continue
			}
			if err := copyFileSparse(src, dstDir, name, 0, nil); err != nil {
				return fail(fmt.Errorf("gvisor: export %s: %w", name, err))
			}
		case e.Type().IsRegular() && strings.HasPrefix(name, "."):
			// The caller's bookkeeping beside the image (a completeness marker), not part of it.
		default:
			return fail(fmt.Errorf("gvisor: export: unexpected entry %q in image %s: %w", name, imageDir, errdefs.ErrInvalid))
		}
	}
	return nil
}

// exportLayer writes the tree at upper into a new archive file dst (0600).
func exportLayer(ctx context.Context, upper, dst string) error {
	if fi, err := os.Lstat(upper); err != nil || !fi.IsDir() {
		return fmt.Errorf("gvisor: export: layer %s is not a directory: %w", upper, errdefs.ErrInvalid)
	}
	f, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("gvisor: export: %w", err)
	}
	defer f.Close()
	aw := &archiveWriter{bw: bufio.NewWriterSize(f, 1<<20)}
	tw := tar.NewWriter(aw)
	type inode struct{ dev, ino uint64 }
	links := map[inode]string{}
	err = filepath.WalkDir(upper, func(p string, de fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if p == upper {
			return nil
		}
		rel, err := filepath.Rel(upper, p)
		if err != nil {
			return err
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return fmt.Errorf("lstat %s: %w", p, err)
		}
		hdr := &tar.Header{
			Name: rel, Mode: int64(st.Mode & 0o7777), Uid: int(st.Uid), Gid: int(st.Gid),
			ModTime:    time.Unix(st.Mtim.Unix()),
			AccessTime: time.Unix(st.Atim.Unix()),
			Format:     tar.FormatPAX,
			PAXRecords: map[string]string{},
		}
		var data *os.File
		var extents [][2]int64
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFDIR:
			hdr.Typeflag, hdr.Name = tar.TypeDir, rel+"/"
		case unix.S_IFLNK:
			target, err := os.Readlink(p)
			if err != nil {
				return err
			}
			hdr.Typeflag, hdr.Linkname = tar.TypeSymlink, target
		case unix.S_IFCHR:
			if unix.Major(st.Rdev) != 0 || unix.Minor(st.Rdev) != 0 {
				return nil // not a whiteout: a device node has no place in a layer
			}
			hdr.Typeflag = tar.TypeChar
		case unix.S_IFREG:
			key := inode{st.Dev, st.Ino}
			if first, ok := links[key]; ok && st.Nlink > 1 {
				hdr.Typeflag, hdr.Linkname = tar.TypeLink, first
				break
			}
			if st.Nlink > 1 {
				links[key] = rel
			}
			hdr.Typeflag = tar.TypeReg
			data, err = os.Open(p)
			if err != nil {
				return err
			}
			defer data.Close()
			extents, err = dataExtents(int(data.Fd()), st.Size)
			if err != nil {
				return fmt.Errorf("extents of %s: %w", p, err)
			}
			var n int64
			for _, e := range extents {
				n += e[1]
			}
			hdr.Size = n
			if n != st.Size {
				hdr.PAXRecords[paxSize] = strconv.FormatInt(st.Size, 10)
				hdr.PAXRecords[paxSparse] = formatExtents(extents)
			}
		default:
			return nil // fifos and sockets do not survive a restore anyway
		}
		if st.Mode&unix.S_IFMT != unix.S_IFLNK {
			if err := addXattrs(p, hdr.PAXRecords); err != nil {
				return err
			}
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if err := writeData(tw, aw, f, data, extents); err != nil {
			return fmt.Errorf("data of %s: %w", p, err)
		}
		return nil
	})
	if err == nil {
		err = tw.Close()
	}
	if err == nil {
		err = aw.bw.Flush()
	}
	if err == nil {
		err = f.Close()
	}
	if err != nil {
		_ = os.Remove(dst)
		return fmt.Errorf("gvisor: export layer: %w", err)
	}
	return nil
}

// archiveWriter is what the layer's tar.Writer writes to. File data that writeData already placed
// in the archive file (copy_file_range) is passed through the tar.Writer as zeros for its
// accounting and dropped here (skip).
type archiveWriter struct {
	bw   *bufio.Writer
	skip int64
}

func (a *archiveWriter) Write(p []byte) (int, error) {
	n := len(p)
	if a.skip > 0 {
		k := int(min(int64(len(p)), a.skip))
		a.skip -= int64(k)
		p = p[k:]
	}
	if len(p) == 0 {
		return n, nil
	}
	if _, err := a.bw.Write(p); err != nil {
		return 0, err
	}
	return n, nil
}

// zeros feeds the tar.Writer's accounting for data copied by the kernel (never written out).
var zeros = make([]byte, 1<<20)

// writeData writes the data extents of the file data as the current entry's content. Where the
// kernel can, it copies them straight into the archive file (copy_file_range: no pass through
// user space, a reflink on btrfs and xfs); else through tw.
func writeData(tw *tar.Writer, aw *archiveWriter, out, data *os.File, extents [][2]int64) error {
	var total int64
	for _, e := range extents {
		total += e[1]
	}
	if total == 0 {
		return nil
	}
	if err := aw.bw.Flush(); err != nil {
		return err
	}
	if pos, err := out.Seek(0, io.SeekCurrent); err == nil {
		woff, ok := pos, true
		for _, e := range extents {
			if !copyRange(data, e[0], out, woff, e[1]) {
				ok = false
				break
			}
			woff += e[1]
		}
		if ok {
			if _, err := out.Seek(woff, io.SeekStart); err != nil {
				return err
			}
			aw.skip = total
			for left := total; left > 0; {
				k := min(left, int64(len(zeros)))
				if _, err := tw.Write(zeros[:k]); err != nil {
					return err
				}
				left -= k
			}
			if aw.skip != 0 {
				return errors.New("archive accounting out of step")
			}
			return nil
		}
		// Not possible here: the plain copy below overwrites whatever was placed at pos.
	}
	for _, e := range extents {
		if _, err := io.Copy(tw, io.NewSectionReader(data, e[0], e[1])); err != nil {
			return err
		}
	}
	return nil
}

// copyRange copies n bytes from src at roff to dst at woff with copy_file_range (file positions
// unchanged). It reports false if the kernel could not do it all (the caller copies instead).
func copyRange(src *os.File, roff int64, dst *os.File, woff, n int64) bool {
	for n > 0 {
		k, err := unix.CopyFileRange(int(src.Fd()), &roff, int(dst.Fd()), &woff, int(min(n, 1<<30)), 0)
		if err != nil || k <= 0 {
			return false
		}
		n -= int64(k)
	}
	return true
}

// addXattrs adds the allowed extended attributes of p (not followed) to recs.
func addXattrs(p string, recs map[string]string) error {
	sz, err := unix.Llistxattr(p, nil)
	if err != nil || sz == 0 {
		if errors.Is(err, unix.ENOTSUP) {
			err = nil
		}
		return err
	}
	buf := make([]byte, sz)
	sz, err = unix.Llistxattr(p, buf)
	if err != nil {
		return err
	}
	for _, name := range strings.Split(strings.TrimRight(string(buf[:sz]), "\x00"), "\x00") {
		if name == "" || !xattrAllowed(name) {
			continue
		}
		n, err := unix.Lgetxattr(p, name, nil)
		if err != nil {
			continue
		}
		val := make([]byte, n)
		n, err = unix.Lgetxattr(p, name, val)
		if err != nil {
			continue
		}
		recs[paxXattr+name] = string(val[:n])
	}
	return nil
}

// dataExtents lists the data extents [offset, length] of the open file fd of the given size.
func dataExtents(fd int, size int64) ([][2]int64, error) {
	var out [][2]int64
	for off := int64(0); off < size; {
		start, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // only a hole is left
		}
		if err != nil {
			return nil, err
		}
		end, err := unix.Seek(fd, start, unix.SEEK_HOLE)
		if err != nil {
			return nil, err
		}
		end = min(end, size)
		if end > start {
			out = append(out, [2]int64{start, end - start})
		}
		off = end
	}
	return mergeExtents(out, maxSparseExtents), nil
}

// mergeExtents joins extents across their smallest gaps until at most max are left.
func mergeExtents(ext [][2]int64, max int) [][2]int64 {
	for gap := int64(4096); len(ext) > max; gap *= 2 {
		merged := ext[:1]
		for _, e := range ext[1:] {
			last := &merged[len(merged)-1]
			if e[0]-(last[0]+last[1]) <= gap {
				last[1] = e[0] + e[1] - last[0]
			} else {
				merged = append(merged, e)
			}
		}
		ext = merged
	}
	return ext
}

func formatExtents(ext [][2]int64) string {
	var b strings.Builder
	for i, e := range ext {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.FormatInt(e[0], 10))
		b.WriteByte(':')
		b.WriteString(strconv.FormatInt(e[1], 10))
	}
	return b.String()
}

// parseExtents checks a sparse map from an archive: ascending, non-overlapping extents inside
// size whose lengths add up to dataLen.
func parseExtents(s string, size, dataLen int64) ([][2]int64, error) {
	if s == "" {
		if dataLen != 0 {
			return nil, errors.New("empty sparse map with data")
		}
		return nil, nil
	}
	parts := strings.Split(s, ",")
	if len(parts) > maxSparseExtents {
		return nil, errors.New("sparse map too long")
	}
	out := make([][2]int64, 0, len(parts))
	var next, total int64
	for _, p := range parts {
		o, l, ok := strings.Cut(p, ":")
		off, err1 := strconv.ParseInt(o, 10, 64)
		n, err2 := strconv.ParseInt(l, 10, 64)
		if !ok || err1 != nil || err2 != nil || off < next || n <= 0 || off > size-n {
			return nil, fmt.Errorf("bad sparse extent %q", p)
		}
		out = append(out, [2]int64{off, n})
		next, total = off+n, total+n
	}
	if total != dataLen {
		return nil, errors.New("sparse map does not match the data size")
	}
	return out, nil
}

// copyFileSparse copies the regular file src into a new file name (0600) in dstDir, holes kept:
// a reflink where the filesystem can, else its data extents. limit, when not nil, is the budget
// of data bytes left; it is charged and exceeding it is an error. src is opened without
// following a symlink and must be a regular file with at most maxSize apparent bytes (0: any).
func copyFileSparse(src, dstDir, name string, maxSize int64, limit *int64) error {
	in, err := os.OpenFile(src, os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return err
	}
	defer in.Close()
	fi, err := in.Stat()
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("%s: not a regular file: %w", src, errdefs.ErrInvalid)
	}
	if maxSize > 0 && fi.Size() > maxSize {
		return fmt.Errorf("%s: %d bytes: over the limit: %w", src, fi.Size(), errdefs.ErrInvalid)
	}
	ext, err := dataExtents(int(in.Fd()), fi.Size())
	if err != nil {
		return err
	}
	if limit != nil {
		for _, e := range ext {
			*limit -= e[1]
		}
		if *limit < 0 {
			return fmt.Errorf("%s: image over its size limit: %w", src, errdefs.ErrInvalid)
		}
	}
	out, err := os.OpenFile(filepath.Join(dstDir, name), os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return err
	}
	defer out.Close()
	if unix.IoctlFileClone(int(out.Fd()), int(in.Fd())) == nil {
		return out.Close()
	}
	if err := writeExtents(out, in, ext); err != nil {
		return err
	}
	if err := out.Truncate(fi.Size()); err != nil {
		return err
	}
	return out.Close()
}

// writeExtents copies the given extents of in to the same offsets of out.
func writeExtents(out, in *os.File, ext [][2]int64) error {
	for _, e := range ext {
		for off, end := e[0], e[0]+e[1]; off < end; {
			ro, wo := off, off
			n, err := unix.CopyFileRange(int(in.Fd()), &ro, int(out.Fd()), &wo, int(end-off), 0)
			if err != nil || n == 0 {
				// Not supported between these files: plain reads and writes.
				if _, err := io.Copy(io.NewOffsetWriter(out, off), io.NewSectionReader(in, off, end-off)); err != nil {
					return err
				}
				break
			}
			off += int64(n)
		}
	}
	return nil
}

// ImportImage implements runtime.Driver.
func (d *Driver) ImportImage(ctx context.Context, srcDir, imageDir string, opts runtime.ImportOptions) (err error) {
	if !filepath.IsAbs(imageDir) {
		return fmt.Errorf("gvisor: import: image dir %q: must be absolute: %w", imageDir, errdefs.ErrInvalid)
	}
	if err := os.Mkdir(imageDir, 0o700); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("gvisor: import: %s exists: %w", imageDir, errdefs.ErrConflict)
		}
		return fmt.Errorf("gvisor: import: %w", err)
	}
	defer func() {
		if err != nil {
			_ = RemoveLayer(imageDir)
			_ = os.RemoveAll(imageDir)
		}
	}()
	limit := int64(-1)
	if opts.MaxBytes > 0 {
		limit = opts.MaxBytes
	}
	ents, err := os.ReadDir(srcDir)
	if err != nil {
		return fmt.Errorf("gvisor: import: %v: %w", err, errdefs.ErrNotFound)
	}
	if len(ents) > maxImageFiles {
		return fmt.Errorf("gvisor: import: %d files: %w", len(ents), errdefs.ErrInvalid)
	}
	hasCheckpoint := false
	for _, e := range ents {
		if err := ctx.Err(); err != nil {
			return err
		}
		name := e.Name()
		if !e.Type().IsRegular() || !imageFileName.MatchString(name) || name == layerDirName {
			return fmt.Errorf("gvisor: import: unexpected entry %q: %w", name, errdefs.ErrInvalid)
		}
		if name == layerArchiveName {
			continue
		}
		var lim *int64
		if limit >= 0 {
			lim = &limit
		}
		if err := copyFileSparse(filepath.Join(srcDir, name), imageDir, name, 0, lim); err != nil {
			return fmt.Errorf("gvisor: import %s: %w", name, err)
		}
		hasCheckpoint = hasCheckpoint || name == "checkpoint.img"
	}
	if !hasCheckpoint {
		return fmt.Errorf("gvisor: import: no checkpoint.img in %s: %w", srcDir, errdefs.ErrInvalid)
	}
	if _, err := os.Lstat(filepath.Join(srcDir, layerArchiveName)); err == nil {
		if err := importLayer(ctx, filepath.Join(srcDir, layerArchiveName), imageDir, &limit); err != nil {
			return err
		}
	}
	return nil
}

// importLayer unpacks the archive at src into imageDir/layer/upper.
func importLayer(ctx context.Context, src, imageDir string, limit *int64) error {
	f, err := os.OpenFile(src, os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return fmt.Errorf("gvisor: import layer: %w", err)
	}
	defer f.Close()
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
		return fmt.Errorf("gvisor: import layer: not a regular file: %w", errdefs.ErrInvalid)
	}
	layer := filepath.Join(imageDir, layerDirName)
	if err := createLayer(layer); err != nil {
		return err
	}
	if err := os.Chmod(layer, 0o700); err != nil {
		return fmt.Errorf("gvisor: import layer: %w", err)
	}
	if err := os.Mkdir(filepath.Join(layer, upperDirName), 0o755); err != nil {
		return fmt.Errorf("gvisor: import layer: %w", err)
	}
	root, err := unix.Open(filepath.Join(layer, upperDirName), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("gvisor: import layer: %w", err)
	}
	defer unix.Close(root)
	fi, err := f.Stat()
	if err != nil {
		return fmt.Errorf("gvisor: import layer: %w", err)
	}
	u := &unpacker{root: root, limit: limit, seen: map[string]byte{}, src: f, srcSize: fi.Size()}
	defer u.closeParent()
	// Unbuffered, so that the file's offset is where an entry's data starts: regular files are
	// copied from there by the kernel, and the reader seeks past data it did not read.
	tr := tar.NewReader(f)
	for n := 0; ; n++ {
		if err := ctx.Err(); err != nil {
			return err
		}
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return fmt.Errorf("gvisor: import layer: entry %d: %v: %w", n, err, errdefs.ErrInvalid)
		}
		if n >= maxImportEntries {
			return fmt.Errorf("gvisor: import layer: more than %d entries: %w", maxImportEntries, errdefs.ErrInvalid)
		}
		if err := u.entry(hdr); err != nil {
			return fmt.Errorf("gvisor: import layer: %q: %w", hdr.Name, err)
		}
	}
	return u.finish()
}

// unpacker creates the entries of one layer archive beneath root.
type unpacker struct {
	root  int
	limit *int64          // data bytes left; negative: no bound
	seen  map[string]byte // cleaned name -> tar type flag, for duplicates and hard links
	dirs  []dirTimes

	src     *os.File // the archive, positioned at the current entry's data
	srcSize int64

	parentName string
	parentFD   int
	hasParent  bool
}

type dirTimes struct {
	name         string
	atime, mtime time.Time
}

func invalid(format string, a ...any) error {
	return fmt.Errorf(format+": %w", append(a, errdefs.ErrInvalid)...)
}

// cleanName checks an archive name and returns it cleaned (no trailing slash).
func cleanName(name string) (string, error) {
	n := strings.TrimSuffix(name, "/")
	switch {
	case n == "" || strings.ContainsRune(n, 0):
		return "", invalid("empty name")
	case strings.HasPrefix(n, "/"):
		return "", invalid("absolute name")
	case path.Clean(n) != n || n == "." || n == ".." || strings.HasPrefix(n, "../"):
		return "", invalid("name is not clean")
	case len(n) > 4000:
		return "", invalid("name too long")
	}
	for _, c := range strings.Split(n, "/") {
		if c == ".." || c == "." {
			return "", invalid("name has a %q component", c)
		}
	}
	return n, nil
}

// openParent returns a directory fd for dir ("" = root), resolved beneath root without
// following any symlink.
func (u *unpacker) openParent(dir string) (int, error) {
	if dir == "" {
		return u.root, nil
	}
	if u.hasParent && u.parentName == dir {
		return u.parentFD, nil
	}
	u.closeParent()
	fd, err := unix.Openat2(u.root, dir, &unix.OpenHow{
		Flags:   unix.O_RDONLY | unix.O_DIRECTORY | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV,
	})
	if err != nil {
		return -1, invalid("parent %q: %v", dir, err)
	}
	u.parentName, u.parentFD, u.hasParent = dir, fd, true
	return fd, nil
}

func (u *unpacker) closeParent() {
	if u.hasParent {
		unix.Close(u.parentFD)
		u.hasParent = false
	}
}

func (u *unpacker) entry(hdr *tar.Header) error {
	name, err := cleanName(hdr.Name)
	if err != nil {
		return err
	}
	if _, dup := u.seen[name]; dup {
		return invalid("duplicate entry")
	}
	for k := range hdr.PAXRecords {
		if strings.HasPrefix(k, "GNU.sparse.") {
			return invalid("GNU sparse entries are not accepted")
		}
	}
	if hdr.Uid < 0 || hdr.Gid < 0 || hdr.Uid > 1<<31 || hdr.Gid > 1<<31 {
		return invalid("bad owner %d:%d", hdr.Uid, hdr.Gid)
	}
	dir, base := path.Split(name)
	pfd, err := u.openParent(strings.TrimSuffix(dir, "/"))
	if err != nil {
		return err
	}
	mode := uint32(hdr.Mode & 0o7777)
	switch hdr.Typeflag {
	case tar.TypeDir:
		if err := unix.Mkdirat(pfd, base, 0o700); err != nil {
			return fmt.Errorf("mkdir: %w", err)
		}
		fd, err := unix.Openat(pfd, base, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		if err := u.fdMeta(fd, hdr, mode); err != nil {
			return err
		}
		u.dirs = append(u.dirs, dirTimes{name, hdr.AccessTime, hdr.ModTime})
	case tar.TypeReg:
		if err := u.regular(pfd, base, hdr, mode); err != nil {
			return err
		}
	case tar.TypeSymlink:
		if hdr.Linkname == "" || len(hdr.Linkname) > 4095 || strings.ContainsRune(hdr.Linkname, 0) {
			return invalid("bad symlink target")
		}
		if err := unix.Symlinkat(hdr.Linkname, pfd, base); err != nil {
			return fmt.Errorf("symlink: %w", err)
		}
		if err := unix.Fchownat(pfd, base, hdr.Uid, hdr.Gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
		if err := u.pathTimes(pfd, base, hdr); err != nil {
			return err
		}
	case tar.TypeLink:
		target, err := cleanName(hdr.Linkname)
		if err != nil {
			return fmt.Errorf("hard link target: %w", err)
		}
		if u.seen[target] != tar.TypeReg {
			return invalid("hard link to %q, which is not a regular file earlier in the layer", hdr.Linkname)
		}
		tdir, tbase := path.Split(target)
		if tdir = strings.TrimSuffix(tdir, "/"); tdir == "" {
			tdir = "."
		}
		tfd, err := unix.Openat2(u.root, tdir, &unix.OpenHow{
			Flags:   unix.O_RDONLY | unix.O_DIRECTORY | unix.O_CLOEXEC,
			Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV,
		})
		if err != nil {
			return invalid("hard link target %q: %v", target, err)
		}
		defer unix.Close(tfd)
		if err := unix.Linkat(tfd, tbase, pfd, base, 0); err != nil {
			return fmt.Errorf("link: %w", err)
		}
	case tar.TypeChar:
		if hdr.Devmajor != 0 || hdr.Devminor != 0 {
			return invalid("device node %d:%d", hdr.Devmajor, hdr.Devminor)
		}
		if err := unix.Mknodat(pfd, base, unix.S_IFCHR, 0); err != nil { // an overlayfs whiteout
			return fmt.Errorf("whiteout: %w", err)
		}
		if err := unix.Fchownat(pfd, base, hdr.Uid, hdr.Gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
		if err := u.pathTimes(pfd, base, hdr); err != nil {
			return err
		}
	default:
		return invalid("entry type %q not accepted", string(hdr.Typeflag))
	}
	u.seen[name] = hdr.Typeflag
	return nil
}

// regular creates a regular file from its archive data, placing a sparse file's extents.
func (u *unpacker) regular(pfd int, base string, hdr *tar.Header, mode uint32) error {
	size := hdr.Size
	var ext [][2]int64
	if s, ok := hdr.PAXRecords[paxSize]; ok {
		v, err := strconv.ParseInt(s, 10, 64)
		if err != nil || v < 0 {
			return invalid("bad %s %q", paxSize, s)
		}
		size = v
		if ext, err = parseExtents(hdr.PAXRecords[paxSparse], size, hdr.Size); err != nil {
			return invalid("%v", err)
		}
	} else if _, ok := hdr.PAXRecords[paxSparse]; ok {
		return invalid("%s without %s", paxSparse, paxSize)
	} else if hdr.Size > 0 {
		ext = [][2]int64{{0, hdr.Size}}
	}
	if *u.limit >= 0 {
		if *u.limit -= hdr.Size; *u.limit < 0 {
			return invalid("layer over the image size limit")
		}
	}
	roff, err := u.src.Seek(0, io.SeekCurrent)
	if err != nil {
		return err
	}
	if hdr.Size > u.srcSize-roff {
		return invalid("truncated data")
	}
	fd, err := unix.Openat(pfd, base, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("create: %w", err)
	}
	f := os.NewFile(uintptr(fd), base)
	defer f.Close()
	for _, e := range ext {
		if !copyRange(u.src, roff, f, e[0], e[1]) {
			n, err := io.Copy(io.NewOffsetWriter(f, e[0]), io.NewSectionReader(u.src, roff, e[1]))
			if err != nil {
				return err
			}
			if n != e[1] {
				return invalid("truncated data")
			}
		}
		roff += e[1]
	}
	if err := f.Truncate(size); err != nil {
		return fmt.Errorf("size %d: %w", size, err)
	}
	return u.fdMeta(fd, hdr, mode)
}

// fdMeta applies owner, mode, xattrs and (for non-directories) times to an open entry. The owner
// goes first: chown clears the setuid and setgid bits.
func (u *unpacker) fdMeta(fd int, hdr *tar.Header, mode uint32) error {
	if err := unix.Fchown(fd, hdr.Uid, hdr.Gid); err != nil {
		return err
	}
	if err := unix.Fchmod(fd, mode); err != nil {
		return err
	}
	keys := make([]string, 0, len(hdr.PAXRecords))
	for k := range hdr.PAXRecords {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		name, ok := strings.CutPrefix(k, paxXattr)
		if !ok || !xattrAllowed(name) {
			continue
		}
		if err := unix.Fsetxattr(fd, name, []byte(hdr.PAXRecords[k]), 0); err != nil {
			return fmt.Errorf("xattr %s: %w", name, err)
		}
	}
	if hdr.Typeflag == tar.TypeDir {
		return nil // after its children (finish)
	}
	return futimens(fd, []unix.Timespec{timespec(hdr.AccessTime, hdr.ModTime), timespec(hdr.ModTime, hdr.ModTime)})
}

// futimens sets the times of an open file (utimensat with a NULL path).
func futimens(fd int, ts []unix.Timespec) error {
	_, _, errno := unix.Syscall6(unix.SYS_UTIMENSAT, uintptr(fd), 0, uintptr(unsafe.Pointer(&ts[0])), 0, 0, 0)
	if errno != 0 {
		return errno
	}
	return nil
}

func timespec(t, fallback time.Time) unix.Timespec {
	if t.IsZero() {
		t = fallback
	}
	return unix.NsecToTimespec(t.UnixNano())
}

// pathTimes sets the times of a symlink or whiteout (not followed).
func (u *unpacker) pathTimes(pfd int, base string, hdr *tar.Header) error {
	ts := []unix.Timespec{timespec(hdr.AccessTime, hdr.ModTime), timespec(hdr.ModTime, hdr.ModTime)}
	return unix.UtimesNanoAt(pfd, base, ts, unix.AT_SYMLINK_NOFOLLOW)
}

// finish sets the directories' times, deepest first (creating children changed them).
func (u *unpacker) finish() error {
	u.closeParent()
	for i := len(u.dirs) - 1; i >= 0; i-- {
		dt := u.dirs[i]
		fd, err := unix.Openat2(u.root, dt.name, &unix.OpenHow{
			Flags:   unix.O_RDONLY | unix.O_DIRECTORY | unix.O_CLOEXEC,
			Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV,
		})
		if err != nil {
			return fmt.Errorf("gvisor: import layer: %s: %w", dt.name, err)
		}
		ts := []unix.Timespec{timespec(dt.atime, dt.mtime), timespec(dt.mtime, dt.mtime)}
		err = futimens(fd, ts)
		unix.Close(fd)
		if err != nil {
			return fmt.Errorf("gvisor: import layer: times of %s: %w", dt.name, err)
		}
	}
	return nil
}
