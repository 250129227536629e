// Package snapshottest is the conformance suite every snapshot Backend passes: the blob
// contract itself, and the Store on top of it (roundtrip, dedup, corruption and tamper
// detection, signed manifests, atomic load, single-flight fetch, concurrent saves, delete and
// GC, the node-local cache). It owns no backend.
package snapshottest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/snapshot"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// smallChunk keeps the suite fast while still giving files many chunks.
const smallChunk = 64 << 10

// Run runs the suite; newBackend returns a fresh, empty backend for each subtest.
func Run(t *testing.T, newBackend func(t *testing.T) snapshot.Backend) {
	t.Run("blob contract", func(t *testing.T) { testBlobs(t, newBackend(t)) })
	t.Run("roundtrip", func(t *testing.T) { testRoundtrip(t, newBackend(t)) })
	t.Run("large file default chunk size", func(t *testing.T) { testLarge(t, newBackend(t)) })
	t.Run("dedup on second save", func(t *testing.T) { testDedup(t, newBackend(t)) })
	t.Run("damaged chunk refused", func(t *testing.T) { testDamagedChunk(t, newBackend) })
	t.Run("tampered manifest refused", func(t *testing.T) { testTamperedManifest(t, newBackend) })
	t.Run("delete and gc", func(t *testing.T) { testDeleteGC(t, newBackend(t)) })
	t.Run("errors", func(t *testing.T) { testErrors(t, newBackend(t)) })
	t.Run("cache", func(t *testing.T) { testCache(t, newBackend(t)) })
	t.Run("signed manifests", func(t *testing.T) { testSigned(t, newBackend) })
	t.Run("concurrent saves of one id", func(t *testing.T) { testConcurrentSave(t, newBackend(t)) })
	t.Run("fetch", func(t *testing.T) { testFetch(t, newBackend) })
}

