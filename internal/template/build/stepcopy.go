package build

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path"
	"strconv"
	"strings"
)

// COPY steps. The client uploaded a tarball (gzipped or not) of the files its source pattern
// matched, named relative to its context directory. The host reads it as hostile input and
// writes a normalised tarball whose names are relative to the destination: no absolute names,
// no `..`, no entry beneath a symlink of the archive, hard links only to entries before them,
// only files, directories and links. The guest extracts that into a fresh directory, gives it
// the owner (and mode), and copies it to the destination, as Docker's COPY places files:
//
//	src a file:         dest/ (or an existing directory) -> dest/<name>; else dest is the file
//	src a directory:    its contents go into dest
//	src a glob:         each match by name into dest (a matched directory's contents)

// MaxCopyBytes and MaxCopyEntries cap an uploaded COPY archive as the host decompresses it:
// its regular files' bytes and its entries (a gzip bomb, an archive of millions of entries).
var (
	MaxCopyBytes   int64 = 8 << 30
	MaxCopyEntries       = 1 << 20
)

func parseMode(s string) (int64, error) {
	v, err := strconv.ParseUint(s, 8, 32)
	if err != nil || v > 0o7777 {
		return 0, fmt.Errorf("mode %q is not an octal file mode", s)
	}
	return int64(v), nil
}

// copyLimits counts an archive's entries and bytes against MaxCopyEntries and MaxCopyBytes.
type copyLimits struct {
	entries int
	bytes   int64
}

func (l *copyLimits) add(h *tar.Header) error {
	l.entries++
	if h.Typeflag == tar.TypeReg {
		l.bytes += h.Size
	}
	switch {
	case l.entries > MaxCopyEntries:
		return fmt.Errorf("the files archive has more than %d entries (the limit): %w", MaxCopyEntries, errInvalidCopy)
	case l.bytes > MaxCopyBytes:
		return fmt.Errorf("the files archive unpacks to more than %d bytes (the limit): %w", MaxCopyBytes, errInvalidCopy)
	}
	return nil
}

// openCopyArchive returns the tar stream of an uploaded archive, gzipped or not.
func openCopyArchive(r io.Reader) (*tar.Reader, func(), error) {
	br := bufio.NewReader(r)
	if magic, err := br.Peek(2); err == nil && magic[0] == 0x1f && magic[1] == 0x8b {
		gz, err := gzip.NewReader(br)
		if err != nil {
			return nil, nil, fmt.Errorf("files archive: %v: %w", err, errInvalidCopy)
		}
		return tar.NewReader(gz), func() { gz.Close() }, nil
	}
	return tar.NewReader(br), func() {}, nil
}

// checkCopyArchive reads an uploaded archive through, within the limits: a tar (gzipped or
// not) of at most MaxCopyEntries entries and MaxCopyBytes bytes of files.
func checkCopyArchive(r io.Reader) error {
	tr, done, err := openCopyArchive(r)
	if err != nil {
		return err
	}
	defer done()
	var lim copyLimits
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return fmt.Errorf("files archive: %v: %w", err, errInvalidCopy)
		}
		if err := lim.add(h); err != nil {
			return err
		}
	}
}

// copyPlan is the result of normalising a COPY tarball.
type copyPlan struct {
	single  string // the one file's name, when src names a file; "" otherwise
	entries int
}

