package snapshottest

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/snapshot"
)

var (
	testKey  = []byte("ember-snapshottest-key-0123456789")
	otherKey = []byte("ember-snapshottest-key-9876543210")
)

// resealBody rewrites a stored manifest's JSON with edit applied and a correct checksum, as an
// attacker with write access to the backend (but not the key) can, keeping whatever trailer
// the original had.
func resealBody(t *testing.T, stored []byte, edit func(m *snapshot.Manifest)) []byte {
	t.Helper()
	body, trailer := stored, []byte(nil)
	if i := bytes.LastIndex(stored, []byte("\nhmac-sha256 ")); i >= 0 {
		body, trailer = stored[:i], stored[i:]
	}
	var m snapshot.Manifest
	if err := json.Unmarshal(body, &m); err != nil {
		t.Fatal(err)
	}
	edit(&m)
	m.Checksum = ""
	raw, err := json.Marshal(&m)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(raw)
	m.Checksum = hex.EncodeToString(sum[:])
	out, err := json.MarshalIndent(&m, "", " ")
	if err != nil {
		t.Fatal(err)
	}
	return append(out, trailer...)
}

// testSigned: with a signing key, a manifest the key did not sign for this id is refused
// before it is used, whatever else about it is right.
func testSigned(t *testing.T, newBackend func(t *testing.T) snapshot.Backend) {
	ctx := context.Background()
	setup := func(t *testing.T) (snapshot.Backend, *snapshot.Store, string) {
		t.Helper()
		b := newBackend(t)
		s := snapshot.New(b, snapshot.WithChunkSize(smallChunk), snapshot.WithSigningKey(testKey))
		src := sampleTree(t)
		for _, id := range []string{"a", "b"} {
			if _, err := s.Save(ctx, id, src); err != nil {
				t.Fatal(err)
			}
		}
		return b, s, src
	}
	assertRefused := func(t *testing.T, s *snapshot.Store, id string) {
		t.Helper()
		const want = "manifest signature invalid"
		if _, err := s.Stat(ctx, id); !errors.Is(err, errdefs.ErrCorrupt) || !strings.Contains(err.Error(), want) {
			t.Errorf("Stat error = %v, want ErrCorrupt: %s", err, want)
		}
		parent := t.TempDir()
		if err := s.Load(ctx, id, filepath.Join(parent, "out")); !errors.Is(err, errdefs.ErrCorrupt) {
			t.Errorf("Load error = %v, want ErrCorrupt", err)
		}
		if err := s.Fetch(ctx, id, filepath.Join(parent, "cached")); !errors.Is(err, errdefs.ErrCorrupt) {
			t.Errorf("Fetch error = %v, want ErrCorrupt", err)
		}
		assertNoLeftovers(t, parent, "")
	}

	t.Run("right key loads", func(t *testing.T) {
		_, s, src := setup(t)
		for _, store := range []*snapshot.Store{s, snapshot.New(s.Backend(), snapshot.WithSigningKey(testKey))} {
			dest := filepath.Join(t.TempDir(), "out")
			if err := store.Load(ctx, "a", dest); err != nil {
				t.Fatal(err)
			}
			assertSameTree(t, src, dest)
		}
	})
	t.Run("store without key still reads signed manifests", func(t *testing.T) {
		_, s, _ := setup(t)
		if _, err := snapshot.New(s.Backend()).Stat(ctx, "a"); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("wrong key", func(t *testing.T) {
		_, s, _ := setup(t)
		assertRefused(t, snapshot.New(s.Backend(), snapshot.WithSigningKey(otherKey)), "a")
	})
	for _, tc := range []struct {
		name   string
		tamper func(t *testing.T, b snapshot.Backend)
	}{
		{"body changed, checksum recomputed", func(t *testing.T, b snapshot.Backend) {
			key := snapshot.ManifestKey("a")
			putAll(t, b, key, resealBody(t, getAll(t, b, key), func(m *snapshot.Manifest) {
				for i := range m.Files {
					m.Files[i].Mode |= 0o007 // world-writable everything
				}
			}))
		}},
		{"signature removed", func(t *testing.T, b snapshot.Backend) {
			key := snapshot.ManifestKey("a")
			stored := getAll(t, b, key)
			i := bytes.LastIndex(stored, []byte("\nhmac-sha256 "))
			if i < 0 {
				t.Fatal("stored manifest has no signature")
			}
			putAll(t, b, key, stored[:i])
		}},
		{"signature damaged", func(t *testing.T, b snapshot.Backend) {
			key := snapshot.ManifestKey("a")
			stored := getAll(t, b, key)
			stored[len(stored)-2] ^= 0x01
			putAll(t, b, key, stored)
		}},
		{"unsigned manifest injected", func(t *testing.T, b snapshot.Backend) {
			if err := b.Delete(ctx, snapshot.ManifestKey("a")); err != nil {
				t.Fatal(err)
			}
			if _, err := snapshot.New(b, snapshot.WithChunkSize(smallChunk)).Save(ctx, "a", sampleTree(t)); err != nil {
				t.Fatal(err)
			}
		}},
		{"manifest of b copied to a", func(t *testing.T, b snapshot.Backend) {
			putAll(t, b, snapshot.ManifestKey("a"), getAll(t, b, snapshot.ManifestKey("b")))
		}},
		{"manifest of b copied to a with its id rewritten", func(t *testing.T, b snapshot.Backend) {
			putAll(t, b, snapshot.ManifestKey("a"), resealBody(t, getAll(t, b, snapshot.ManifestKey("b")),
				func(m *snapshot.Manifest) { m.ID = "a" }))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, s, _ := setup(t)
			tc.tamper(t, b)
			assertRefused(t, s, "a")
			if _, err := s.Stat(ctx, "b"); err != nil {
				t.Errorf("untouched snapshot b: %v", err)
			}
		})
	}
	t.Run("short key", func(t *testing.T) {
		s := snapshot.New(newBackend(t), snapshot.WithSigningKey([]byte("short")))
		if _, err := s.Save(ctx, "x", sampleTree(t)); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("Save with a 5-byte key: %v, want ErrInvalid", err)
		}
		if _, err := s.Stat(ctx, "x"); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("Stat with a 5-byte key: %v, want ErrInvalid", err)
		}
	})
}

