// Package image turns OCI and Docker images into template root filesystems. It pulls images
// from registries or reads archives (go-containerregistry), unpacks each layer once per node
// into a content-addressed directory (<root>/sha256-<hex>/, complete or absent) in overlayfs's
// layer format, and composes a template's rootfs as an overlayfs stack of those directories
// under the template's own top layer. Layer input is hostile: the unpacker never writes outside its directory. It owns
// the layer store; it must not know about sandboxes, templates' lifecycles or HTTP.
package image

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// Store is the node's layer store: one directory per uncompressed layer digest.
type Store struct {
	Root string
	// MaxLayerBytes bounds one layer's unpacked content; MaxImageBytes an image's. 0 = unlimited.
	MaxLayerBytes int64
	MaxImageBytes int64
	// MaxLayerEntries bounds one layer's tar entries (inodes); 0 = unlimited.
	MaxLayerEntries int

	mu    sync.Mutex
	holds map[string]*hold // by digest hex: builds using the layer right now
}

// hold is one layer's use count and its unpack lock (a one-slot semaphore, so waiting for it
// follows the context). The store is one daemon's: a data dir is never shared by two daemons.
type hold struct {
	users int
	sem   chan struct{}
}

// LayerDir is an unpacked layer.
type LayerDir struct {
	Digest string // sha256:<hex> of the uncompressed tar (the diff id)
	Dir    string // <root>/sha256-<hex>; files under Dir/root
	// Root, when set, is where the layer's files are instead of Dir/root (a layer captured
	// from a sandbox's writable layer, or a template's rootfs used as a bottom layer).
	Root string
	Meta Meta
	// Written is the content this call unpacked (0 when the layer was already on the node).
	Written int64
}

// RootDir is where the layer's files are.
func (l LayerDir) RootDir() string {
	if l.Root != "" {
		return l.Root
	}
	return filepath.Join(l.Dir, "root")
}

// Progress receives one line of progress.
type Progress func(string)

