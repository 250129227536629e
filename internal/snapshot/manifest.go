package snapshot

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io/fs"
	"path"
	"strings"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// ManifestVersion is the format version written into every manifest.
const ManifestVersion = 1

// Manifest describes one snapshot: every directory and regular file under the saved directory,
// and for each file the content-addressed chunks that make it up, in order. Checksum is the
// sha256 of the manifest's JSON encoding with Checksum empty; it catches corruption, not
// an attacker who can also rewrite the checksum.
type Manifest struct {
	Version   int       `json:"version"`
	ID        string    `json:"id"`
	Created   time.Time `json:"created"`
	ChunkSize int64     `json:"chunk_size"`
	// Files lists directories and regular files, parents before children, paths relative
	// and slash-separated.
	Files    []File `json:"files"`
	Checksum string `json:"checksum"`

	// Transfer counts what the Save or Load call that returned this manifest moved. It is
	// not stored.
	Transfer Transfer `json:"-"`
}

// File is one entry of a manifest.
type File struct {
	Path   string      `json:"path"`
	Mode   fs.FileMode `json:"mode"` // permission bits, plus fs.ModeDir for directories
	Size   int64       `json:"size"`
	Chunks []Chunk     `json:"chunks,omitempty"`
}

// IsDir reports whether the entry is a directory.
func (f File) IsDir() bool { return f.Mode&fs.ModeDir != 0 }

// Chunk is a piece of a file, stored under its sha256.
type Chunk struct {
	Hash string `json:"hash"` // lowercase hex sha256 of the chunk's bytes
	Size int64  `json:"size"`
}

// Transfer counts the bytes and chunks one Save or Load moved.
type Transfer struct {
	Chunks         int   // distinct chunks the snapshot references
	UploadedChunks int   // chunks Save wrote because the backend lacked them
	UploadedBytes  int64 // bytes of those chunks
	ReusedChunks   int   // chunks Save found already stored
	CacheHits      int   // chunks Load read from the node-local cache
	FetchedChunks  int   // chunks Load read from the backend
	FetchedBytes   int64
	ZeroChunks     int // all-zero chunks Load left as holes without reading
}

// TotalSize is the sum of the sizes of the manifest's files.
func (m *Manifest) TotalSize() int64 {
	var n int64
	for _, f := range m.Files {
		n += f.Size
	}
	return n
}

func (m *Manifest) computeChecksum() (string, error) {
	c := *m
	c.Checksum = ""
	b, err := json.Marshal(&c)
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:]), nil
}

func (m *Manifest) seal() ([]byte, error) {
	sum, err := m.computeChecksum()
	if err != nil {
		return nil, err
	}
	m.Checksum = sum
	return json.MarshalIndent(m, "", " ")
}

// decodeManifest parses and verifies a stored manifest. Any inconsistency is ErrCorrupt.
func decodeManifest(id string, b []byte) (*Manifest, error) {
	var m Manifest
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("snapshot %s: manifest: %v: %w", id, err, errdefs.ErrCorrupt)
	}
	sum, err := m.computeChecksum()
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: manifest: %v: %w", id, err, errdefs.ErrCorrupt)
	}
	if sum != m.Checksum {
		return nil, fmt.Errorf("snapshot %s: manifest: checksum mismatch: %w", id, errdefs.ErrCorrupt)
	}
	if err := m.validate(id); err != nil {
		return nil, fmt.Errorf("snapshot %s: manifest: %v: %w", id, err, errdefs.ErrCorrupt)
	}
	return &m, nil
}

// validate checks the structure a loader relies on, so a manifest can never make Load write
// outside its destination.
func (m *Manifest) validate(id string) error {
	if m.Version != ManifestVersion {
		return fmt.Errorf("unsupported version %d", m.Version)
	}
	if m.ID != id {
		return fmt.Errorf("records id %q", m.ID)
	}
	seen := make(map[string]bool, len(m.Files))
	for _, f := range m.Files {
		if !validRelPath(f.Path) {
			return fmt.Errorf("bad path %q", f.Path)
		}
		if seen[f.Path] {
			return fmt.Errorf("duplicate path %q", f.Path)
		}
		if dir := path.Dir(f.Path); dir != "." && !seen[dir] {
			return fmt.Errorf("path %q listed before its directory", f.Path)
		}
		seen[f.Path] = true
		if f.Mode&^(fs.ModeDir|fs.ModePerm) != 0 {
			return fmt.Errorf("%s: unsupported mode %v", f.Path, f.Mode)
		}
		var sum int64
		for _, c := range f.Chunks {
			if !validHash(c.Hash) || c.Size <= 0 {
				return fmt.Errorf("%s: bad chunk %q", f.Path, c.Hash)
			}
			sum += c.Size
		}
		if f.IsDir() && (len(f.Chunks) > 0 || f.Size != 0) {
			return fmt.Errorf("%s: directory with data", f.Path)
		}
		if sum != f.Size {
			return fmt.Errorf("%s: chunks add up to %d bytes, size is %d", f.Path, sum, f.Size)
		}
	}
	return nil
}

func validRelPath(p string) bool {
	if p == "" || strings.HasPrefix(p, "/") || path.Clean(p) != p {
		return false
	}
	for _, seg := range strings.Split(p, "/") {
		if seg == ".." || seg == "." {
			return false
		}
	}
	return true
}

func validHash(h string) bool {
	if len(h) != sha256.Size*2 {
		return false
	}
	for _, c := range h {
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}
