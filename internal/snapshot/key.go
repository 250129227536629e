package snapshot

import (
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// KeySize is the size of the signing keys LoadOrCreateKey creates.
const KeySize = 32

// maxKeyFileSize bounds a key file LoadOrCreateKey reads.
const maxKeyFileSize = 4 << 10

// LoadOrCreateKey returns the manifest signing key (for WithSigningKey) kept in the file at
// path, creating the file with KeySize random bytes, mode 0600, if it does not exist. Creation
// is atomic: the key is written and fsynced under a temporary name and linked into place, so
// concurrent callers all end up with the one key that won, and a crash leaves the old state or
// the whole key. An existing file must be a regular file (not a symlink) of MinKeySize to 4096
// bytes, readable by its owner only (mode 0600 or stricter); otherwise the error is
// ErrInvalid. The key is used as raw bytes, so a cluster can distribute any such file.
func LoadOrCreateKey(path string) ([]byte, error) {
	key, err := readKey(path)
	if !errors.Is(err, fs.ErrNotExist) {
		return key, err
	}
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("snapshot key: %w", err)
	}
	key = make([]byte, KeySize)
	if _, err := rand.Read(key); err != nil {
		return nil, fmt.Errorf("snapshot key: %w", err)
	}
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-")
	if err != nil {
		return nil, fmt.Errorf("snapshot key: %w", err)
	}
	tmp := f.Name()
	defer os.Remove(tmp)
	_, err = f.Write(key)
	if err == nil {
		err = f.Chmod(0o600) // CreateTemp makes 0600 already; be explicit about it
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, fmt.Errorf("snapshot key: %w", err)
	}
	// link(2) fails if path exists: whoever links first wins, the others read the winner's.
	if err := os.Link(tmp, path); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return readKey(path)
		}
		return nil, fmt.Errorf("snapshot key: %w", err)
	}
	if err := syncPath(dir); err != nil {
		return nil, fmt.Errorf("snapshot key: %w", err)
	}
	return key, nil
}

func readKey(path string) ([]byte, error) {
	fi, err := os.Lstat(path)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, err
		}
		return nil, fmt.Errorf("snapshot key: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("snapshot key %s: not a regular file: %w", path, errdefs.ErrInvalid)
	}
	if fi.Mode().Perm()&0o077 != 0 {
		return nil, fmt.Errorf("snapshot key %s: mode %v lets others read it, want 0600: %w", path, fi.Mode().Perm(), errdefs.ErrInvalid)
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("snapshot key: %w", err)
	}
	defer f.Close()
	key, err := io.ReadAll(io.LimitReader(f, maxKeyFileSize+1))
	if err != nil {
		return nil, fmt.Errorf("snapshot key: %w", err)
	}
	if len(key) < MinKeySize || len(key) > maxKeyFileSize {
		return nil, fmt.Errorf("snapshot key %s: %d bytes, want %d to %d: %w", path, len(key), MinKeySize, maxKeyFileSize, errdefs.ErrInvalid)
	}
	return key, nil
}