// Layer returns layer l unpacked in the store, unpacking it first when it is not there.
// Concurrent calls for one digest (in this process or another) unpack it once: the others wait
// for it and reuse it. budget, when not nil, is the image's remaining byte allowance.
func (s *Store) Layer(ctx context.Context, l v1.Layer, budget *int64, progress Progress) (LayerDir, error) {
	if progress == nil {
		progress = func(string) {}
	}
	diff, err := l.DiffID()
	if err != nil {
		return LayerDir{}, fmt.Errorf("layer diff id: %w", err)
	}
	if diff.Algorithm != "sha256" || len(diff.Hex) != 64 {
		return LayerDir{}, fmt.Errorf("layer %s: unsupported digest: %w", diff, errdefs.ErrInvalid)
	}
	if _, err := hex.DecodeString(diff.Hex); err != nil {
		return LayerDir{}, fmt.Errorf("layer %s: bad digest: %w", diff, errdefs.ErrInvalid)
	}
	if err := os.MkdirAll(s.Root, 0o700); err != nil {
		return LayerDir{}, err
	}
	ld := LayerDir{Digest: diff.String(), Dir: filepath.Join(s.Root, "sha256-"+diff.Hex)}
	short := diff.Hex[:12]
	h := s.acquire(diff.Hex)
	ok := false
	defer func() {
		if !ok {
			s.release(diff.Hex)
		}
	}()
	if m, err := readMeta(ld.Dir); err == nil {
		ld.Meta = m
		progress(fmt.Sprintf("layer %s: already on this node (%s), shared", short, HumanBytes(m.Bytes)))
		ok = true
		return ld, nil
	}
	select {
	case h.sem <- struct{}{}:
	case <-ctx.Done():
		return LayerDir{}, ctx.Err()
	}
	defer func() { <-h.sem }()
	if m, err := readMeta(ld.Dir); err == nil { // unpacked by the build we waited for
		ld.Meta = m
		progress(fmt.Sprintf("layer %s: unpacked by a concurrent build, shared", short))
		ok = true
		return ld, nil
	}
	if _, err := os.Lstat(ld.Dir); err == nil {
		// Written by an older ember (another format), or unreadable: unpack it again. Nothing
		// runs on a layer directory of another format (its templates are rebuilt at start).
		progress(fmt.Sprintf("layer %s: on this node in an older format, unpacking again", short))
		trash := filepath.Join(s.Root, ".tmp-stale-"+short+"-"+randSuffix())
		if err := os.Rename(ld.Dir, trash); err != nil {
			return LayerDir{}, err
		}
		if err := os.RemoveAll(trash); err != nil {
			return LayerDir{}, err
		}
	}
	tmp, err := os.MkdirTemp(s.Root, ".tmp-"+short+"-")
	if err != nil {
		return LayerDir{}, err
	}
	defer os.RemoveAll(tmp)
	if err := os.Chmod(tmp, 0o700); err != nil {
		return LayerDir{}, err
	}
	if err := os.Mkdir(filepath.Join(tmp, "root"), 0o755); err != nil {
		return LayerDir{}, err
	}
	rc, err := l.Compressed()
	if err != nil {
		return LayerDir{}, fmt.Errorf("layer %s: fetch: %w", short, classify(err))
	}
	size, _ := l.Size()
	counted := &progressReader{r: rc, total: size, label: "layer " + short, progress: progress, start: time.Now(), last: time.Now()}
	un, err := uncompress(counted, l)
	if err != nil {
		rc.Close()
		return LayerDir{}, fmt.Errorf("layer %s: %w", short, err)
	}
	sum := sha256.New()
	lim := Limits{MaxBytes: s.MaxLayerBytes, MaxEntries: s.MaxLayerEntries}
	if budget != nil && (lim.MaxBytes == 0 || *budget < lim.MaxBytes) {
		lim.MaxBytes = *budget
		if lim.MaxBytes <= 0 {
			lim.MaxBytes = 1
		}
	}
	meta, err := Unpack(ctx, io.TeeReader(un, sum), filepath.Join(tmp, "root"), lim, progress)
	if err == nil {
		_, err = io.Copy(sum, un) // tar padding after the end marker is part of the digest
	}
	un.Close()
	rc.Close()
	if err != nil {
		if budget != nil && lim.MaxBytes == *budget && strings.Contains(err.Error(), "exceeds the limit") {
			return LayerDir{}, fmt.Errorf("image content exceeds the limit of %d bytes at layer %s: %w", s.MaxImageBytes, short, errdefs.ErrExhausted)
		}
		return LayerDir{}, fmt.Errorf("layer %s: %w", short, classify(err))
	}
	if got := hex.EncodeToString(sum.Sum(nil)); got != diff.Hex {
		return LayerDir{}, fmt.Errorf("layer %s: content digest sha256:%s does not match the image's diff id: %w", short, got, errdefs.ErrCorrupt)
	}
	counted.done()
	meta.Format = LayerFormat
	if err := writeMeta(tmp, meta); err != nil {
		return LayerDir{}, err
	}
	if err := syncTree(tmp); err != nil {
		return LayerDir{}, err
	}
	if err := os.Rename(tmp, ld.Dir); err != nil {
		return LayerDir{}, err
	}
	if budget != nil {
		*budget -= meta.Bytes
	}
	ld.Meta, ld.Written = meta, meta.Bytes
	progress(fmt.Sprintf("layer %s: unpacked %s in %d entries", short, HumanBytes(meta.Bytes), meta.Entries))
	ok = true
	return ld, nil
}

func randSuffix() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

func (s *Store) acquire(hex string) *hold {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.holds == nil {
		s.holds = map[string]*hold{}
	}
	h := s.holds[hex]
	if h == nil {
		h = &hold{sem: make(chan struct{}, 1)}
		s.holds[hex] = h
	}
	h.users++
	return h
}

func (s *Store) release(hex string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if h := s.holds[hex]; h != nil {
		if h.users--; h.users <= 0 {
			delete(s.holds, hex)
		}
	}
}

// Release ends a build's use of layers returned by Layer. With discard (a failed build), each
// layer that this build unpacked and no other build is using is removed again, so the failure
// leaves nothing behind; layers that were already on the node stay.
func (s *Store) Release(layers []LayerDir, discard bool) {
	for _, l := range layers {
		hex := strings.TrimPrefix(l.Digest, "sha256:")
		if discard && l.Written > 0 {
			s.mu.Lock()
			if h := s.holds[hex]; h != nil && h.users == 1 {
				trash := filepath.Join(s.Root, ".tmp-discard-"+hex[:12])
				if err := os.Rename(l.Dir, trash); err == nil {
					defer os.RemoveAll(trash)
				}
			}
			s.mu.Unlock()
		}
		s.release(hex)
	}
}

