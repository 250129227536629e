package snapshot

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/overlayfs"
)

// DefaultChunkSize is the fixed chunk size Save uses unless WithChunkSize says otherwise.
// Measured on two checkpoints of one idle gVisor sandbox (69 MiB image, 10 s apart): 1 MiB
// chunks stored 6.8 MiB for the first and 8.0 MiB new for the second, 4 MiB chunks 15.8 and
// 13.0 MiB. Content-defined chunking did no better than fixed chunks of its average size: the
// pages file is laid out by memory-file offset, so changes overwrite in place and never shift.
const DefaultChunkSize = 1 << 20

// Bounds on chunk sizes. Save clamps WithChunkSize into them; Load refuses a manifest whose
// chunk size is below MinChunkSize or above the larger of the store's chunk size and
// DefaultChunkSize (each concurrent transfer holds one chunk in memory).
const (
	MinChunkSize = 64 << 10
	MaxChunkSize = 64 << 20
)

// Defaults of WithMaxImageBytes and WithMaxFiles.
const (
	DefaultMaxImageBytes = 64 << 30
	DefaultMaxFiles      = 1 << 16
)

// MinKeySize is the shortest signing key WithSigningKey accepts.
const MinKeySize = 16

// maxManifestSize bounds how much of a manifest Stat reads (a 1 TiB snapshot in 1 MiB chunks
// is about 120 MiB of JSON).
const maxManifestSize = 256 << 20

// Store saves directories as snapshots into a Backend and loads them back.
//
// Concurrency guarantees:
//   - Two Saves of one id at once: exactly one succeeds, the other fails with ErrConflict. Within
//     one Store this holds for any backend; across Stores (processes, nodes) it holds when the
//     backend implements Creator (local and s3 do). A Save never deletes anything, so the loser
//     cannot remove chunks the winner's manifest needs; its unreferenced uploads are left to GC.
//   - Fetch of one id into one destination by many callers at once does one load.
//   - GC and Delete never remove a chunk that a manifest being written by the same Store needs:
//     Save, Load and Fetch hold the GC lock shared for their whole run, GC holds it exclusively.
//     GC must not run while another Store (another process or node) saves into the same
//     backend: it would delete chunks that the other Save uploaded (or found already stored)
//     but has not referenced yet.
type Store struct {
	backend       Backend
	cache         *cache
	chunkSize     int64
	concurrency   int
	sync          bool
	log           *slog.Logger
	signingKey    []byte
	maxImageBytes int64
	maxFiles      int
	cfgErr        error

	gcMu   sync.RWMutex
	bufs   sync.Pool
	zeros  sync.Map // chunk size -> hex sha256 of that many zero bytes
	nzeros atomic.Int64

	mu      sync.Mutex
	saving  map[string]bool    // ids with a Save in progress
	flights map[string]*flight // Fetches in progress, by destination
}

// Option configures a Store.
type Option func(*Store)

// WithCache keeps every chunk read from (or written to) the backend in dir, and reads chunks
// from there first. Cached chunks are verified like any other; a bad one is dropped and fetched
// again. Use it in front of a remote backend.
func WithCache(dir string) Option { return func(s *Store) { s.cache = &cache{dir: dir, log: s.log} } }

// WithChunkSize sets the chunk size for Save (default 1 MiB, clamped to [MinChunkSize,
// MaxChunkSize]). Load reads any chunk size from MinChunkSize up to the larger of this and
// DefaultChunkSize.
func WithChunkSize(n int64) Option { return func(s *Store) { s.chunkSize = n } }

// WithConcurrency sets how many chunks are hashed and transferred at once (default
// 2*GOMAXPROCS, at least 4). Each holds one chunk-sized buffer.
func WithConcurrency(n int) Option { return func(s *Store) { s.concurrency = n } }

// WithoutLoadSync skips fsync of restored files before Load renames the directory into place.
// Faster, but after a power loss destDir may exist with missing data.
func WithoutLoadSync() Option { return func(s *Store) { s.sync = false } }

