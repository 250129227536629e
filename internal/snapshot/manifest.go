package snapshot

import (
	"bytes"
	"crypto/hmac"
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
// an attacker who can also rewrite the checksum. A Store with a signing key (WithSigningKey)
// also appends an HMAC trailer to the stored manifest, which does stop such an attacker.
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

// Stored manifest format: the JSON body, then, when the store signs, one trailer line
//
//	\nhmac-sha256 <64 hex digits>\n
//
// holding HMAC-SHA256(key, macDomain || id || "\n" || body). The id is bound into the MAC, so a
// manifest copied to another id does not verify; the trailer is checked before the body is
// parsed, so nothing an unsigned body declares is ever looked at.
const (
	macPrefix  = "\nhmac-sha256 "
	macDomain  = "ember snapshot manifest v1\n"
	trailerLen = len(macPrefix) + 2*sha256.Size + 1
)

// errSignature is what a missing or wrong manifest MAC reports.
var errSignature = fmt.Errorf("manifest signature invalid: %w", errdefs.ErrCorrupt)

func manifestMAC(key []byte, id string, body []byte) []byte {
	h := hmac.New(sha256.New, key)
	h.Write([]byte(macDomain))
	h.Write([]byte(id))
	h.Write([]byte{'\n'})
	h.Write(body)
	return h.Sum(nil)
}

// splitTrailer separates a stored manifest into its body and its MAC; mac is nil when b has
// no well-formed trailer.
func splitTrailer(b []byte) (body, mac []byte) {
	if len(b) < trailerLen {
		return b, nil
	}
	t := b[len(b)-trailerLen:]
	if !bytes.HasPrefix(t, []byte(macPrefix)) || t[len(t)-1] != '\n' {
		return b, nil
	}
	mac, err := hex.DecodeString(string(t[len(macPrefix) : len(t)-1]))
	if err != nil {
		return b, nil
	}
	return b[:len(b)-trailerLen], mac
}

// seal sets the checksum and returns the manifest as stored: its JSON, followed by the MAC
// trailer when key is not empty.
func (m *Manifest) seal(key []byte) ([]byte, error) {
	sum, err := m.computeChecksum()
	if err != nil {
		return nil, err
	}
	m.Checksum = sum
	body, err := json.MarshalIndent(m, "", " ")
	if err != nil {
		return nil, err
	}
	if len(key) == 0 {
		return body, nil
	}
	mac := manifestMAC(key, m.ID, body)
	return append(body, macPrefix+hex.EncodeToString(mac)+"\n"...), nil
}

// limits bound what a manifest may declare. They are checked before anything is allocated or
// created from a manifest's figures.
type limits struct {
	maxChunkSize  int64 // largest chunk_size accepted
	maxImageBytes int64 // sum of all file sizes
	maxFiles      int   // entries (files and directories)
}

// Bounds on paths in a manifest, as Linux has them.
const (
	maxPathLen = 4096
	maxNameLen = 255
)

// decodeManifest verifies and parses a stored manifest: the MAC first (when key is set), then
// the JSON, its checksum and its structure against lim. Any failure is ErrCorrupt.
func decodeManifest(id string, b []byte, key []byte, lim limits) (*Manifest, error) {
	body, mac := splitTrailer(b)
	if len(key) > 0 {
		if mac == nil || !hmac.Equal(mac, manifestMAC(key, id, body)) {
			return nil, fmt.Errorf("snapshot %s: %w", id, errSignature)
		}
	}
	if err := precheck(id, body, lim); err != nil {
		return nil, fmt.Errorf("snapshot %s: manifest: %v: %w", id, err, errdefs.ErrCorrupt)
	}
	var m Manifest
	if err := json.Unmarshal(body, &m); err != nil {
		return nil, fmt.Errorf("snapshot %s: manifest: %v: %w", id, err, errdefs.ErrCorrupt)
	}
	sum, err := m.computeChecksum()
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: manifest: %v: %w", id, err, errdefs.ErrCorrupt)
	}
	if sum != m.Checksum {
		return nil, fmt.Errorf("snapshot %s: manifest: checksum mismatch: %w", id, errdefs.ErrCorrupt)
	}
	if err := m.validate(id, lim); err != nil {
		return nil, fmt.Errorf("snapshot %s: manifest: %v: %w", id, err, errdefs.ErrCorrupt)
	}
	return &m, nil
}

