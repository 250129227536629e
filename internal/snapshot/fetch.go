package snapshot

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// MarkerName is the file Fetch writes, and fsyncs, into a destination after everything else in
// it is complete. Its presence (naming the snapshot) is what makes a destination complete.
const MarkerName = ".snapshot-complete"

// maxMarkerSize bounds how much of a marker file is read.
const maxMarkerSize = 4 << 10

type marker struct {
	ID       string `json:"id"`
	Checksum string `json:"checksum"` // of the manifest the destination was loaded from
}

// FetchOption configures one Fetch.
type FetchOption func(*fetchOptions)

type fetchOptions struct {
	importFn func(ctx context.Context, srcDir, dstDir string) error
}

// FetchImport makes Fetch turn the loaded snapshot into the destination with fn instead of
// installing it as is: fn gets the verified snapshot in srcDir and must create dstDir (which
// does not exist yet; both are temporary siblings of the destination). This is where a driver's
// ImportImage goes, so that it too runs once per destination. srcDir is removed afterwards.
func FetchImport(fn func(ctx context.Context, srcDir, dstDir string) error) FetchOption {
	return func(o *fetchOptions) { o.importFn = fn }
}

// flight is one Fetch in progress, shared by every caller that asked for it.
type flight struct {
	id     string
	done   chan struct{}
	err    error // set before done is closed
	refs   int   // callers still waiting; guarded by Store.mu
	cancel context.CancelFunc
	gone   bool // every caller gave up: it is being cancelled; guarded by Store.mu
}

// Fetch makes destDir a complete, verified copy of snapshot id (a node-local cache entry),
// loading it only if it is not one already. destDir belongs to Fetch: it is complete once it
// holds MarkerName naming id, and anything else found there (left by an interrupted load) is
// removed and loaded again. The load is atomic like Load's: it happens in a temporary sibling,
// the marker is written and fsynced last, and the whole is renamed into place.
//
// Concurrent Fetches of one id into one destDir in this Store share one load: the first starts
// it, the others wait for it and get its result. The load runs until it finishes or every
// caller waiting for it has given up (its ctx is done): a caller whose ctx ends returns its
// ctx's error at once without disturbing the others. A failed load leaves nothing behind and
// every waiter gets its error; the next Fetch tries again. Callers sharing a destDir must pass
// equivalent options (the first caller's are used).
//
// A destination holding, or being loaded with, another snapshot is ErrConflict. Errors are
// otherwise those of Load.
func (s *Store) Fetch(ctx context.Context, id, destDir string, opts ...FetchOption) error {
	if s.cfgErr != nil {
		return s.cfgErr
	}
	if err := ValidateID(id); err != nil {
		return err
	}
	dest, err := filepath.Abs(destDir)
	if err != nil {
		return fmt.Errorf("snapshot %s: %w", id, err)
	}
	if ok, err := fetched(id, dest); ok || err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("snapshot %s: %w", id, err)
	}
	var o fetchOptions
	for _, opt := range opts {
		opt(&o)
	}

	key := dest
	s.mu.Lock()
	f := s.flights[key]
	if f != nil && !f.gone && f.id != id {
		s.mu.Unlock()
		return fmt.Errorf("snapshot %s: %s is being loaded with snapshot %s: %w", id, dest, f.id, errdefs.ErrConflict)
	}
	if f == nil || f.gone {
		// The load outlives the caller that started it: it keeps the caller's values (logger)
		// but stops only when every waiter has gone. It starts after an abandoned one for the
		// same destination has wound down, so two never work on one destination.
		prev := f
		lctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
		f = &flight{id: id, done: make(chan struct{}), cancel: cancel}
		s.flights[key] = f
		go func() {
			var err error
			if prev != nil {
				select {
				case <-prev.done:
				case <-lctx.Done():
					err = lctx.Err()
				}
			}
			if err == nil {
				err = s.fetch(lctx, id, dest, o)
			}
			s.mu.Lock()
			if s.flights[key] == f {
				delete(s.flights, key)
			}
			f.err = err
			s.mu.Unlock()
			close(f.done)
			cancel()
		}()
	}
	f.refs++
	s.mu.Unlock()

	select {
	case <-f.done:
		return f.err
	case <-ctx.Done():
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	select {
	case <-f.done: // finished meanwhile: take its result
		return f.err
	default:
	}
	f.refs--
	if f.refs == 0 {
		// Nobody wants it any more: stop it, and let the next Fetch start afresh (after it)
		// rather than join a load that is being cancelled.
		f.gone = true
		f.cancel()
	}
	return fmt.Errorf("snapshot %s: %w", id, ctx.Err())
}

