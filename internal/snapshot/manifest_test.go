package snapshot

import (
	"errors"
	"io/fs"
	"strings"
	"testing"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// A manifest with a correct checksum can still be hostile (the checksum is not a signature);
// decodeManifest must refuse anything that would make Load write outside its destination or
// misplace data.
func TestDecodeManifestRefusesBadStructure(t *testing.T) {
	hash := strings.Repeat("ab", 32)
	good := func() *Manifest {
		return &Manifest{Version: ManifestVersion, ID: "s", ChunkSize: MinChunkSize, Files: []File{
			{Path: "d", Mode: fs.ModeDir | 0o755},
			{Path: "d/f", Mode: 0o644, Size: 4, Chunks: []Chunk{{Hash: hash, Size: 4}}},
		}}
	}
	for _, tc := range []struct {
		name   string
		id     string
		mutate func(m *Manifest)
		want   string
	}{
		{"valid", "s", func(m *Manifest) {}, ""},
		{"parent escape", "s", func(m *Manifest) { m.Files[1].Path = "../f" }, "bad path"},
		{"absolute path", "s", func(m *Manifest) { m.Files[1].Path = "/etc/passwd" }, "bad path"},
		{"unclean path", "s", func(m *Manifest) { m.Files[1].Path = "d/./f" }, "bad path"},
		{"child before parent", "s", func(m *Manifest) { m.Files[0], m.Files[1] = m.Files[1], m.Files[0] }, "before its directory"},
		{"duplicate", "s", func(m *Manifest) { m.Files = append(m.Files, m.Files[1]) }, "duplicate"},
		{"symlink mode", "s", func(m *Manifest) { m.Files[1].Mode |= fs.ModeSymlink }, "unsupported mode"},
		{"setuid mode", "s", func(m *Manifest) { m.Files[1].Mode |= fs.ModeSetuid }, "unsupported mode"},
		{"sizes disagree", "s", func(m *Manifest) { m.Files[1].Size = 5 }, "has 4 bytes, want 5"},
		{"bad hash", "s", func(m *Manifest) { m.Files[1].Chunks[0].Hash = "../../x" }, "bad chunk"},
		{"directory with data", "s", func(m *Manifest) { m.Files[0].Chunks = m.Files[1].Chunks; m.Files[0].Size = 4 }, "directory with data"},
		{"other id", "t", func(m *Manifest) {}, "records id"},
		{"future version", "s", func(m *Manifest) { m.Version = 99 }, "unsupported version"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := good()
			tc.mutate(m)
			b, err := m.seal(nil) // a valid checksum over the bad content
			if err != nil {
				t.Fatal(err)
			}
			_, err = decodeManifest(tc.id, b, nil, New(nil).limits())
			if tc.want == "" {
				if err != nil {
					t.Fatalf("decodeManifest = %v", err)
				}
				return
			}
			if !errors.Is(err, errdefs.ErrCorrupt) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("decodeManifest error = %v, want ErrCorrupt mentioning %q", err, tc.want)
			}
		})
	}
}

func TestValidateKey(t *testing.T) {
	for _, tc := range []struct {
		key string
		ok  bool
	}{
		{"chunks/ab/abcd", true}, {"manifests/x.json", true}, {"a", true},
		{"", false}, {"/a", false}, {"a/", false}, {"a//b", false}, {"a/../b", false}, {".x", false}, {"a/.tmp-1", false},
	} {
		if err := ValidateKey(tc.key); (err == nil) != tc.ok {
			t.Errorf("ValidateKey(%q) = %v, want ok=%v", tc.key, err, tc.ok)
		}
	}
}

// The MAC trailer: verified before the body is parsed, bound to the id, absent without a key.
func TestManifestSignature(t *testing.T) {
	key := []byte("0123456789abcdef0123456789abcdef")
	lim := New(nil).limits()
	m := &Manifest{Version: ManifestVersion, ID: "s", ChunkSize: MinChunkSize, Files: []File{{Path: "d", Mode: fs.ModeDir | 0o755}}}
	signed, err := m.seal(key)
	if err != nil {
		t.Fatal(err)
	}
	if _, mac := splitTrailer(signed); mac == nil {
		t.Fatalf("signed manifest has no trailer:\n%s", signed)
	}
	unsigned, err := m.seal(nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, mac := splitTrailer(unsigned); mac != nil {
		t.Fatal("manifest sealed without a key has a trailer")
	}
	for _, tc := range []struct {
		name  string
		id    string
		data  []byte
		key   []byte
		valid bool
	}{
		{"signed, right key", "s", signed, key, true},
		{"signed, no key configured", "s", signed, nil, true},
		{"unsigned, key configured", "s", unsigned, key, false},
		{"wrong key", "s", signed, []byte("fedcba9876543210fedcba9876543210"), false},
		{"other id", "t", signed, key, false},
		{"garbage not parsed", "s", []byte(`{"version":`), key, false},
		{"trailer alone", "s", signed[len(signed)-trailerLen:], key, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := decodeManifest(tc.id, tc.data, tc.key, lim)
			if tc.valid {
				if err != nil {
					t.Fatalf("decodeManifest = %v", err)
				}
				return
			}
			if !errors.Is(err, errdefs.ErrCorrupt) || !strings.Contains(err.Error(), "manifest signature invalid") {
				t.Errorf("decodeManifest error = %v, want ErrCorrupt: manifest signature invalid", err)
			}
		})
	}
}