// precheck bounds what decoding body can allocate, before it is decoded: it reads the header
// fields alone (json skips the rest without allocating), checks the chunk size, and from it
// and lim bounds how many objects and array elements the body may hold, by counting '{' and
// ',' (an overcount, since strings may hold them too). Without it, 256 MiB of "[0,0,0,...]"
// would decode into gigabytes of empty entries.
func precheck(id string, body []byte, lim limits) error {
	var h struct {
		Version   int    `json:"version"`
		ID        string `json:"id"`
		ChunkSize int64  `json:"chunk_size"`
	}
	if err := json.Unmarshal(body, &h); err != nil {
		return err
	}
	if h.Version != ManifestVersion {
		return fmt.Errorf("unsupported version %d", h.Version)
	}
	if h.ID != id {
		return fmt.Errorf("records id %q", h.ID)
	}
	if h.ChunkSize < MinChunkSize || h.ChunkSize > lim.maxChunkSize {
		return fmt.Errorf("chunk size %d outside [%d, %d]", h.ChunkSize, MinChunkSize, lim.maxChunkSize)
	}
	files := int64(lim.maxFiles)
	chunks := lim.maxImageBytes/h.ChunkSize + files // every file's last chunk may be short
	objects := 1 + files + chunks
	elements := 8 + 4*files + 2*chunks // a file has 3 commas and a separator, a chunk 1 and 1
	if n := int64(bytes.Count(body, []byte("{"))); n > objects {
		return fmt.Errorf("%d objects, more than %d entries and chunks within the limits", n, objects)
	}
	if n := int64(bytes.Count(body, []byte(","))); n > elements {
		return fmt.Errorf("%d elements, more than %d entries and chunks within the limits", n, elements)
	}
	return nil
}

// validate checks the structure a loader relies on, so a manifest can never make Load write
// outside its destination, misplace data, or allocate or create more than lim allows: every
// file's chunks are exactly the chunk_size pieces Save cuts (all full but the last), so the
// chunk count follows from the file size, and the sizes are bounded before they are summed.
func (m *Manifest) validate(id string, lim limits) error {
	if m.Version != ManifestVersion {
		return fmt.Errorf("unsupported version %d", m.Version)
	}
	if m.ID != id {
		return fmt.Errorf("records id %q", m.ID)
	}
	if m.ChunkSize < MinChunkSize || m.ChunkSize > lim.maxChunkSize {
		return fmt.Errorf("chunk size %d outside [%d, %d]", m.ChunkSize, MinChunkSize, lim.maxChunkSize)
	}
	if len(m.Files) > lim.maxFiles {
		return fmt.Errorf("%d entries, more than the limit of %d", len(m.Files), lim.maxFiles)
	}
	seen := make(map[string]bool, len(m.Files))
	var total int64
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
		if f.IsDir() {
			if len(f.Chunks) > 0 || f.Size != 0 {
				return fmt.Errorf("%s: directory with data", f.Path)
			}
			continue
		}
		if f.Size < 0 || f.Size > lim.maxImageBytes-total {
			return fmt.Errorf("%s: size %d: snapshot larger than the limit of %d bytes", f.Path, f.Size, lim.maxImageBytes)
		}
		total += f.Size
		want := f.Size / m.ChunkSize
		if f.Size%m.ChunkSize != 0 {
			want++
		}
		if int64(len(f.Chunks)) != want {
			return fmt.Errorf("%s: %d chunks for %d bytes in chunks of %d, want %d", f.Path, len(f.Chunks), f.Size, m.ChunkSize, want)
		}
		for i, c := range f.Chunks {
			if !validHash(c.Hash) {
				return fmt.Errorf("%s: bad chunk %q", f.Path, c.Hash)
			}
			size := m.ChunkSize
			if int64(i) == want-1 {
				size = f.Size - (want-1)*m.ChunkSize
			}
			if c.Size != size {
				return fmt.Errorf("%s: chunk %d has %d bytes, want %d", f.Path, i, c.Size, size)
			}
		}
	}
	return nil
}

func validRelPath(p string) bool {
	if p == "" || len(p) > maxPathLen || strings.HasPrefix(p, "/") || strings.ContainsRune(p, 0) || path.Clean(p) != p {
		return false
	}
	for _, seg := range strings.Split(p, "/") {
		if seg == ".." || seg == "." || len(seg) > maxNameLen {
			return false
		}
	}
	// The completion marker is the store's; a snapshot cannot bring its own.
	return p != MarkerName
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