func testBlobs(t *testing.T, b snapshot.Backend) {
	ctx := context.Background()
	put := func(key string, data []byte) {
		t.Helper()
		if err := b.Put(ctx, key, bytes.NewReader(data), int64(len(data))); err != nil {
			t.Fatalf("Put(%s): %v", key, err)
		}
	}
	put("a/one", []byte("first"))
	put("a/one", []byte("second")) // replaces
	put("a/b/two", []byte{})
	put("c/three", bytes.Repeat([]byte{7}, 1<<20))

	if got := getAll(t, b, "a/one"); string(got) != "second" {
		t.Errorf("Get(a/one) = %q, want %q", got, "second")
	}
	if got := getAll(t, b, "a/b/two"); len(got) != 0 {
		t.Errorf("Get(a/b/two) = %d bytes, want 0", len(got))
	}
	if got := getAll(t, b, "c/three"); len(got) != 1<<20 {
		t.Errorf("Get(c/three) = %d bytes, want %d", len(got), 1<<20)
	}

	for _, tc := range []struct {
		key  string
		want bool
	}{{"a/one", true}, {"a/b/two", true}, {"a", false}, {"a/on", false}, {"nope/x", false}} {
		if ok, err := b.Exists(ctx, tc.key); err != nil || ok != tc.want {
			t.Errorf("Exists(%s) = %v, %v; want %v", tc.key, ok, err, tc.want)
		}
	}
	if _, err := b.Get(ctx, "a/missing"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Get(missing) error = %v, want ErrNotFound", err)
	}

	for _, tc := range []struct {
		prefix string
		want   []string
	}{
		{"a/", []string{"a/b/two", "a/one"}},
		{"a/o", []string{"a/one"}},
		{"", []string{"a/b/two", "a/one", "c/three"}},
		{"zzz/", nil},
	} {
		got, err := b.List(ctx, tc.prefix)
		if err != nil {
			t.Fatalf("List(%q): %v", tc.prefix, err)
		}
		slices.Sort(got)
		if !slices.Equal(got, tc.want) {
			t.Errorf("List(%q) = %q, want %q", tc.prefix, got, tc.want)
		}
	}

	if err := b.Delete(ctx, "a/one"); err != nil {
		t.Fatal(err)
	}
	if err := b.Delete(ctx, "a/one"); err != nil {
		t.Errorf("second Delete: %v, want nil", err)
	}
	if ok, _ := b.Exists(ctx, "a/one"); ok {
		t.Error("a/one exists after Delete")
	}

	t.Run("wrong size stores nothing", func(t *testing.T) {
		for _, tc := range []struct {
			name string
			data string
			size int64
		}{{"short", "abc", 10}, {"long", "abcdefgh", 3}} {
			err := b.Put(ctx, "sized/"+tc.name, strings.NewReader(tc.data), tc.size)
			if err == nil {
				t.Errorf("%s: Put succeeded", tc.name)
			}
			if ok, _ := b.Exists(ctx, "sized/"+tc.name); ok {
				t.Errorf("%s: object exists after failed Put", tc.name)
			}
		}
	})
	t.Run("create only if absent", func(t *testing.T) {
		c, ok := b.(snapshot.Creator)
		if !ok {
			testutil.NotApplicable(t, "backend does not implement snapshot.Creator")
		}
		if err := c.Create(ctx, "create/new", strings.NewReader("one"), 3); err != nil {
			t.Fatalf("Create of a new key: %v", err)
		}
		if err := c.Create(ctx, "create/new", strings.NewReader("two"), 3); !errors.Is(err, errdefs.ErrConflict) {
			t.Errorf("Create of an existing key: %v, want ErrConflict", err)
		}
		if got := getAll(t, b, "create/new"); string(got) != "one" {
			t.Errorf("after a refused Create the object is %q, want %q", got, "one")
		}
		errs := make(chan error, 8)
		for i := range 8 {
			go func() { errs <- c.Create(ctx, "create/race", strings.NewReader(fmt.Sprint(i)), 1) }()
		}
		wins := 0
		for range 8 {
			switch err := <-errs; {
			case err == nil:
				wins++
			case !errors.Is(err, errdefs.ErrConflict):
				t.Errorf("losing Create: %v, want ErrConflict", err)
			}
		}
		if wins != 1 {
			t.Errorf("%d concurrent Creates of one key succeeded, want 1", wins)
		}
		if err := c.Create(ctx, "create/short", strings.NewReader("ab"), 5); err == nil {
			t.Error("Create with a short reader succeeded")
		}
		if ok, _ := b.Exists(ctx, "create/short"); ok {
			t.Error("object exists after a failed Create")
		}
	})
	t.Run("invalid keys", func(t *testing.T) {
		for _, key := range []string{"", "/abs", "a/../b", "a//b", ".hidden", "a/.tmp-x", "dir/"} {
			if err := b.Put(ctx, key, strings.NewReader("x"), 1); !errors.Is(err, errdefs.ErrInvalid) {
				t.Errorf("Put(%q) error = %v, want ErrInvalid", key, err)
			}
		}
	})
}

// tree is a directory to save: relative path -> content; a nil content with a trailing "/"
// path is a directory.
type entry struct {
	path string
	mode fs.FileMode
	data []byte
}

func writeTree(t *testing.T, dir string, entries []entry) {
	t.Helper()
	for _, e := range entries {
		p := filepath.Join(dir, e.path)
		if strings.HasSuffix(e.path, "/") {
			if err := os.MkdirAll(p, 0o755); err != nil {
				t.Fatal(err)
			}
			continue
		}
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, e.data, e.mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, e.mode); err != nil {
			t.Fatal(err)
		}
	}
}

func randBytes(seed uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	b := make([]byte, n)
	for i := 0; i+8 <= n; i += 8 {
		v := r.Uint64()
		for k := range 8 {
			b[i+k] = byte(v >> (8 * k))
		}
	}
	for i := n &^ 7; i < n; i++ {
		b[i] = byte(r.Uint32())
	}
	return b
}

