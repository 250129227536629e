// Package local is the snapshot store's default Backend: one file per key under a directory on
// this node. Each Put writes a temporary file, fsyncs it, checks its size and renames it into
// place, so an object is complete or absent. It owns nothing outside its root directory.
package local

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/snapshot"
)

// Backend stores blobs as files under Root.
type Backend struct {
	root string
}

var (
	_ snapshot.Backend = (*Backend)(nil)
	_ snapshot.Creator = (*Backend)(nil)
)

// New returns a Backend rooted at dir, creating it if needed.
func New(dir string) (*Backend, error) {
	if dir == "" {
		return nil, fmt.Errorf("snapshot local backend: empty directory: %w", errdefs.ErrInvalid)
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(abs, 0o700); err != nil {
		return nil, fmt.Errorf("snapshot local backend: %w", err)
	}
	return &Backend{root: abs}, nil
}

// Root returns the backend's directory.
func (b *Backend) Root() string { return b.root }

func (b *Backend) path(key string) (string, error) {
	if err := snapshot.ValidateKey(key); err != nil {
		return "", err
	}
	return filepath.Join(b.root, filepath.FromSlash(key)), nil
}

// Put implements snapshot.Backend.
func (b *Backend) Put(ctx context.Context, key string, r io.Reader, size int64) error {
	return b.put(ctx, key, r, size, false)
}

// Create implements snapshot.Creator: the complete temporary file is hard-linked into place,
// which fails if the key exists.
func (b *Backend) Create(ctx context.Context, key string, r io.Reader, size int64) error {
	return b.put(ctx, key, r, size, true)
}

func (b *Backend) put(ctx context.Context, key string, r io.Reader, size int64, exclusive bool) (err error) {
	p, err := b.path(key)
	if err != nil {
		return err
	}
	dir := filepath.Dir(p)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	f, err := os.CreateTemp(dir, ".tmp-")
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	n, err := io.Copy(f, io.LimitReader(ctxReader{ctx, r}, size+1))
	if err != nil {
		return fmt.Errorf("put %s: %w", key, err)
	}
	if n != size {
		return fmt.Errorf("put %s: got %d bytes, want %d: %w", key, n, size, errdefs.ErrInvalid)
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("put %s: %w", key, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("put %s: %w", key, err)
	}
	if exclusive {
		err := os.Link(f.Name(), p)
		os.Remove(f.Name())
		if errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("create %s: already exists: %w", key, errdefs.ErrConflict)
		}
		if err != nil {
			return fmt.Errorf("create %s: %w", key, err)
		}
		return syncDir(dir)
	}
	if err := os.Rename(f.Name(), p); err != nil {
		return fmt.Errorf("put %s: %w", key, err)
	}
	return syncDir(dir)
}

// Get implements snapshot.Backend. The reader is the file itself.
func (b *Backend) Get(ctx context.Context, key string) (io.ReadCloser, error) {
	p, err := b.path(key)
	if err != nil {
		return nil, err
	}
	f, err := os.Open(p)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%s: %w", key, errdefs.ErrNotFound)
	}
	return f, err
}

// Exists implements snapshot.Backend.
func (b *Backend) Exists(ctx context.Context, key string) (bool, error) {
	p, err := b.path(key)
	if err != nil {
		return false, err
	}
	fi, err := os.Stat(p)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return fi.Mode().IsRegular(), nil
}

// Delete implements snapshot.Backend.
func (b *Backend) Delete(ctx context.Context, key string) error {
	p, err := b.path(key)
	if err != nil {
		return err
	}
	if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// List implements snapshot.Backend. It skips temporary files of Puts in progress.
func (b *Backend) List(ctx context.Context, prefix string) ([]string, error) {
	// Walk only the deepest directory the prefix names.
	start := b.root
	if i := strings.LastIndex(prefix, "/"); i >= 0 {
		start = filepath.Join(b.root, filepath.FromSlash(prefix[:i]))
	}
	var keys []string
	err := filepath.WalkDir(start, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if strings.HasPrefix(d.Name(), ".") && p != start {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		if !d.Type().IsRegular() {
			return nil
		}
		rel, err := filepath.Rel(b.root, p)
		if err != nil {
			return err
		}
		if key := filepath.ToSlash(rel); strings.HasPrefix(key, prefix) {
			keys = append(keys, key)
		}
		return nil
	})
	return keys, err
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// ctxReader stops a copy when ctx is cancelled.
type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}