// testConcurrentSave: Saves of one id from several Stores (nodes) at once: exactly one wins,
// the rest get ErrConflict, and what is stored is the winner's snapshot, intact after GC.
func testConcurrentSave(t *testing.T, b snapshot.Backend) {
	ctx := context.Background()
	const n = 4
	srcs := make([]string, n)
	for i := range srcs {
		srcs[i] = t.TempDir()
		writeTree(t, srcs[i], []entry{{path: "mem", mode: 0o600, data: randBytes(uint64(100+i), 3*smallChunk+5)}})
	}
	errs := make(chan error, n)
	wins := make(chan int, n)
	start := make(chan struct{})
	for i := range n {
		s := snapshot.New(b, snapshot.WithChunkSize(smallChunk), snapshot.WithSigningKey(testKey))
		go func() {
			<-start
			_, err := s.Save(ctx, "one", srcs[i])
			if err == nil {
				wins <- i
			}
			errs <- err
		}()
	}
	close(start)
	for range n {
		if err := <-errs; err != nil && !errors.Is(err, errdefs.ErrConflict) {
			t.Errorf("losing Save: %v, want ErrConflict", err)
		}
	}
	close(wins)
	var winners []int
	for i := range wins {
		winners = append(winners, i)
	}
	if len(winners) != 1 {
		t.Fatalf("%d Saves succeeded (%v), want exactly 1", len(winners), winners)
	}
	s := snapshot.New(b, snapshot.WithSigningKey(testKey))
	if _, err := s.GC(ctx); err != nil {
		t.Fatal(err)
	}
	dest := filepath.Join(t.TempDir(), "out")
	if err := s.Load(ctx, "one", dest); err != nil {
		t.Fatalf("Load of the winner's snapshot after GC: %v", err)
	}
	assertSameTree(t, srcs[winners[0]], dest)
	if _, err := os.Stat(filepath.Join(dest, snapshot.MarkerName)); err == nil {
		t.Error("Load wrote a fetch marker")
	}
}