// sampleTree is a checkpoint-like directory: a big memory file with zero runs, small metadata,
// an empty file, nested and empty directories, and various modes.
func sampleTree(t *testing.T) string {
	t.Helper()
	mem := randBytes(1, 3<<20+12345)
	clear(mem[smallChunk : 5*smallChunk]) // zero pages, stored once
	dir := t.TempDir()
	writeTree(t, dir, []entry{
		{path: "checkpoint.img", mode: 0o600, data: randBytes(2, 4000)},
		{path: "pages.img", mode: 0o640, data: mem},
		{path: "empty", mode: 0o644},
		{path: "run.sh", mode: 0o755, data: []byte("#!/bin/sh\necho hi\n")},
		{path: "meta/nested/info.json", mode: 0o644, data: []byte(`{"a":1}`)},
		{path: "meta/exactly-one-chunk", mode: 0o644, data: randBytes(3, smallChunk)},
		{path: "emptydir/"},
	})
	if err := os.Chmod(filepath.Join(dir, "meta"), 0o750); err != nil {
		t.Fatal(err)
	}
	return dir
}

// assertSameTree compares paths, permission bits and contents of two directories.
func assertSameTree(t *testing.T, want, got string) {
	t.Helper()
	read := func(root string) map[string]string {
		m := map[string]string{}
		err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			rel, _ := filepath.Rel(root, p)
			if rel == "." || rel == snapshot.MarkerName {
				return nil
			}
			info, err := d.Info()
			if err != nil {
				return err
			}
			desc := info.Mode().String()
			if d.Type().IsRegular() {
				b, err := os.ReadFile(p)
				if err != nil {
					return err
				}
				desc += fmt.Sprintf(" %d %x", len(b), b)
			}
			m[rel] = desc
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	w, g := read(want), read(got)
	for p, wd := range w {
		gd, ok := g[p]
		switch {
		case !ok:
			t.Errorf("%s missing after load", p)
		case gd != wd:
			t.Errorf("%s differs after load: got %.60s..., want %.60s...", p, gd, wd)
		}
	}
	for p := range g {
		if _, ok := w[p]; !ok {
			t.Errorf("%s appeared after load", p)
		}
	}
}

func testRoundtrip(t *testing.T, b snapshot.Backend) {
	ctx := context.Background()
	src := sampleTree(t)
	s := snapshot.New(b, snapshot.WithChunkSize(smallChunk))
	m, err := s.Save(ctx, "snap-1", src)
	if err != nil {
		t.Fatal(err)
	}
	if m.Checksum == "" || m.ID != "snap-1" || m.ChunkSize != smallChunk {
		t.Errorf("manifest = id %q chunk %d checksum %q", m.ID, m.ChunkSize, m.Checksum)
	}
	// The four zero chunks of pages.img are one distinct chunk, and it is not stored at all
	// (Load leaves a hole): every stored chunk is one that Load reads and verifies.
	var refs int
	for _, f := range m.Files {
		refs += len(f.Chunks)
	}
	if m.Transfer.Chunks != refs-3 || m.Transfer.ZeroChunks != 1 || m.Transfer.UploadedChunks != m.Transfer.Chunks-1 {
		t.Errorf("transfer = %+v for %d chunk references, want 3 deduplicated, 1 zero chunk not stored, the rest uploaded", m.Transfer, refs)
	}

	st, err := s.Stat(ctx, "snap-1")
	if err != nil {
		t.Fatal(err)
	}
	if st.Checksum != m.Checksum || st.TotalSize() != m.TotalSize() {
		t.Errorf("Stat = checksum %s size %d, Save returned %s %d", st.Checksum, st.TotalSize(), m.Checksum, m.TotalSize())
	}

	for _, tc := range []struct {
		name  string
		store *snapshot.Store
		dest  func(t *testing.T) string
	}{
		{"new dir", s, func(t *testing.T) string { return filepath.Join(t.TempDir(), "a", "restored") }},
		{"existing empty dir", s, func(t *testing.T) string { return t.TempDir() }},
		{"store with other chunk size, no sync", snapshot.New(b, snapshot.WithChunkSize(1<<20), snapshot.WithoutLoadSync(), snapshot.WithConcurrency(1)),
			func(t *testing.T) string { return filepath.Join(t.TempDir(), "r") }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dest := tc.dest(t)
			if err := tc.store.Load(ctx, "snap-1", dest); err != nil {
				t.Fatal(err)
			}
			assertSameTree(t, src, dest)
			assertNoLeftovers(t, filepath.Dir(dest), filepath.Base(dest))
		})
	}
}