// WithLogger sets the logger (default slog.Default()).
func WithLogger(l *slog.Logger) Option {
	return func(s *Store) {
		s.log = l
		if s.cache != nil {
			s.cache.log = l
		}
	}
}

// WithSigningKey authenticates manifests with HMAC-SHA256 under key (at least MinKeySize
// bytes; LoadOrCreateKey makes one): Save appends the MAC, and Stat, Load, Fetch refuse a
// manifest whose MAC is missing or wrong with ErrCorrupt ("manifest signature invalid") before
// reading any of its fields. The MAC covers the snapshot id, so a manifest copied to another
// id does not verify. Every node sharing a backend must use the same key, kept outside the
// backend: then write access to the backend alone cannot inject or alter a snapshot. A shorter
// key makes every call of the Store fail with ErrInvalid.
func WithSigningKey(key []byte) Option {
	return func(s *Store) { s.signingKey = bytes.Clone(key) }
}

// WithMaxImageBytes bounds the total size of the files of one snapshot (default
// DefaultMaxImageBytes). Save refuses a larger directory with ErrExhausted; Stat, Load and
// Fetch refuse a manifest declaring more with ErrCorrupt.
func WithMaxImageBytes(n int64) Option { return func(s *Store) { s.maxImageBytes = n } }

// WithMaxFiles bounds the number of entries (files and directories) of one snapshot (default
// DefaultMaxFiles), like WithMaxImageBytes.
func WithMaxFiles(n int) Option { return func(s *Store) { s.maxFiles = n } }

// New returns a Store over backend.
func New(backend Backend, opts ...Option) *Store {
	s := &Store{
		backend:       backend,
		chunkSize:     DefaultChunkSize,
		concurrency:   max(4, 2*runtime.GOMAXPROCS(0)),
		sync:          true,
		log:           slog.Default(),
		maxImageBytes: DefaultMaxImageBytes,
		maxFiles:      DefaultMaxFiles,
		saving:        map[string]bool{},
		flights:       map[string]*flight{},
	}
	for _, o := range opts {
		o(s)
	}
	if s.chunkSize <= 0 {
		s.chunkSize = DefaultChunkSize
	}
	s.chunkSize = min(max(s.chunkSize, MinChunkSize), MaxChunkSize)
	if s.concurrency <= 0 {
		s.concurrency = 1
	}
	if s.maxImageBytes <= 0 {
		s.maxImageBytes = DefaultMaxImageBytes
	}
	if s.maxFiles <= 0 {
		s.maxFiles = DefaultMaxFiles
	}
	if len(s.signingKey) > 0 && len(s.signingKey) < MinKeySize {
		s.cfgErr = fmt.Errorf("snapshot store: signing key of %d bytes, want at least %d: %w", len(s.signingKey), MinKeySize, errdefs.ErrInvalid)
	}
	return s
}

func (s *Store) limits() limits {
	return limits{maxChunkSize: max(s.chunkSize, DefaultChunkSize), maxImageBytes: s.maxImageBytes, maxFiles: s.maxFiles}
}

// Backend returns the store's backend.
func (s *Store) Backend() Backend { return s.backend }