// fetch does the one load of a Fetch.
func (s *Store) fetch(ctx context.Context, id, dest string, o fetchOptions) error {
	start := time.Now()
	if ok, err := fetched(id, dest); ok || err != nil {
		return err // completed by an earlier flight that was abandoned after all
	}
	m, err := s.Stat(ctx, id)
	if err != nil {
		return err
	}
	fi, err := os.Lstat(dest)
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return fmt.Errorf("snapshot %s: %w", id, err)
	case !fi.IsDir():
		return fmt.Errorf("snapshot %s: %s exists and is not a directory: %w", id, dest, errdefs.ErrConflict)
	default:
		if ok, err := fetched(id, dest); ok || err != nil {
			return err // completed meanwhile (by another process)
		}
		s.log.Warn("snapshot fetch: removing an incomplete destination", "snapshot_id", id, "dir", dest)
		if err := removeTree(dest); err != nil {
			return fmt.Errorf("snapshot %s: remove incomplete %s: %w", id, dest, err)
		}
	}
	parent := filepath.Dir(dest)
	if err := os.MkdirAll(parent, 0o700); err != nil {
		return fmt.Errorf("snapshot %s: %w", id, err)
	}
	work, err := os.MkdirTemp(parent, "."+filepath.Base(dest)+".fetching-")
	if err != nil {
		return fmt.Errorf("snapshot %s: %w", id, err)
	}
	defer removeTree(work)

	out := filepath.Join(work, "snapshot")
	if err := os.Mkdir(out, 0o700); err != nil {
		return fmt.Errorf("snapshot %s: %w", id, err)
	}
	tr, err := s.loadTree(ctx, m, out)
	if err != nil {
		return fmt.Errorf("snapshot %s: %w", id, err)
	}
	if o.importFn != nil {
		src := out
		out = filepath.Join(work, "imported")
		if err := o.importFn(ctx, src, out); err != nil {
			return fmt.Errorf("snapshot %s: import: %w", id, err)
		}
		if fi, err := os.Lstat(out); err != nil || !fi.IsDir() {
			return fmt.Errorf("snapshot %s: import made no directory (%v)", id, err)
		}
		removeTree(src)
	}
	if err := s.writeMarker(out, marker{ID: id, Checksum: m.Checksum}); err != nil {
		return fmt.Errorf("snapshot %s: %w", id, err)
	}
	if err := s.install(ctx, out, dest); err != nil {
		if errors.Is(err, errdefs.ErrConflict) {
			// Someone (another process) installed it first; theirs is as good as ours.
			if ok, ferr := fetched(id, dest); ok || ferr != nil {
				return ferr
			}
		}
		return fmt.Errorf("snapshot %s: %w", id, err)
	}
	s.log.Debug("snapshot fetched", "snapshot_id", id, "dir", dest, "bytes", m.TotalSize(), "fetched_bytes", tr.FetchedBytes,
		"cache_hits", tr.CacheHits, "took", time.Since(start))
	return nil
}

// writeMarker writes the marker into dir and fsyncs it (and dir, with sync on).
func (s *Store) writeMarker(dir string, mk marker) error {
	b, err := json.Marshal(mk)
	if err != nil {
		return err
	}
	f, err := os.OpenFile(filepath.Join(dir, MarkerName), os.O_WRONLY|os.O_CREATE|os.O_TRUNC|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return err
	}
	_, err = f.Write(append(b, '\n'))
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// fetched reports whether dest is a completed Fetch of id. A destination completed for another
// snapshot is ErrConflict.
func fetched(id, dest string) (bool, error) {
	fi, err := os.Lstat(dest)
	if err != nil || !fi.IsDir() {
		return false, nil
	}
	f, err := os.OpenFile(filepath.Join(dest, MarkerName), os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return false, nil
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxMarkerSize))
	if err != nil {
		return false, nil
	}
	var mk marker
	if json.Unmarshal(b, &mk) != nil || mk.ID == "" {
		return false, nil
	}
	if mk.ID != id {
		return false, fmt.Errorf("snapshot %s: %s holds snapshot %s: %w", id, dest, mk.ID, errdefs.ErrConflict)
	}
	return true, nil
}

// Adopt makes dir count as a completed Fetch of snapshot id, so that Fetch into dir loads
// nothing: it writes the marker (fsynced), naming the stored manifest. It is for the directory
// a snapshot was saved from (a node's own capture), whose content the caller vouches for:
// nothing in dir is read or verified. A snapshot that is not stored is ErrNotFound.
func (s *Store) Adopt(ctx context.Context, id, dir string) error {
	if s.cfgErr != nil {
		return s.cfgErr
	}
	m, err := s.Stat(ctx, id)
	if err != nil {
		return err
	}
	if fi, err := os.Lstat(dir); err != nil || !fi.IsDir() {
		return fmt.Errorf("snapshot %s: adopt %s: not a directory: %w", id, dir, errdefs.ErrInvalid)
	}
	if err := s.writeMarker(dir, marker{ID: id, Checksum: m.Checksum}); err != nil {
		return fmt.Errorf("snapshot %s: %w", id, err)
	}
	return syncPath(dir)
}
