// Package image turns OCI and Docker images into template root filesystems. It pulls images
// from registries or reads archives (go-containerregistry), unpacks each layer once per node
// into a content-addressed directory (<root>/sha256-<hex>/, complete or absent), and composes a
// template's rootfs as one merged tree of hard links into those directories, whiteouts
// applied. Layer input is hostile: the unpacker never writes outside its directory. It owns
// the layer store; it must not know about sandboxes, templates' lifecycles or HTTP.
package image

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
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
}

// LayerDir is an unpacked layer.
type LayerDir struct {
	Digest string // sha256:<hex> of the uncompressed tar (the diff id)
	Dir    string // <root>/sha256-<hex>; files under Dir/root
	Meta   Meta
	// Written is the content this call unpacked (0 when the layer was already on the node).
	Written int64
}

// RootDir is where the layer's files are.
func (l LayerDir) RootDir() string { return filepath.Join(l.Dir, "root") }

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
	if m, err := readMeta(ld.Dir); err == nil {
		ld.Meta = m
		progress(fmt.Sprintf("layer %s: already on this node (%s), shared", short, human(m.Bytes)))
		return ld, nil
	}
	unlock, err := lockFile(ctx, filepath.Join(s.Root, ".lock-"+diff.Hex))
	if err != nil {
		return LayerDir{}, err
	}
	defer unlock()
	if m, err := readMeta(ld.Dir); err == nil { // unpacked by the build we waited for
		ld.Meta = m
		progress(fmt.Sprintf("layer %s: unpacked by a concurrent build, shared", short))
		return ld, nil
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
	h := sha256.New()
	lim := Limits{MaxBytes: s.MaxLayerBytes}
	if budget != nil && (lim.MaxBytes == 0 || *budget < lim.MaxBytes) {
		lim.MaxBytes = *budget
		if lim.MaxBytes <= 0 {
			lim.MaxBytes = 1
		}
	}
	meta, err := Unpack(ctx, io.TeeReader(un, h), filepath.Join(tmp, "root"), lim, progress)
	if err == nil {
		_, err = io.Copy(h, un) // tar padding after the end marker is part of the digest
	}
	un.Close()
	rc.Close()
	if err != nil {
		if budget != nil && lim.MaxBytes == *budget && strings.Contains(err.Error(), "exceeds the limit") {
			return LayerDir{}, fmt.Errorf("image content exceeds the limit of %d bytes at layer %s: %w", s.MaxImageBytes, short, errdefs.ErrExhausted)
		}
		return LayerDir{}, fmt.Errorf("layer %s: %w", short, classify(err))
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != diff.Hex {
		return LayerDir{}, fmt.Errorf("layer %s: content digest sha256:%s does not match the image's diff id: %w", short, got, errdefs.ErrCorrupt)
	}
	counted.done()
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
	progress(fmt.Sprintf("layer %s: unpacked %s in %d entries", short, human(meta.Bytes), meta.Entries))
	return ld, nil
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

func readMeta(dir string) (Meta, error) {
	var m Meta
	data, err := os.ReadFile(filepath.Join(dir, metaFile))
	if err != nil {
		return m, err
	}
	return m, json.Unmarshal(data, &m)
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

// lockFile takes an exclusive flock on p, waiting while ctx allows.
func lockFile(ctx context.Context, p string) (func(), error) {
	f, err := os.OpenFile(p, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return func() { unix.Flock(int(f.Fd()), unix.LOCK_UN); f.Close() }, nil
		}
		if err != unix.EWOULDBLOCK && err != unix.EINTR {
			f.Close()
			return nil, err
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
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
		of = " of " + human(p.total)
	}
	p.progress(fmt.Sprintf("%s: %s%s read (%s/s)", p.label, human(p.n), of, human(int64(rate))))
}

func (p *progressReader) done() { p.report() }

func human(n int64) string {
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