// Save stores every directory and regular file under srcDir as snapshot id, uploading only the
// chunks the backend does not hold yet, and writes the manifest last. srcDir must not change
// while Save runs. An existing id, or another Save of id in progress, is ErrConflict (see Store
// for the guarantee across nodes); symlinks, devices and other special files are ErrInvalid; a
// directory over the store's limits (WithMaxImageBytes, WithMaxFiles) is ErrExhausted. A file
// named MarkerName at the top of srcDir (left by Fetch) is not saved.
func (s *Store) Save(ctx context.Context, id, srcDir string) (*Manifest, error) {
	if s.cfgErr != nil {
		return nil, s.cfgErr
	}
	if err := ValidateID(id); err != nil {
		return nil, err
	}
	s.mu.Lock()
	busy := s.saving[id]
	s.saving[id] = true
	s.mu.Unlock()
	if busy {
		return nil, fmt.Errorf("snapshot %s: another save of this id is in progress: %w", id, errdefs.ErrConflict)
	}
	defer func() {
		s.mu.Lock()
		delete(s.saving, id)
		s.mu.Unlock()
	}()
	s.gcMu.RLock()
	defer s.gcMu.RUnlock()
	start := time.Now()

	if ok, err := s.backend.Exists(ctx, ManifestKey(id)); err != nil {
		return nil, fmt.Errorf("snapshot %s: %w", id, err)
	} else if ok {
		return nil, fmt.Errorf("snapshot %s: already exists: %w", id, errdefs.ErrConflict)
	}

	m := &Manifest{Version: ManifestVersion, ID: id, Created: time.Now().UTC().Truncate(time.Millisecond), ChunkSize: s.chunkSize}
	var total int64
	err := filepath.WalkDir(srcDir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p == srcDir {
			if !d.IsDir() {
				return fmt.Errorf("%s: not a directory: %w", srcDir, errdefs.ErrInvalid)
			}
			return nil
		}
		rel, err := filepath.Rel(srcDir, p)
		if err != nil {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		f := File{Path: filepath.ToSlash(rel), Mode: info.Mode() & fs.ModePerm}
		if f.Path == MarkerName {
			return nil
		}
		if len(m.Files) >= s.maxFiles {
			return fmt.Errorf("%s: more than %d entries: %w", srcDir, s.maxFiles, errdefs.ErrExhausted)
		}
		if !validRelPath(f.Path) {
			return fmt.Errorf("%s: name cannot be stored: %w", p, errdefs.ErrInvalid)
		}
		switch {
		case d.IsDir():
			f.Mode |= fs.ModeDir
		case d.Type().IsRegular():
			f.Size = info.Size()
			if f.Size > s.maxImageBytes-total {
				return fmt.Errorf("%s: more than %d bytes: %w", srcDir, s.maxImageBytes, errdefs.ErrExhausted)
			}
			total += f.Size
			n := (f.Size + s.chunkSize - 1) / s.chunkSize
			f.Chunks = make([]Chunk, n)
		default:
			return fmt.Errorf("%s: unsupported file type %v: %w", p, info.Mode().Type(), errdefs.ErrInvalid)
		}
		m.Files = append(m.Files, f)
		return nil
	})
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			err = fmt.Errorf("%w: %w", err, errdefs.ErrNotFound)
		}
		return nil, fmt.Errorf("snapshot %s: %w", id, err)
	}

	var (
		mu      sync.Mutex
		claimed = map[string]bool{}
	)
	type job struct {
		file, chunk int
		buf         *[]byte
		n           int
	}
	jobs := make(chan job, s.concurrency)
	g, gctx := newGroup(ctx)
	g.Go(func() error {
		defer close(jobs)
		for fi := range m.Files {
			f := &m.Files[fi]
			if f.IsDir() {
				continue
			}
			if err := s.readFile(gctx, srcDir, f, func(ci int, buf *[]byte, n int) error {
				select {
				case jobs <- job{fi, ci, buf, n}:
					return nil
				case <-gctx.Done():
					s.putBuf(buf)
					return gctx.Err()
				}
			}); err != nil {
				return err
			}
		}
		return nil
	})
	for range s.concurrency {
		g.Go(func() error {
			for j := range jobs {
				err := func() error {
					defer s.putBuf(j.buf)
					data := (*j.buf)[:j.n]
					sum := sha256.Sum256(data)
					hash := hex.EncodeToString(sum[:])
					mu.Lock()
					m.Files[j.file].Chunks[j.chunk] = Chunk{Hash: hash, Size: int64(j.n)}
					first := !claimed[hash]
					claimed[hash] = true
					mu.Unlock()
					if !first {
						return nil
					}
					if hash == s.zeroHash(int64(j.n)) {
						// All-zero chunks are never stored: Load leaves them as holes. So every
						// stored chunk is one that Load reads and verifies.
						mu.Lock()
						m.Transfer.ZeroChunks++
						mu.Unlock()
						return nil
					}
					uploaded, err := s.putChunk(gctx, hash, data)
					if err != nil {
						return fmt.Errorf("chunk %s of file %s: %w", hash, m.Files[j.file].Path, err)
					}
					mu.Lock()
					if uploaded {
						m.Transfer.UploadedChunks++
						m.Transfer.UploadedBytes += int64(j.n)
					} else {
						m.Transfer.ReusedChunks++
					}
					mu.Unlock()
					return nil
				}()
				if err != nil {
					return err
				}
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return nil, fmt.Errorf("snapshot %s: %w", id, err)
	}
	m.Transfer.Chunks = len(claimed)

	b, err := m.seal(s.signingKey)
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: manifest: %w", id, err)
	}
	if c, ok := s.backend.(Creator); ok {
		err = c.Create(ctx, ManifestKey(id), bytes.NewReader(b), int64(len(b)))
		if errors.Is(err, errdefs.ErrConflict) {
			// A client that retried its own successful create also lands here: the stored
			// manifest is then ours, byte for byte (it records the creation time).
			if stored, rerr := s.readManifest(ctx, id); rerr == nil && bytes.Equal(stored, b) {
				err = nil
			} else {
				return nil, fmt.Errorf("snapshot %s: saved by someone else meanwhile: %w", id, err)
			}
		}
	} else {
		err = s.backend.Put(ctx, ManifestKey(id), bytes.NewReader(b), int64(len(b)))
	}
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: manifest: %w", id, err)
	}
	s.log.Debug("snapshot saved", "snapshot_id", id, "bytes", m.TotalSize(), "chunks", m.Transfer.Chunks,
		"uploaded_bytes", m.Transfer.UploadedBytes, "took", time.Since(start))
	return m, nil
}