func testLarge(t *testing.T, b snapshot.Backend) {
	ctx := context.Background()
	src := t.TempDir()
	writeTree(t, src, []entry{{path: "memory", mode: 0o600, data: randBytes(9, 3*snapshot.DefaultChunkSize+777)}})
	s := snapshot.New(b)
	m, err := s.Save(ctx, "large", src)
	if err != nil {
		t.Fatal(err)
	}
	if n := len(m.Files[0].Chunks); n != 4 {
		t.Errorf("%d chunks, want 4", n)
	}
	dest := filepath.Join(t.TempDir(), "out")
	if err := s.Load(ctx, "large", dest); err != nil {
		t.Fatal(err)
	}
	assertSameTree(t, src, dest)
}

func testDedup(t *testing.T, b snapshot.Backend) {
	ctx := context.Background()
	src := t.TempDir()
	data := randBytes(4, 32*smallChunk)
	writeTree(t, src, []entry{{path: "mem", mode: 0o600, data: data}, {path: "meta", mode: 0o600, data: []byte("v1")}})
	s := snapshot.New(b, snapshot.WithChunkSize(smallChunk))
	first, err := s.Save(ctx, "gen-1", src)
	if err != nil {
		t.Fatal(err)
	}
	if first.Transfer.UploadedBytes != int64(len(data))+2 {
		t.Errorf("first save uploaded %d bytes, want %d", first.Transfer.UploadedBytes, len(data)+2)
	}

	data[10*smallChunk+5] ^= 0xff // one byte in chunk 10 changes
	writeTree(t, src, []entry{{path: "mem", mode: 0o600, data: data}})
	second, err := s.Save(ctx, "gen-2", src)
	if err != nil {
		t.Fatal(err)
	}
	tr := second.Transfer
	if tr.UploadedChunks != 1 || tr.UploadedBytes != smallChunk || tr.ReusedChunks != 32 {
		t.Errorf("second save transfer = %+v, want 1 chunk of %d bytes uploaded, 32 reused", tr, smallChunk)
	}

	for _, id := range []string{"gen-1", "gen-2"} {
		dest := filepath.Join(t.TempDir(), id)
		if err := s.Load(ctx, id, dest); err != nil {
			t.Fatal(err)
		}
		got, _ := os.ReadFile(filepath.Join(dest, "mem"))
		wantFlipped := id == "gen-2"
		if isFlipped := got[10*smallChunk+5] == data[10*smallChunk+5]; isFlipped != wantFlipped || len(got) != len(data) {
			t.Errorf("%s: wrong content after load", id)
		}
	}
}

// savedSample saves sampleTree as id and returns the store and manifest.
func savedSample(t *testing.T, b snapshot.Backend, id string) (*snapshot.Store, *snapshot.Manifest) {
	t.Helper()
	s := snapshot.New(b, snapshot.WithChunkSize(smallChunk))
	m, err := s.Save(context.Background(), id, sampleTree(t))
	if err != nil {
		t.Fatal(err)
	}
	return s, m
}

func fileNamed(t *testing.T, m *snapshot.Manifest, path string) snapshot.File {
	t.Helper()
	for _, f := range m.Files {
		if f.Path == path {
			return f
		}
	}
	t.Fatalf("manifest has no %s", path)
	return snapshot.File{}
}

