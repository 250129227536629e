package dockerfile

import (
	"archive/tar"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"unicode/utf16"

	"github.com/moby/patternmatcher"
	"github.com/moby/patternmatcher/ignorefile"
)

// FileSet is the files one COPY step sends to the daemon: the set the E2B SDK would hash and
// tar for `Template().copy(Src, Dest)` on the same context, so the daemon's file cache (keyed
// by Hash) is shared with SDK builds of the same files.
type FileSet struct {
	Src  string // the source as written, the step's args[0]
	Dest string // the destination as written, the step's args[1]
	Hash string // the step's filesHash
	Line int    // the instruction's line in the Dockerfile

	root    string
	entries []entry
}

// entry is one path of a FileSet, relative to the context ("" is the context itself).
type entry struct {
	rel  string
	info fs.FileInfo // from Lstat: a symlink is sent as a symlink, never followed
}

// Size is the bytes of regular files in the set.
func (f *FileSet) Size() int64 {
	var n int64
	for _, e := range f.entries {
		if e.info.Mode().IsRegular() {
			n += e.info.Size()
		}
	}
	return n
}

// Paths lists the set's paths relative to the context, in upload order.
func (f *FileSet) Paths() []string {
	out := make([]string, len(f.entries))
	for i, e := range f.entries {
		out[i] = e.rel
	}
	return out
}

// buildContext is the directory COPY sources are read from, with its .dockerignore.
type buildContext struct {
	root   string // absolute, symlinks resolved
	ignore *patternmatcher.PatternMatcher
}

func openContext(dir string) (*buildContext, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, err
	}
	root, err := filepath.EvalSymlinks(abs)
	if err != nil {
		return nil, fmt.Errorf("build context: %w", err)
	}
	if fi, err := os.Stat(root); err != nil || !fi.IsDir() {
		return nil, fmt.Errorf("build context %s is not a directory", dir)
	}
	c := &buildContext{root: root}
	f, err := os.Open(filepath.Join(root, ".dockerignore"))
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return nil, err
	default:
		defer f.Close()
		patterns, err := ignorefile.ReadAll(f)
		if err != nil {
			return nil, fmt.Errorf(".dockerignore: %w", err)
		}
		if c.ignore, err = patternmatcher.New(patterns); err != nil {
			return nil, fmt.Errorf(".dockerignore: %w", err)
		}
	}
	return c, nil
}

// ignored reports whether .dockerignore excludes rel (Docker's semantics: a pattern that
// matches a directory excludes everything under it, unless a later !pattern re-includes it).
func (c *buildContext) ignored(rel string) bool {
	if c.ignore == nil || rel == "" {
		return false
	}
	m, err := c.ignore.MatchesOrParentMatches(rel)
	return err == nil && m
}

// errNoFiles: a COPY source that matches nothing.
var errNoFiles = errors.New("no files found")

// collect resolves a COPY source (a path or wildcard pattern relative to the context) to the
// sorted set of paths the E2B SDK would send: each match, and for a matched directory
// everything under it, minus what .dockerignore excludes.
func (c *buildContext) collect(src string) ([]entry, error) {
	if src == "" || path.IsAbs(src) || filepath.IsAbs(src) {
		return nil, fmt.Errorf("source %q must be a path inside the build context", src)
	}
	clean := path.Clean(src)
	if clean == ".." || strings.HasPrefix(clean, "../") {
		return nil, fmt.Errorf("source %q is outside the build context", src)
	}
	dirOnly := strings.HasSuffix(src, "/")
	var matches []string
	if !hasMeta(clean) {
		matches = []string{clean}
	} else {
		var err error
		if matches, err = c.glob(clean); err != nil {
			return nil, err
		}
	}
	set := map[string]entry{}
	for _, m := range matches {
		rel := m
		if rel == "." {
			rel = ""
		}
		if c.ignored(rel) {
			continue
		}
		full := filepath.Join(c.root, filepath.FromSlash(rel))
		if err := c.inside(full); err != nil {
			return nil, fmt.Errorf("source %q: %w", src, err)
		}
		fi, err := os.Lstat(full)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, err
		}
		if dirOnly && !fi.IsDir() && fi.Mode()&fs.ModeSymlink == 0 {
			continue // "dir/" matches directories and, as the SDK's glob does, any symlink
		}
		set[rel] = entry{rel, fi}
		if fi.IsDir() {
			if err := c.walk(rel, set); err != nil {
				return nil, err
			}
		}
	}
	if len(set) == 0 {
		return nil, fmt.Errorf("%w for source %q in the build context", errNoFiles, src)
	}
	out := make([]entry, 0, len(set))
	for _, e := range set {
		if e.info.Mode().IsRegular() || e.info.IsDir() || e.info.Mode()&fs.ModeSymlink != 0 {
			out = append(out, e)
		}
	}
	// The SDK sorts by absolute path with JavaScript's string order (UTF-16 code units).
	sort.Slice(out, func(i, j int) bool { return lessUTF16(out[i].rel, out[j].rel) })
	return out, nil
}

// inside checks that full's parent directory, with every symlink on the way resolved, is still
// inside the context (full itself may be a symlink pointing anywhere: it is sent as a link).
func (c *buildContext) inside(full string) error {
	if full == c.root {
		return nil
	}
	dir, err := filepath.EvalSymlinks(filepath.Dir(full))
	if errors.Is(err, fs.ErrNotExist) {
		return nil // nothing there; collect reports no files
	}
	if err != nil {
		return err
	}
	if dir != c.root && !strings.HasPrefix(dir, c.root+string(filepath.Separator)) {
		return fmt.Errorf("its path leaves the build context through a symlink (to %s)", dir)
	}
	return nil
}