// GC removes every layer directory that is not in keep (directories a template's stack uses:
// <root>/sha256-<hex> or a path below it) and that no build holds right now, and the stored
// envd binaries no template links any more. It returns the digests of the layers it removed.
// The caller makes sure that no build that is past its layers' use (composing, booting, not yet
// recorded) runs meanwhile.
func (s *Store) GC(keep []string) ([]string, error) {
	entries, err := os.ReadDir(s.Root)
	if err != nil {
		if os.IsNotExist(err) {
			return nil, nil
		}
		return nil, err
	}
	kept := map[string]bool{}
	for _, k := range keep {
		rel, err := filepath.Rel(s.Root, k)
		if err != nil || rel == "." || strings.HasPrefix(rel, "..") {
			continue
		}
		kept[strings.Split(rel, string(filepath.Separator))[0]] = true
	}
	var removed []string
	var errs []error
	for _, e := range entries {
		name := e.Name()
		p := filepath.Join(s.Root, name)
		switch {
		case strings.HasPrefix(name, "sha256-") && e.IsDir():
			hex := strings.TrimPrefix(name, "sha256-")
			if kept[name] {
				continue
			}
			s.mu.Lock()
			held := s.holds[hex] != nil
			var trash string
			if !held {
				trash = filepath.Join(s.Root, ".tmp-gc-"+hex[:min(12, len(hex))]+"-"+randSuffix())
				if err := os.Rename(p, trash); err != nil {
					errs = append(errs, err)
					trash = ""
				}
			}
			s.mu.Unlock()
			if trash != "" {
				if err := os.RemoveAll(trash); err != nil {
					errs = append(errs, err)
				}
				removed = append(removed, "sha256:"+hex)
			}
		case strings.HasPrefix(name, "envd-sha256-") && e.Type().IsRegular():
			var st unix.Stat_t
			if unix.Lstat(p, &st) == nil && st.Nlink == 1 {
				if err := os.Remove(p); err != nil {
					errs = append(errs, err)
				}
			}
		}
	}
	return removed, errors.Join(errs...)
}

// Cleanup removes temporary directories left by unpacks that a crash interrupted. Call it
// before any build starts.
func (s *Store) Cleanup() error {
	entries, err := os.ReadDir(s.Root)
	if err != nil {
		if os.IsNotExist(err) {
			return nil
		}
		return err
	}
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), ".tmp-") {
			os.RemoveAll(filepath.Join(s.Root, e.Name()))
		}
	}
	return nil
}

const metaFile = "meta.json"

// LayerFormat is the format of the layer directories this ember writes. A directory of another
// format is unpacked again (1: whiteouts only in meta.json, applied by composing a tree; 2:
// whiteouts and opaque directories in overlayfs's format, the directory an overlayfs lower).
const LayerFormat = 2

// errStaleLayer: a layer directory of another LayerFormat.
var errStaleLayer = errors.New("layer directory of an older format")

func readMeta(dir string) (Meta, error) {
	var m Meta
	data, err := os.ReadFile(filepath.Join(dir, metaFile))
	if err != nil {
		return m, err
	}
	if err := json.Unmarshal(data, &m); err != nil {
		return m, err
	}
	if m.Format != LayerFormat {
		return m, errStaleLayer
	}
	return m, nil
}

func writeMeta(dir string, m Meta) error {
	data, err := json.Marshal(m)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, metaFile), data, 0o600)
}

// syncTree makes everything under dir durable (one syncfs of its filesystem).
func syncTree(dir string) error {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.Syncfs(fd)
}

type progressReader struct {
	r           io.Reader
	n, total    int64
	label       string
	progress    Progress
	start, last time.Time
}

func (p *progressReader) Read(b []byte) (int, error) {
	n, err := p.r.Read(b)
	p.n += int64(n)
	if time.Since(p.last) >= time.Second {
		p.last = time.Now()
		p.report()
	}
	return n, err
}

func (p *progressReader) report() {
	el := time.Since(p.start).Seconds()
	rate := float64(p.n) / max(el, 0.001)
	of := ""
	if p.total > 0 {
		of = " of " + HumanBytes(p.total)
	}
	p.progress(fmt.Sprintf("%s: %s%s read (%s/s)", p.label, HumanBytes(p.n), of, HumanBytes(int64(rate))))
}

func (p *progressReader) done() { p.report() }

// HumanBytes formats a byte count for progress lines (KiB, MiB, GiB).
func HumanBytes(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.2f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}