// normalizeCopy reads the uploaded tarball r and writes to w the entries src selects, renamed
// relative to the destination; mode (>= 0) replaces regular files' permissions.
func normalizeCopy(r io.Reader, src string, mode int64, w io.Writer) (copyPlan, error) {
	var plan copyPlan
	tr, done, err := openCopyArchive(r)
	if err != nil {
		return plan, err
	}
	defer done()
	var lim copyLimits
	srcClean := path.Clean(strings.TrimPrefix(src, "./"))
	if path.IsAbs(srcClean) || srcClean == ".." || strings.HasPrefix(srcClean, "../") {
		return plan, fmt.Errorf("source %q must be relative to the context directory", src)
	}
	isGlob := strings.ContainsAny(srcClean, "*?[")
	depth := strings.Count(srcClean, "/") + 1
	tw := tar.NewWriter(w)
	names := map[string]string{} // archive name -> output name
	symlinks := map[string]bool{}
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return plan, fmt.Errorf("files archive: %w", err)
		}
		if err := lim.add(h); err != nil {
			return plan, err
		}
		nm, err := archiveName(h.Name)
		if err != nil {
			return plan, err
		}
		if nm == "." {
			continue
		}
		out, isFileSrc, ok := mapCopyName(nm, srcClean, isGlob, depth, h.Typeflag == tar.TypeDir)
		if !ok {
			continue
		}
		if out == "" { // the source directory itself
			continue
		}
		for p := path.Dir(out); p != "."; p = path.Dir(p) {
			if symlinks[p] {
				return plan, fmt.Errorf("refusing %s: it is beneath the symlink %s of the archive: %w", h.Name, p, errInvalidCopy)
			}
		}
		oh := &tar.Header{Name: out, Mode: h.Mode & 0o7777, ModTime: h.ModTime, Format: tar.FormatPAX}
		switch h.Typeflag {
		case tar.TypeReg:
			oh.Typeflag, oh.Size = tar.TypeReg, h.Size
			if mode >= 0 {
				oh.Mode = mode
			}
		case tar.TypeDir:
			oh.Typeflag = tar.TypeDir
		case tar.TypeSymlink:
			if strings.ContainsAny(h.Linkname, "\x00\n") {
				return plan, fmt.Errorf("refusing symlink %s: bad target: %w", h.Name, errInvalidCopy)
			}
			oh.Typeflag, oh.Linkname = tar.TypeSymlink, h.Linkname
			symlinks[out] = true
		case tar.TypeLink:
			target, err := archiveName(h.Linkname)
			if err != nil {
				return plan, err
			}
			to, seen := names[target]
			if !seen {
				return plan, fmt.Errorf("refusing hard link %s: its target %s is not an earlier entry of the selection: %w", h.Name, h.Linkname, errInvalidCopy)
			}
			oh.Typeflag, oh.Linkname = tar.TypeLink, to
		default:
			continue // devices, fifos: not copied
		}
		names[nm] = out
		if isFileSrc && h.Typeflag != tar.TypeDir {
			plan.single = out
		}
		if err := tw.WriteHeader(oh); err != nil {
			return plan, err
		}
		if oh.Typeflag == tar.TypeReg {
			if _, err := io.CopyN(tw, tr, h.Size); err != nil {
				return plan, fmt.Errorf("files archive: %w", err)
			}
		}
		plan.entries++
	}
	if plan.entries == 0 {
		return plan, fmt.Errorf("no files in the uploaded archive match %q: %w", src, errInvalidCopy)
	}
	return plan, tw.Close()
}

var errInvalidCopy = errors.New("invalid files archive")

// archiveName cleans an archive entry's name, refusing one that could leave the tree.
func archiveName(n string) (string, error) {
	if strings.ContainsAny(n, "\x00\n\r\\") {
		return "", fmt.Errorf("refusing entry %q: bad characters: %w", n, errInvalidCopy)
	}
	c := path.Clean(strings.TrimPrefix(n, "./"))
	if path.IsAbs(n) || c == ".." || strings.HasPrefix(c, "../") {
		return "", fmt.Errorf("refusing entry %q: outside the destination: %w", n, errInvalidCopy)
	}
	return c, nil
}

// mapCopyName maps an archive name to its name relative to the destination. ok false: not
// selected by src. out "" with ok: the source directory itself. single: src names this file.
func mapCopyName(nm, src string, isGlob bool, depth int, isDir bool) (out string, single, ok bool) {
	if src == "." {
		return nm, false, true
	}
	if !isGlob {
		switch {
		case nm == src && isDir:
			return "", false, true
		case nm == src:
			return path.Base(nm), true, true
		case strings.HasPrefix(nm, src+"/"):
			return strings.TrimPrefix(nm, src+"/"), false, true
		}
		return "", false, false
	}
	parts := strings.Split(nm, "/")
	if len(parts) < depth {
		return "", false, false
	}
	head := strings.Join(parts[:depth], "/")
	if m, _ := path.Match(src, head); !m {
		return "", false, false
	}
	if len(parts) == depth {
		if isDir {
			return "", false, true
		}
		return path.Base(nm), false, true
	}
	return strings.Join(parts[depth:], "/"), false, true
}

