// Package snapshot owns ember's snapshot store: it saves a directory (a gVisor checkpoint image)
// as sha256-addressed chunks plus a checksummed manifest in a blob Backend, so a later snapshot
// of the same lineage stores only the chunks that changed, and loads it back into a directory
// after verifying every chunk. Backends live in subpackages (local/, s3/) and all pass the shared
// suite in snapshottest/. It knows nothing of sandboxes, runsc or the metadata store.
//
// Everything read from a backend is untrusted: manifests are bounded (chunk size, chunk count
// against file size, entries, total bytes) before any figure in them is used, and with a
// signing key (WithSigningKey, LoadOrCreateKey) they are authenticated by an HMAC bound to the
// snapshot id, so write access to the bucket alone cannot inject or alter a snapshot. Fetch
// loads a snapshot into a node-local directory once, however many callers want it at once.
//
// Layout in a backend:
//
//	manifests/<id>.json            written last (create-if-absent where the backend can): a
//	                               snapshot exists once its manifest does; JSON, then an HMAC
//	                               trailer line when signed
//	chunks/<hh>/<sha256 hex>       chunk bytes, <hh> = first two hex digits
package snapshot

import (
	"context"
	"fmt"
	"io"
	"regexp"
	"strings"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// Backend is a flat blob store. Keys are slash-separated relative paths whose segments do not
// start with a dot. Implementations must make Put atomic: a concurrent or later Get sees the
// whole new object or none of it, never a prefix.
type Backend interface {
	// Put stores size bytes read from r under key, replacing any existing object. If r yields
	// a different number of bytes, Put fails and stores nothing.
	Put(ctx context.Context, key string, r io.Reader, size int64) error
	// Get opens the object; a missing key is errdefs.ErrNotFound.
	Get(ctx context.Context, key string) (io.ReadCloser, error)
	// Exists reports whether key is stored.
	Exists(ctx context.Context, key string) (bool, error)
	// Delete removes key; deleting a missing key is not an error.
	Delete(ctx context.Context, key string) error
	// List returns every key that starts with prefix, in no particular order.
	List(ctx context.Context, prefix string) ([]string, error)
}

// Creator is an optional Backend extension: Create stores key like Put, but only if no object
// is stored under key, atomically (two concurrent Creates of one key: exactly one succeeds). An
// existing key is errdefs.ErrConflict. Save writes manifests with it when the backend has it, so
// two Saves of one id on different nodes cannot both succeed.
type Creator interface {
	Create(ctx context.Context, key string, r io.Reader, size int64) error
}

const (
	manifestPrefix = "manifests/"
	manifestSuffix = ".json"
	chunkPrefix    = "chunks/"
)

// ManifestKey is the backend key of snapshot id's manifest.
func ManifestKey(id string) string { return manifestPrefix + id + manifestSuffix }

// ChunkKey is the backend key of the chunk with this sha256 (lowercase hex).
func ChunkKey(hash string) string { return chunkPrefix + hash[:2] + "/" + hash }

var idRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)

// ValidateID checks a snapshot id: 1-128 characters of letters, digits, '.', '_' and '-',
// starting with a letter or digit.
func ValidateID(id string) error {
	if !idRE.MatchString(id) {
		return fmt.Errorf("snapshot id %q: want 1-128 of [A-Za-z0-9._-], starting alphanumeric: %w", id, errdefs.ErrInvalid)
	}
	return nil
}

// ValidateKey checks a backend key; backends call it on every key they are given.
func ValidateKey(key string) error {
	if key == "" || strings.HasPrefix(key, "/") || strings.HasSuffix(key, "/") {
		return fmt.Errorf("blob key %q: %w", key, errdefs.ErrInvalid)
	}
	for _, seg := range strings.Split(key, "/") {
		if seg == "" || strings.HasPrefix(seg, ".") || strings.ContainsRune(seg, 0) {
			return fmt.Errorf("blob key %q: %w", key, errdefs.ErrInvalid)
		}
	}
	return nil
}