// walk adds everything under the directory rel to set (symlinks are not followed).
func (c *buildContext) walk(rel string, set map[string]entry) error {
	top := filepath.Join(c.root, filepath.FromSlash(rel))
	return filepath.WalkDir(top, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p == top {
			return nil
		}
		r, err := filepath.Rel(c.root, p)
		if err != nil {
			return err
		}
		r = filepath.ToSlash(r)
		if c.ignored(r) {
			if d.IsDir() && !c.ignore.Exclusions() {
				return filepath.SkipDir
			}
			return nil
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		set[r] = entry{r, fi}
		return nil
	})
}

// glob returns the context paths matching pattern (segments of *, ?, [...] as path.Match, and
// ** for any number of directories, as the SDK's glob does with dot files included).
func (c *buildContext) glob(pattern string) ([]string, error) {
	segs := strings.Split(pattern, "/")
	for _, s := range segs {
		if _, err := path.Match(s, ""); err != nil {
			return nil, fmt.Errorf("bad pattern %q: %w", pattern, err)
		}
	}
	// Walk from the longest prefix without wildcards.
	n := 0
	for n < len(segs)-1 && !hasMeta(segs[n]) {
		n++
	}
	base := strings.Join(segs[:n], "/")
	top := filepath.Join(c.root, filepath.FromSlash(base))
	if err := c.inside(filepath.Join(top, "x")); err != nil {
		return nil, fmt.Errorf("source %q: %w", pattern, err)
	}
	var out []string
	err := filepath.WalkDir(top, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) && p == top {
				return filepath.SkipAll
			}
			return err
		}
		r, _ := filepath.Rel(c.root, p)
		r = filepath.ToSlash(r)
		if r != "." && c.ignored(r) && d.IsDir() && !c.ignore.Exclusions() {
			return filepath.SkipDir
		}
		var name []string // the context itself has no segments (** matches it)
		if r != "." {
			name = strings.Split(r, "/")
		}
		if matchSegments(segs, name) {
			out = append(out, r)
		}
		return nil
	})
	return out, err
}

// matchSegments matches path segments against pattern segments, ** matching zero or more.
func matchSegments(pat, name []string) bool {
	if len(pat) == 0 {
		return len(name) == 0
	}
	if pat[0] == "**" {
		for i := 0; i <= len(name); i++ {
			if matchSegments(pat[1:], name[i:]) {
				return true
			}
		}
		return false
	}
	if len(name) == 0 {
		return false
	}
	ok, _ := path.Match(pat[0], name[0])
	return ok && matchSegments(pat[1:], name[1:])
}

func hasMeta(s string) bool { return strings.ContainsAny(s, `*?[`) }

func lessUTF16(a, b string) bool {
	ua, ub := utf16.Encode([]rune(a)), utf16.Encode([]rune(b))
	for i := 0; i < len(ua) && i < len(ub); i++ {
		if ua[i] != ub[i] {
			return ua[i] < ub[i]
		}
	}
	return len(ua) < len(ub)
}

// filesHash is the E2B SDK's calculateFilesHash: sha256 over "COPY <src> <dest>", then for
// each path in order its relative path, st_mode and size in decimal, and a regular file's
// bytes or a symlink's target (uid, gid and mtime are left out so hashes are stable).
func filesHash(root, src, dest string, entries []entry) (string, error) {
	h := sha256.New()
	io.WriteString(h, "COPY "+src+" "+dest)
	for _, e := range entries {
		io.WriteString(h, e.rel)
		mode, size := statModeSize(e.info)
		io.WriteString(h, strconv.FormatUint(uint64(mode), 10))
		io.WriteString(h, strconv.FormatInt(size, 10))
		full := filepath.Join(root, filepath.FromSlash(e.rel))
		switch {
		case e.info.Mode()&fs.ModeSymlink != 0:
			target, err := os.Readlink(full)
			if err != nil {
				return "", err
			}
			io.WriteString(h, target)
		case e.info.Mode().IsRegular():
			f, err := os.Open(full)
			if err != nil {
				return "", err
			}
			_, err = io.Copy(h, f)
			f.Close()
			if err != nil {
				return "", err
			}
		}
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

func statModeSize(fi fs.FileInfo) (uint32, int64) {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return st.Mode, st.Size
	}
	return uint32(fi.Mode().Perm()), fi.Size()
}

// WriteTar writes the set as the gzipped tarball the SDK uploads: one entry per path, named
// relative to the context ("./" for the context itself, directories with a trailing slash),
// symlinks as links, with mode, owner and mtime.
func (f *FileSet) WriteTar(w io.Writer) error {
	zw := gzip.NewWriter(w)
	tw := tar.NewWriter(zw)
	for _, e := range f.entries {
		full := filepath.Join(f.root, filepath.FromSlash(e.rel))
		link := ""
		if e.info.Mode()&fs.ModeSymlink != 0 {
			var err error
			if link, err = os.Readlink(full); err != nil {
				return err
			}
		}
		hdr, err := tar.FileInfoHeader(e.info, link)
		if err != nil {
			return err
		}
		hdr.Uname, hdr.Gname = "", ""
		switch {
		case e.rel == "":
			hdr.Name = "./"
		case e.info.IsDir():
			hdr.Name = e.rel + "/"
		default:
			hdr.Name = e.rel
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if e.info.Mode().IsRegular() {
			src, err := os.Open(full)
			if err != nil {
				return err
			}
			n, err := io.Copy(tw, src)
			src.Close()
			if err != nil {
				return err
			}
			if n != e.info.Size() {
				return fmt.Errorf("%s changed while it was being sent", e.rel)
			}
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	return zw.Close()
}