func testDamagedChunk(t *testing.T, newBackend func(t *testing.T) snapshot.Backend) {
	ctx := context.Background()
	for _, tc := range []struct {
		name   string
		damage func(t *testing.T, b snapshot.Backend, key string)
		want   string
	}{
		{"one byte flipped", func(t *testing.T, b snapshot.Backend, key string) {
			data := getAll(t, b, key)
			data[len(data)/2] ^= 0x01
			putAll(t, b, key, data)
		}, "checksum mismatch"},
		{"truncated", func(t *testing.T, b snapshot.Backend, key string) {
			data := getAll(t, b, key)
			putAll(t, b, key, data[:len(data)-100])
		}, "truncated"},
		{"extended", func(t *testing.T, b snapshot.Backend, key string) {
			putAll(t, b, key, append(getAll(t, b, key), 0))
		}, "longer than"},
		{"missing", func(t *testing.T, b snapshot.Backend, key string) {
			if err := b.Delete(ctx, key); err != nil {
				t.Fatal(err)
			}
		}, "missing"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := newBackend(t)
			s, m := savedSample(t, b, "snap")
			// Damage a chunk in the middle of pages.img (not the zero run, which Load never reads).
			f := fileNamed(t, m, "pages.img")
			c := f.Chunks[len(f.Chunks)-3]
			tc.damage(t, b, snapshot.ChunkKey(c.Hash))

			parent := t.TempDir()
			dest := filepath.Join(parent, "restored")
			err := s.Load(ctx, "snap", dest)
			if !errors.Is(err, errdefs.ErrCorrupt) {
				t.Fatalf("Load error = %v, want ErrCorrupt", err)
			}
			want := fmt.Sprintf("snapshot snap: chunk %s of file pages.img: %s", c.Hash, tc.want)
			if !strings.Contains(err.Error(), want) {
				t.Errorf("Load error = %q, want it to contain %q", err, want)
			}
			if _, err := os.Stat(dest); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("destination exists after failed load (stat error %v)", err)
			}
			assertNoLeftovers(t, parent, "")
		})
	}
}

func testTamperedManifest(t *testing.T, newBackend func(t *testing.T) snapshot.Backend) {
	ctx := context.Background()
	for _, tc := range []struct {
		name   string
		tamper func(b []byte) []byte
	}{
		{"size changed", func(b []byte) []byte {
			return bytes.Replace(b, []byte(`"size": 4000`), []byte(`"size": 4001`), 1)
		}},
		{"mode changed", func(b []byte) []byte {
			return bytes.Replace(b, []byte(`"mode": 493`), []byte(`"mode": 511`), 1) // 0755 -> 0777
		}},
		{"truncated", func(b []byte) []byte { return b[:len(b)/2] }},
		{"empty", func(b []byte) []byte { return nil }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := newBackend(t)
			s, _ := savedSample(t, b, "snap")
			key := snapshot.ManifestKey("snap")
			orig := getAll(t, b, key)
			tampered := tc.tamper(bytes.Clone(orig))
			if bytes.Equal(orig, tampered) {
				t.Fatal("tamper changed nothing")
			}
			putAll(t, b, key, tampered)
			if _, err := s.Stat(ctx, "snap"); !errors.Is(err, errdefs.ErrCorrupt) {
				t.Errorf("Stat error = %v, want ErrCorrupt", err)
			}
			dest := filepath.Join(t.TempDir(), "out")
			if err := s.Load(ctx, "snap", dest); !errors.Is(err, errdefs.ErrCorrupt) {
				t.Errorf("Load error = %v, want ErrCorrupt", err)
			}
			if _, err := os.Stat(dest); err == nil {
				t.Error("destination exists after refused load")
			}
		})
	}
}