// copy runs a COPY step: normalise the uploaded archive, upload it to the guest, place it.
func (g *guestRun) copy(ctx context.Context, s Step, st stepState, out func(string)) error {
	src, dest := s.Args[0], s.Args[1]
	owner := st.User
	if len(s.Args) > 2 && s.Args[2] != "" {
		owner = s.Args[2]
	}
	mode := int64(-1)
	if len(s.Args) > 3 && s.Args[3] != "" {
		mode, _ = parseMode(s.Args[3])
	}
	into := strings.HasSuffix(dest, "/")
	dest = resolveIn(st.Workdir, dest)
	p, err := g.m.buildFile(s.FilesHash)
	if err != nil {
		return err
	}
	f, err := os.Open(p)
	if err != nil {
		return fmt.Errorf("files %s: %w", s.FilesHash[:12], err)
	}
	defer f.Close()
	norm, err := os.CreateTemp(g.m.buildFilesDir(), ".tmp-copy-")
	if err != nil {
		return err
	}
	defer os.Remove(norm.Name())
	defer norm.Close()
	plan, err := normalizeCopy(f, src, mode, norm)
	if err != nil {
		return fmt.Errorf("copy %s: %w", src, err)
	}
	if _, err := norm.Seek(0, io.SeekStart); err != nil {
		return err
	}
	g.n++
	guestTar := fmt.Sprintf("/tmp/.ember-copy-%d-%s.tar", g.n, randomHex(4))
	if err := g.upload(ctx, guestTar, norm); err != nil {
		return fmt.Errorf("copy %s: upload to the build sandbox: %w", src, err)
	}
	ownerQ := shellQuote(owner)
	var b strings.Builder
	fmt.Fprintf(&b, "set -e; T=%s; D=%s; S=$(mktemp -d); tar -xf \"$T\" -C \"$S\"; rm -f \"$T\"; chown -R -h %s \"$S\"; ", shellQuote(guestTar), shellQuote(dest), ownerQ)
	if plan.single != "" {
		into01 := "0"
		if into {
			into01 = "1"
		}
		fmt.Fprintf(&b, "if [ %s = 1 ] || [ -d \"$D\" ]; then mkdir -p \"$D\"; D=\"$D\"/%s; else mkdir -p \"$(dirname \"$D\")\"; fi; cp -a \"$S\"/%s \"$D\"; ", into01, shellQuote(plan.single), shellQuote(plan.single))
	} else {
		// Each entry into D, so that D itself (an existing directory) keeps its owner and mode.
		fmt.Fprintf(&b, "if [ ! -d \"$D\" ]; then mkdir -p \"$D\"; chown %s \"$D\"; fi; find \"$S\" -mindepth 1 -maxdepth 1 -exec cp -a {} \"$D\"/ \\; ; ", ownerQ)
	}
	b.WriteString("rm -rf \"$S\"")
	if err := g.root(ctx, b.String(), out); err != nil {
		return fmt.Errorf("copy %s to %s: %w", src, dest, err)
	}
	out(fmt.Sprintf("copied %d entries to %s", plan.entries, dest))
	return nil
}

// upload writes body to path in the guest as root (envd's POST /files).
func (g *guestRun) upload(ctx context.Context, p string, body io.Reader) error {
	q := url.Values{"path": {p}, "username": {"root"}}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, g.base+"/files?"+q.Encode(), body)
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/octet-stream")
	req.Header.Set("X-Access-Token", g.token)
	resp, err := g.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("status %d: %s", resp.StatusCode, bytes.TrimSpace(msg))
	}
	return nil
}