// readFile reads f in chunk-sized pieces and hands each to emit with a pooled buffer that
// emit now owns.
func (s *Store) readFile(ctx context.Context, srcDir string, f *File, emit func(ci int, buf *[]byte, n int) error) error {
	fh, err := os.Open(filepath.Join(srcDir, filepath.FromSlash(f.Path)))
	if err != nil {
		return err
	}
	defer fh.Close()
	for ci := range f.Chunks {
		if err := ctx.Err(); err != nil {
			return err
		}
		want := min(s.chunkSize, f.Size-int64(ci)*s.chunkSize)
		buf := s.getBuf(want)
		n, err := io.ReadFull(fh, (*buf)[:want])
		if err != nil {
			s.putBuf(buf)
			if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
				return fmt.Errorf("file %s shrank while saving (read %d bytes of chunk %d): %w", f.Path, n, ci, errdefs.ErrConflict)
			}
			return fmt.Errorf("file %s: %w", f.Path, err)
		}
		if err := emit(ci, buf, n); err != nil {
			return err
		}
	}
	var one [1]byte
	if n, _ := io.ReadFull(fh, one[:]); n > 0 {
		return fmt.Errorf("file %s grew while saving: %w", f.Path, errdefs.ErrConflict)
	}
	return nil
}

// putChunk uploads data under its hash unless the backend has it; it reports whether it did.
func (s *Store) putChunk(ctx context.Context, hash string, data []byte) (bool, error) {
	if s.cache != nil {
		s.cache.write(hash, data)
	}
	key := ChunkKey(hash)
	ok, err := s.backend.Exists(ctx, key)
	if err != nil || ok {
		return false, err
	}
	if err := s.backend.Put(ctx, key, bytes.NewReader(data), int64(len(data))); err != nil {
		return false, err
	}
	return true, nil
}