func testDeleteGC(t *testing.T, b snapshot.Backend) {
	ctx := context.Background()
	s := snapshot.New(b, snapshot.WithChunkSize(smallChunk))
	src := t.TempDir()
	shared := randBytes(5, 4*smallChunk)
	writeTree(t, src, []entry{{path: "shared", mode: 0o600, data: shared}, {path: "own", mode: 0o600, data: randBytes(6, 2*smallChunk)}})
	if _, err := s.Save(ctx, "a", src); err != nil {
		t.Fatal(err)
	}
	writeTree(t, src, []entry{{path: "own", mode: 0o600, data: randBytes(7, 3*smallChunk)}})
	if _, err := s.Save(ctx, "b", src); err != nil {
		t.Fatal(err)
	}
	if got := countChunks(t, b); got != 4+2+3 {
		t.Fatalf("%d chunks stored, want 9", got)
	}

	if err := s.Delete(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Stat(ctx, "a"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Stat(deleted) error = %v, want ErrNotFound", err)
	}
	if ids, err := s.List(ctx); err != nil || !slices.Equal(ids, []string{"b"}) {
		t.Errorf("List = %q, %v; want [b]", ids, err)
	}
	if got := countChunks(t, b); got != 9 {
		t.Errorf("Delete removed chunks: %d left, want 9 until GC", got)
	}

	st, err := s.GC(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.RemovedChunks != 2 || st.KeptChunks != 7 || st.Snapshots != 1 {
		t.Errorf("GC = %+v, want 2 removed, 7 kept, 1 snapshot", st)
	}
	if got := countChunks(t, b); got != 7 {
		t.Errorf("%d chunks after GC, want 7", got)
	}
	dest := filepath.Join(t.TempDir(), "b")
	if err := s.Load(ctx, "b", dest); err != nil {
		t.Fatalf("Load(b) after GC: %v", err)
	}
	assertSameTree(t, src, dest)

	if err := s.Delete(ctx, "b"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.GC(ctx); err != nil {
		t.Fatal(err)
	}
	if got := countChunks(t, b); got != 0 {
		t.Errorf("%d chunks after deleting everything and GC, want 0", got)
	}
}

func testErrors(t *testing.T, b snapshot.Backend) {
	ctx := context.Background()
	s, _ := savedSample(t, b, "snap")
	for _, tc := range []struct {
		name string
		call func() error
		want error
	}{
		{"save existing id", func() error { _, err := s.Save(ctx, "snap", t.TempDir()); return err }, errdefs.ErrConflict},
		{"save missing dir", func() error {
			_, err := s.Save(ctx, "other", filepath.Join(t.TempDir(), "nope"))
			return err
		}, errdefs.ErrNotFound},
		{"save invalid id", func() error { _, err := s.Save(ctx, "../x", t.TempDir()); return err }, errdefs.ErrInvalid},
		{"stat missing", func() error { _, err := s.Stat(ctx, "nope"); return err }, errdefs.ErrNotFound},
		{"load missing", func() error { return s.Load(ctx, "nope", filepath.Join(t.TempDir(), "x")) }, errdefs.ErrNotFound},
		{"delete missing", func() error { return s.Delete(ctx, "nope") }, errdefs.ErrNotFound},
		{"load into non-empty dir", func() error {
			dir := t.TempDir()
			writeTree(t, dir, []entry{{path: "keep", mode: 0o644, data: []byte("mine")}})
			err := s.Load(ctx, "snap", dir)
			if got, _ := os.ReadFile(filepath.Join(dir, "keep")); string(got) != "mine" {
				t.Error("load touched the non-empty destination")
			}
			return err
		}, errdefs.ErrConflict},
		{"save symlink", func() error {
			dir := t.TempDir()
			if err := os.Symlink("/etc/passwd", filepath.Join(dir, "link")); err != nil {
				t.Fatal(err)
			}
			_, err := s.Save(ctx, "with-link", dir)
			if ok, _ := b.Exists(ctx, snapshot.ManifestKey("with-link")); ok {
				t.Error("manifest written for a refused save")
			}
			return err
		}, errdefs.ErrInvalid},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.call(); !errors.Is(err, tc.want) {
				t.Errorf("error = %v, want %v", err, tc.want)
			}
		})
	}

	t.Run("cancelled load leaves nothing", func(t *testing.T) {
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		parent := t.TempDir()
		if err := s.Load(cctx, "snap", filepath.Join(parent, "x")); err == nil {
			t.Fatal("Load with a cancelled context succeeded")
		}
		assertNoLeftovers(t, parent, "")
	})
}

func testCache(t *testing.T, b snapshot.Backend) {
	ctx := context.Background()
	src := sampleTree(t)
	if _, err := snapshot.New(b, snapshot.WithChunkSize(smallChunk)).Save(ctx, "snap", src); err != nil {
		t.Fatal(err)
	}
	cacheDir := t.TempDir()
	s := snapshot.New(b, snapshot.WithCache(cacheDir))
	load := func() error {
		t.Helper()
		dest := filepath.Join(t.TempDir(), "out")
		if err := s.Load(ctx, "snap", dest); err != nil {
			return err
		}
		assertSameTree(t, src, dest)
		return nil
	}
	if err := load(); err != nil { // cold: fills the cache
		t.Fatal(err)
	}

	// Damage one cached chunk: Load must notice, fetch it again and repair the cache.
	cached := cacheFiles(t, cacheDir)
	if len(cached) == 0 {
		t.Fatal("cache is empty after a load")
	}
	victim := cached[0]
	good, _ := os.ReadFile(victim)
	bad := bytes.Clone(good)
	bad[0] ^= 0xff
	if err := os.WriteFile(victim, bad, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := load(); err != nil {
		t.Fatalf("Load with a damaged cache entry: %v", err)
	}
	if now, _ := os.ReadFile(victim); !bytes.Equal(now, good) {
		t.Error("damaged cache entry was not repaired")
	}

	// With every chunk gone from the backend, the cache alone serves the load.
	keys, err := b.List(ctx, "chunks/")
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		if err := b.Delete(ctx, k); err != nil {
			t.Fatal(err)
		}
	}
	if err := load(); err != nil {
		t.Fatalf("Load from cache only: %v", err)
	}

	// GC drops cached chunks no manifest references.
	if err := s.Delete(ctx, "snap"); err != nil {
		t.Fatal(err)
	}
	st, err := s.GC(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if left := cacheFiles(t, cacheDir); len(left) != 0 || st.RemovedCached != len(cached) {
		t.Errorf("after GC: %d cached files left, %d removed; want 0 left, %d removed", len(left), st.RemovedCached, len(cached))
	}
}

func cacheFiles(t *testing.T, dir string) []string {
	t.Helper()
	var files []string
	filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			files = append(files, p)
		}
		return nil
	})
	slices.Sort(files)
	return files
}

func countChunks(t *testing.T, b snapshot.Backend) int {
	t.Helper()
	keys, err := b.List(context.Background(), "chunks/")
	if err != nil {
		t.Fatal(err)
	}
	return len(keys)
}

// assertNoLeftovers fails if dir holds anything but keep (temporary load directories).
func assertNoLeftovers(t *testing.T, dir, keep string) {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if e.Name() != keep {
			t.Errorf("left behind in %s: %s", dir, e.Name())
		}
	}
}

func getAll(t *testing.T, b snapshot.Backend, key string) []byte {
	t.Helper()
	rc, err := b.Get(context.Background(), key)
	if err != nil {
		t.Fatalf("Get(%s): %v", key, err)
	}
	defer rc.Close()
	data, err := io.ReadAll(rc)
	if err != nil {
		t.Fatalf("Get(%s): %v", key, err)
	}
	return data
}

func putAll(t *testing.T, b snapshot.Backend, key string, data []byte) {
	t.Helper()
	if err := b.Put(context.Background(), key, bytes.NewReader(data), int64(len(data))); err != nil {
		t.Fatalf("Put(%s): %v", key, err)
	}
}