// Stat reads and verifies snapshot id's manifest. A missing snapshot is ErrNotFound, a damaged
// manifest ErrCorrupt.
func (s *Store) Stat(ctx context.Context, id string) (*Manifest, error) {
	if s.cfgErr != nil {
		return nil, s.cfgErr
	}
	if err := ValidateID(id); err != nil {
		return nil, err
	}
	b, err := s.readManifest(ctx, id)
	if err != nil {
		return nil, err
	}
	return decodeManifest(id, b, s.signingKey, s.limits())
}

func (s *Store) readManifest(ctx context.Context, id string) ([]byte, error) {
	rc, err := s.backend.Get(ctx, ManifestKey(id))
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: %w", id, err)
	}
	defer rc.Close()
	b, err := io.ReadAll(io.LimitReader(rc, maxManifestSize+1))
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: manifest: %w", id, err)
	}
	if len(b) > maxManifestSize {
		return nil, fmt.Errorf("snapshot %s: manifest larger than %d bytes: %w", id, maxManifestSize, errdefs.ErrCorrupt)
	}
	return b, nil
}

// Load restores snapshot id into destDir, which must not exist or be empty. Every chunk is
// verified against its hash; the files are written into a temporary sibling directory that is
// renamed to destDir only when all of them are complete, so a failed Load leaves nothing
// behind. A damaged or incomplete snapshot is ErrCorrupt. Two Loads into one destDir at once:
// one succeeds, the other is ErrConflict; use Fetch for a shared cache directory.
func (s *Store) Load(ctx context.Context, id, destDir string) error {
	start := time.Now()
	m, err := s.Stat(ctx, id)
	if err != nil {
		return err
	}
	destDir = filepath.Clean(destDir)
	if err := checkEmptyOrMissing(destDir); err != nil {
		return fmt.Errorf("snapshot %s: %w", id, err)
	}
	parent := filepath.Dir(destDir)
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return fmt.Errorf("snapshot %s: %w", id, err)
	}
	tmp, err := os.MkdirTemp(parent, "."+filepath.Base(destDir)+".loading-")
	if err != nil {
		return fmt.Errorf("snapshot %s: %w", id, err)
	}
	tr, err := s.loadTree(ctx, m, tmp)
	if err == nil {
		err = s.install(ctx, tmp, destDir)
	}
	if err != nil {
		removeTree(tmp)
		return fmt.Errorf("snapshot %s: %w", id, err)
	}
	s.log.Debug("snapshot loaded", "snapshot_id", id, "bytes", m.TotalSize(), "fetched_bytes", tr.FetchedBytes,
		"cache_hits", tr.CacheHits, "zero_chunks", tr.ZeroChunks, "took", time.Since(start))
	return nil
}

// install renames the complete directory tmp to destDir (missing, or an empty directory) and
// makes the rename durable.
func (s *Store) install(ctx context.Context, tmp, destDir string) error {
	if s.sync {
		if err := syncPath(tmp); err != nil {
			return err
		}
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	// rename(2) itself, not os.Rename: it also replaces an empty directory, atomically.
	if err := syscall.Rename(tmp, destDir); err != nil {
		err = &os.LinkError{Op: "rename", Old: tmp, New: destDir, Err: err}
		if errors.Is(err, fs.ErrExist) || errors.Is(err, syscall.ENOTEMPTY) {
			err = fmt.Errorf("%w: %w", err, errdefs.ErrConflict)
		}
		return err
	}
	if s.sync {
		return syncPath(filepath.Dir(destDir))
	}
	return nil
}

// loadTree writes m's directories and files into dir (an existing, empty directory that the
// caller removes on error), verifying every chunk, and gives dir mode 0755. m is validated:
// nothing here is sized from a figure the limits have not bounded.
func (s *Store) loadTree(ctx context.Context, m *Manifest, tmp string) (tr Transfer, err error) {
	s.gcMu.RLock()
	defer s.gcMu.RUnlock()
	files := make([]*os.File, len(m.Files))
	defer func() {
		for _, f := range files {
			if f != nil {
				f.Close()
			}
		}
	}()

	for i, f := range m.Files {
		p := filepath.Join(tmp, filepath.FromSlash(f.Path))
		if f.IsDir() {
			if err := os.Mkdir(p, 0o700); err != nil {
				return tr, err
			}
			continue
		}
		fh, err := os.OpenFile(p, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			return tr, err
		}
		files[i] = fh
		if err := fh.Truncate(f.Size); err != nil {
			return tr, err
		}
	}

	type job struct {
		file int
		off  int64
		c    Chunk
	}
	var mu sync.Mutex
	seen := map[string]bool{}
	jobs := make(chan job, s.concurrency)
	g, gctx := newGroup(ctx)
	g.Go(func() error {
		defer close(jobs)
		for fi, f := range m.Files {
			var off int64
			for _, c := range f.Chunks {
				seen[c.Hash] = true
				if c.Hash == s.zeroHash(c.Size) {
					mu.Lock()
					tr.ZeroChunks++ // Truncate left a hole that reads as zeros.
					mu.Unlock()
				} else {
					select {
					case jobs <- job{fi, off, c}:
					case <-gctx.Done():
						return gctx.Err()
					}
				}
				off += c.Size
			}
		}
		return nil
	})
	for range s.concurrency {
		g.Go(func() error {
			for j := range jobs {
				err := func() error {
					if err := gctx.Err(); err != nil {
						return err
					}
					buf := s.getBuf(j.c.Size)
					defer s.putBuf(buf)
					data := (*buf)[:j.c.Size]
					hit, err := s.readChunk(gctx, j.c, data)
					if err != nil {
						return err
					}
					if _, err := files[j.file].WriteAt(data, j.off); err != nil {
						return err
					}
					mu.Lock()
					if hit {
						tr.CacheHits++
					} else {
						tr.FetchedChunks++
						tr.FetchedBytes += j.c.Size
					}
					mu.Unlock()
					return nil
				}()
				if err != nil {
					return fmt.Errorf("chunk %s of file %s: %w", j.c.Hash, m.Files[j.file].Path, err)
				}
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return tr, err
	}
	tr.Chunks = len(seen)

	for i, f := range m.Files {
		fh := files[i]
		if fh == nil {
			continue
		}
		if s.sync {
			if err := fh.Sync(); err != nil {
				return tr, fmt.Errorf("%s: %w", f.Path, err)
			}
		}
		if err := fh.Chmod(f.Mode.Perm()); err != nil {
			return tr, fmt.Errorf("%s: %w", f.Path, err)
		}
	}
	for i := len(m.Files) - 1; i >= 0; i-- { // children before parents
		if f := m.Files[i]; f.IsDir() {
			p := filepath.Join(tmp, filepath.FromSlash(f.Path))
			if s.sync {
				if err := syncPath(p); err != nil {
					return tr, err
				}
			}
			if err := os.Chmod(p, f.Mode.Perm()); err != nil {
				return tr, err
			}
		}
	}
	if err := ctx.Err(); err != nil {
		return tr, err
	}
	return tr, os.Chmod(tmp, 0o755)
}

var (
	errChecksum = fmt.Errorf("checksum mismatch: %w", errdefs.ErrCorrupt)
	errMissing  = fmt.Errorf("missing: %w", errdefs.ErrCorrupt)
)

// readChunk fills data (len == c.Size) with chunk c, from the cache if it holds a good copy,
// else from the backend; it reports whether the cache served it.
func (s *Store) readChunk(ctx context.Context, c Chunk, data []byte) (bool, error) {
	if s.cache != nil && s.cache.read(c, data) {
		return true, nil
	}
	rc, err := s.backend.Get(ctx, ChunkKey(c.Hash))
	if errors.Is(err, errdefs.ErrNotFound) {
		return false, errMissing
	}
	if err != nil {
		return false, err
	}
	defer rc.Close()
	if err := readExact(rc, data); err != nil {
		return false, err
	}
	if !hashIs(data, c.Hash) {
		return false, errChecksum
	}
	if s.cache != nil {
		s.cache.write(c.Hash, data)
	}
	return false, nil
}

// readExact fills data from r and checks that r has nothing more.
func readExact(r io.Reader, data []byte) error {
	n, err := io.ReadFull(r, data)
	if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
		return fmt.Errorf("truncated (%d of %d bytes): %w", n, len(data), errdefs.ErrCorrupt)
	}
	if err != nil {
		return err
	}
	var one [1]byte
	if n, _ := io.ReadFull(r, one[:]); n > 0 {
		return fmt.Errorf("longer than %d bytes: %w", len(data), errdefs.ErrCorrupt)
	}
	return nil
}

func hashIs(data []byte, hash string) bool {
	sum := sha256.Sum256(data)
	return hex.EncodeToString(sum[:]) == hash
}

// Delete removes snapshot id's manifest. Its chunks stay until GC finds no manifest that uses
// them. A missing snapshot is ErrNotFound.
func (s *Store) Delete(ctx context.Context, id string) error {
	if err := ValidateID(id); err != nil {
		return err
	}
	ok, err := s.backend.Exists(ctx, ManifestKey(id))
	if err != nil {
		return fmt.Errorf("snapshot %s: %w", id, err)
	}
	if !ok {
		return fmt.Errorf("snapshot %s: %w", id, errdefs.ErrNotFound)
	}
	if err := s.backend.Delete(ctx, ManifestKey(id)); err != nil {
		return fmt.Errorf("snapshot %s: %w", id, err)
	}
	return nil
}

// List returns the ids of all stored snapshots, sorted.
func (s *Store) List(ctx context.Context) ([]string, error) {
	keys, err := s.backend.List(ctx, manifestPrefix)
	if err != nil {
		return nil, fmt.Errorf("list snapshots: %w", err)
	}
	ids := make([]string, 0, len(keys))
	for _, k := range keys {
		id, ok := strings.CutSuffix(strings.TrimPrefix(k, manifestPrefix), manifestSuffix)
		if ok && ValidateID(id) == nil {
			ids = append(ids, id)
		}
	}
	sort.Strings(ids)
	return ids, nil
}

// GCStats says what GC did.
type GCStats struct {
	Snapshots     int // manifests read
	KeptChunks    int
	RemovedChunks int
	RemovedCached int // chunks dropped from the node-local cache
}

// GC deletes every chunk (in the backend and in the cache) that no manifest references. A
// manifest that fails its checksum, signature or limits still protects the chunks it names; one
// that cannot be parsed at all stops GC with ErrCorrupt, since its chunks cannot be known. See
// Store for what GC may run alongside.
func (s *Store) GC(ctx context.Context) (GCStats, error) {
	s.gcMu.Lock()
	defer s.gcMu.Unlock()
	var st GCStats
	ids, err := s.List(ctx)
	if err != nil {
		return st, fmt.Errorf("gc: %w", err)
	}
	refs := map[string]bool{}
	for _, id := range ids {
		b, err := s.readManifest(ctx, id)
		if errors.Is(err, errdefs.ErrNotFound) {
			continue // deleted meanwhile
		}
		if err != nil {
			return st, fmt.Errorf("gc: %w", err)
		}
		m, err := decodeManifest(id, b, s.signingKey, s.limits())
		if err != nil {
			// Keeping chunks is always safe: an unverified manifest may still protect some.
			// One too large to decode safely stops GC, like one that does not parse.
			var raw Manifest
			body, _ := splitTrailer(b)
			if perr := precheck(id, body, s.limits()); perr != nil {
				return st, fmt.Errorf("gc: %w", err)
			}
			if jerr := json.Unmarshal(body, &raw); jerr != nil {
				return st, fmt.Errorf("gc: %w", err)
			}
			s.log.Warn("gc: keeping chunks of a damaged manifest", "snapshot_id", id, "error", err)
			m = &raw
		}
		st.Snapshots++
		for _, f := range m.Files {
			for _, c := range f.Chunks {
				refs[c.Hash] = true
			}
		}
	}
	keys, err := s.backend.List(ctx, chunkPrefix)
	if err != nil {
		return st, fmt.Errorf("gc: %w", err)
	}
	for _, k := range keys {
		if hash := path.Base(k); !validHash(hash) || refs[hash] {
			st.KeptChunks++
			continue
		}
		if err := s.backend.Delete(ctx, k); err != nil {
			return st, fmt.Errorf("gc: %s: %w", k, err)
		}
		st.RemovedChunks++
	}
	if s.cache != nil {
		st.RemovedCached = s.cache.prune(refs)
	}
	s.log.Info("snapshot gc", "snapshots", st.Snapshots, "kept_chunks", st.KeptChunks,
		"removed_chunks", st.RemovedChunks, "removed_cached", st.RemovedCached)
	return st, nil
}

// zeroHash returns the sha256 of size zero bytes. It hashes from a small shared buffer (a
// manifest's sizes never decide an allocation) and remembers a bounded number of sizes.
func (s *Store) zeroHash(size int64) string {
	if h, ok := s.zeros.Load(size); ok {
		return h.(string)
	}
	h := sha256.New()
	for left := size; left > 0; {
		n := min(left, int64(len(zeroBlock)))
		h.Write(zeroBlock[:n])
		left -= n
	}
	sum := hex.EncodeToString(h.Sum(nil))
	if s.nzeros.Add(1) <= maxZeroSizes {
		s.zeros.Store(size, sum)
	}
	return sum
}

// zeroBlock feeds zeroHash; maxZeroSizes bounds how many sizes it remembers (one per file
// tail, plus the chunk sizes).
var zeroBlock [64 << 10]byte

const maxZeroSizes = 1024

func (s *Store) getBuf(n int64) *[]byte {
	if b, ok := s.bufs.Get().(*[]byte); ok && int64(cap(*b)) >= n {
		*b = (*b)[:n]
		return b
	}
	b := make([]byte, n, max(n, s.chunkSize))
	return &b
}

func (s *Store) putBuf(b *[]byte) { s.bufs.Put(b) }

func checkEmptyOrMissing(dir string) error {
	fi, err := os.Lstat(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if !fi.IsDir() {
		return fmt.Errorf("%s exists and is not a directory: %w", dir, errdefs.ErrConflict)
	}
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if names, _ := d.Readdirnames(1); len(names) > 0 {
		return fmt.Errorf("%s is not empty: %w", dir, errdefs.ErrConflict)
	}
	return nil
}

// removeTree removes dir and everything under it (overlayfs.RemoveTree): a snapshot's tree
// holds no mount of ember's, so it removes nothing if something under dir is mounted.
func removeTree(dir string) error { return overlayfs.RemoveTree(dir, overlayfs.RefuseMounts) }

func syncPath(p string) error {
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}

// group runs goroutines and keeps the first error, cancelling the others.
type group struct {
	wg     sync.WaitGroup
	once   sync.Once
	err    error
	cancel context.CancelFunc
}

func newGroup(ctx context.Context) (*group, context.Context) {
	ctx, cancel := context.WithCancel(ctx)
	return &group{cancel: cancel}, ctx
}

func (g *group) Go(f func() error) {
	g.wg.Add(1)
	go func() {
		defer g.wg.Done()
		if err := f(); err != nil {
			g.once.Do(func() { g.err = err; g.cancel() })
		}
	}()
}

func (g *group) Wait() error {
	g.wg.Wait()
	g.cancel()
	return g.err
}
