package snapshot_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/ember-sandbox/ember/internal/testutil"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/snapshot"
	"github.com/ember-sandbox/ember/internal/snapshot/local"
)

const (
	kib = int64(1) << 10
	mib = int64(1) << 20
	tib = int64(1) << 40
)

// craft stores m as snapshot id with a correct checksum (what anyone with write access to an
// unsigned bucket can do) and returns the store's backend.
func craft(t *testing.T, b snapshot.Backend, m *snapshot.Manifest) {
	t.Helper()
	m.Checksum = ""
	raw, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(raw)
	m.Checksum = hex.EncodeToString(sum[:])
	data, err := json.MarshalIndent(m, "", " ")
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Put(context.Background(), snapshot.ManifestKey(m.ID), bytes.NewReader(data), int64(len(data))); err != nil {
		t.Fatal(err)
	}
}

func newLocal(t *testing.T) snapshot.Backend {
	t.Helper()
	b, err := local.New(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func hashN(i int) string {
	sum := sha256.Sum256([]byte{byte(i), byte(i >> 8)})
	return hex.EncodeToString(sum[:])
}

// chunks returns n chunk references of size each, the last one of last bytes.
func chunks(n int, size, last int64) []snapshot.Chunk {
	cs := make([]snapshot.Chunk, n)
	for i := range cs {
		cs[i] = snapshot.Chunk{Hash: hashN(i), Size: size}
	}
	if n > 0 {
		cs[n-1].Size = last
	}
	return cs
}

// A manifest whose checksum is right can still declare anything. Each of these must be refused
// as ErrCorrupt by Stat and Load at once, before any figure in it is used to allocate memory,
// create files or read chunks.
func TestCraftedManifestsRefused(t *testing.T) {
	dir := fs.ModeDir | 0o755
	valid := func() *snapshot.Manifest {
		return &snapshot.Manifest{Version: snapshot.ManifestVersion, ID: "s", ChunkSize: 64 * kib, Files: []snapshot.File{
			{Path: "d", Mode: dir},
			{Path: "d/f", Mode: 0o644, Size: 64*kib + 10, Chunks: chunks(2, 64*kib, 10)},
		}}
	}
	file := func(size int64, cs []snapshot.Chunk) func(m *snapshot.Manifest) {
		return func(m *snapshot.Manifest) { m.Files[1].Size, m.Files[1].Chunks = size, cs }
	}
	for _, tc := range []struct {
		name   string
		mutate func(m *snapshot.Manifest)
	}{
		{"1 TiB chunk", func(m *snapshot.Manifest) {
			m.ChunkSize = tib
			file(tib, chunks(1, tib, tib))(m)
		}},
		{"1 TiB chunk in small chunk size", file(tib, chunks(1, tib, tib))},
		{"chunk larger than chunk size", file(128*kib, chunks(1, 128*kib, 128*kib))},
		{"1 TiB file with two chunks", file(tib, chunks(2, 64*kib, tib-64*kib))},
		{"chunk count below file size", file(3*64*kib, chunks(2, 64*kib, 64*kib))},
		{"chunk count above file size", file(64*kib, chunks(3, 64*kib, 1))},
		{"zero-size chunk", file(64*kib, append(chunks(1, 64*kib, 64*kib), snapshot.Chunk{Hash: hashN(9), Size: 0}))},
		{"negative chunk", file(64*kib, append(chunks(2, 64*kib, 64*kib), snapshot.Chunk{Hash: hashN(9), Size: -64 * kib}))},
		{"negative size", file(-1, nil)},
		{"huge total over many files", func(m *snapshot.Manifest) {
			for i := range 4 {
				m.Files = append(m.Files, snapshot.File{Path: "big" + string(rune('a'+i)), Mode: 0o600, Size: 1 << 62})
			}
		}},
		{"chunk size zero", func(m *snapshot.Manifest) { m.ChunkSize = 0 }},
		{"chunk size one byte", func(m *snapshot.Manifest) { m.ChunkSize = 1 }},
		{"chunk size negative", func(m *snapshot.Manifest) { m.ChunkSize = -1 }},
		{"chunk size 1 TiB", func(m *snapshot.Manifest) { m.ChunkSize = tib }},
		{"dot dot", func(m *snapshot.Manifest) { m.Files[1].Path = "../f" }},
		{"dot dot inside", func(m *snapshot.Manifest) { m.Files[1].Path = "d/../../f" }},
		{"absolute", func(m *snapshot.Manifest) { m.Files[1].Path = "/etc/shadow" }},
		{"NUL", func(m *snapshot.Manifest) { m.Files[1].Path = "d/f\x00x" }},
		{"empty name", func(m *snapshot.Manifest) { m.Files[1].Path = "" }},
		{"duplicate", func(m *snapshot.Manifest) { m.Files = append(m.Files, m.Files[1]) }},
		{"duplicate dir", func(m *snapshot.Manifest) { m.Files = append(m.Files, m.Files[0]) }},
		{"name too long", func(m *snapshot.Manifest) { m.Files[1].Path = "d/" + strings.Repeat("x", 256) }},
		{"path too long", func(m *snapshot.Manifest) {
			p := "d"
			for len(p) <= 4096 {
				p += "/" + strings.Repeat("y", 200)
				m.Files = append(m.Files, snapshot.File{Path: p, Mode: dir})
			}
		}},
		{"store's own marker", func(m *snapshot.Manifest) {
			m.Files = append(m.Files, snapshot.File{Path: ".snapshot-complete", Mode: 0o600})
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := newLocal(t)
			m := valid()
			tc.mutate(m)
			craft(t, b, m)
			s := snapshot.New(b)
			ctx := context.Background()
			start := time.Now()
			if _, err := s.Stat(ctx, "s"); !errors.Is(err, errdefs.ErrCorrupt) {
				t.Errorf("Stat error = %v, want ErrCorrupt", err)
			}
			parent := t.TempDir()
			dest := filepath.Join(parent, "out")
			if err := s.Load(ctx, "s", dest); !errors.Is(err, errdefs.ErrCorrupt) {
				t.Errorf("Load error = %v, want ErrCorrupt", err)
			}
			if took := time.Since(start); took > 2*time.Second {
				t.Errorf("refusing took %v", took)
			}
			if ents, _ := os.ReadDir(parent); len(ents) != 0 {
				t.Errorf("Load left %d entries in the destination's parent", len(ents))
			}
		})
	}

	t.Run("valid one loads as far as its chunks", func(t *testing.T) {
		b := newLocal(t)
		craft(t, b, valid())
		s := snapshot.New(b)
		if _, err := s.Stat(context.Background(), "s"); err != nil {
			t.Fatalf("Stat of the untampered manifest: %v", err)
		}
		// Its chunks do not exist: the failure is the first missing chunk, not the manifest.
		err := s.Load(context.Background(), "s", filepath.Join(t.TempDir(), "out"))
		if !errors.Is(err, errdefs.ErrCorrupt) || !strings.Contains(err.Error(), "missing") {
			t.Errorf("Load error = %v, want a missing chunk", err)
		}
	})
}

// Loading a manifest that declares a 1 TiB chunk must not try to allocate it (before the fix
// the loader made a 1 TiB buffer and the process died).
func TestHugeChunkManifestDoesNotAllocate(t *testing.T) {
	b := newLocal(t)
	craft(t, b, &snapshot.Manifest{Version: snapshot.ManifestVersion, ID: "s", ChunkSize: tib, Files: []snapshot.File{
		{Path: "pages.img", Mode: 0o600, Size: tib, Chunks: chunks(1, tib, tib)},
	}})
	s := snapshot.New(b)
	ctx := context.Background()
	parent := t.TempDir()
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for range 10 {
		if err := s.Load(ctx, "s", filepath.Join(parent, "out")); !errors.Is(err, errdefs.ErrCorrupt) {
			t.Fatalf("Load error = %v, want ErrCorrupt", err)
		}
	}
	runtime.ReadMemStats(&after)
	if d := after.TotalAlloc - before.TotalAlloc; d > uint64(4*mib) {
		t.Errorf("10 refused loads allocated %d bytes, want under 4 MiB", d)
	}
}

// Two Saves of one id at once: exactly one wins, the others get ErrConflict, and the stored
// snapshot is the winner's, complete. Before the fix both succeeded and the manifest written
// last silently replaced the other.
func TestConcurrentSaveOneID(t *testing.T) {
	for _, tc := range []struct {
		name   string
		stores func(b snapshot.Backend) []*snapshot.Store
	}{
		{"one store", func(b snapshot.Backend) []*snapshot.Store {
			s := snapshot.New(b, snapshot.WithChunkSize(64*kib))
			return []*snapshot.Store{s, s, s, s, s, s}
		}},
		{"one store per caller (nodes sharing a backend)", func(b snapshot.Backend) []*snapshot.Store {
			var ss []*snapshot.Store
			for range 6 {
				ss = append(ss, snapshot.New(b, snapshot.WithChunkSize(64*kib)))
			}
			return ss
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := newLocal(t)
			stores := tc.stores(b)
			srcs := make([]string, len(stores))
			for i := range srcs {
				srcs[i] = t.TempDir()
				data := bytes.Repeat([]byte{byte(i + 1)}, int(3*64*kib+100))
				data[0] = byte(i) // distinct chunks per source, so a mix would show
				if err := os.WriteFile(filepath.Join(srcs[i], "mem"), data, 0o600); err != nil {
					t.Fatal(err)
				}
			}
			errs := make([]error, len(stores))
			start := make(chan struct{})
			done := make(chan int)
			for i, s := range stores {
				go func() {
					<-start
					_, errs[i] = s.Save(context.Background(), "one", srcs[i])
					done <- i
				}()
			}
			close(start)
			for range stores {
				<-done
			}
			winner := -1
			for i, err := range errs {
				switch {
				case err == nil:
					if winner >= 0 {
						t.Errorf("saves %d and %d both succeeded", winner, i)
					}
					winner = i
				case !errors.Is(err, errdefs.ErrConflict):
					t.Errorf("save %d: %v, want ErrConflict", i, err)
				}
			}
			if winner < 0 {
				t.Fatal("no save succeeded")
			}
			dest := filepath.Join(t.TempDir(), "out")
			if err := stores[0].Load(context.Background(), "one", dest); err != nil {
				t.Fatalf("Load of the winner's snapshot: %v", err)
			}
			got, _ := os.ReadFile(filepath.Join(dest, "mem"))
			want, _ := os.ReadFile(filepath.Join(srcs[winner], "mem"))
			if !bytes.Equal(got, want) {
				t.Error("stored snapshot is not the winner's")
			}
			// GC after the race keeps everything the winner needs.
			if _, err := stores[0].GC(context.Background()); err != nil {
				t.Fatal(err)
			}
			if err := stores[0].Load(context.Background(), "one", filepath.Join(t.TempDir(), "out")); err != nil {
				t.Errorf("Load after GC: %v", err)
			}
		})
	}
}

func TestStoreLimits(t *testing.T) {
	ctx := context.Background()
	src := t.TempDir()
	for i, size := range []int{100 * 1024, 100 * 1024, 10} {
		if err := os.WriteFile(filepath.Join(src, "f"+string(rune('0'+i))), bytes.Repeat([]byte{1}, size), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		name string
		opt  snapshot.Option
		ok   bool
	}{
		{"defaults", nil, true},
		{"max bytes just enough", snapshot.WithMaxImageBytes(200*1024 + 10), true},
		{"max bytes one short", snapshot.WithMaxImageBytes(200*1024 + 9), false},
		{"max files just enough", snapshot.WithMaxFiles(3), true},
		{"max files one short", snapshot.WithMaxFiles(2), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := newLocal(t)
			opts := []snapshot.Option{snapshot.WithChunkSize(64 * kib)}
			if tc.opt != nil {
				opts = append(opts, tc.opt)
			}
			_, err := snapshot.New(b, opts...).Save(ctx, "s", src)
			if tc.ok {
				if err != nil {
					t.Fatalf("Save: %v", err)
				}
			} else {
				if !errors.Is(err, errdefs.ErrExhausted) {
					t.Fatalf("Save over the limit: %v, want ErrExhausted", err)
				}
				// Saved without the limit, the same snapshot is refused on load.
				if _, err := snapshot.New(b, snapshot.WithChunkSize(64*kib)).Save(ctx, "s", src); err != nil {
					t.Fatal(err)
				}
				err = snapshot.New(b, opts...).Load(ctx, "s", filepath.Join(t.TempDir(), "out"))
				if !errors.Is(err, errdefs.ErrCorrupt) {
					t.Errorf("Load over the limit: %v, want ErrCorrupt", err)
				}
			}
		})
	}
}

// gatedBackend holds manifest writes until release is closed.
type gatedBackend struct {
	snapshot.Backend
	writing chan struct{} // closed when a manifest write starts
	release chan struct{}
	once    sync.Once
}

func (g *gatedBackend) hold(key string) {
	if strings.HasPrefix(key, "manifests/") {
		g.once.Do(func() { close(g.writing) })
		<-g.release
	}
}

func (g *gatedBackend) Put(ctx context.Context, key string, r io.Reader, size int64) error {
	g.hold(key)
	return g.Backend.Put(ctx, key, r, size)
}

func (g *gatedBackend) Create(ctx context.Context, key string, r io.Reader, size int64) error {
	g.hold(key)
	return g.Backend.(snapshot.Creator).Create(ctx, key, r, size)
}

// GC while a Save has uploaded its chunks but not yet written its manifest must not delete
// them: it waits for the Save.
func TestGCWaitsForSave(t *testing.T) {
	ctx := context.Background()
	g := &gatedBackend{Backend: newLocal(t), writing: make(chan struct{}), release: make(chan struct{})}
	s := snapshot.New(g, snapshot.WithChunkSize(64*kib))
	src := t.TempDir()
	if err := os.WriteFile(filepath.Join(src, "mem"), bytes.Repeat([]byte{3}, int(5*64*kib)), 0o600); err != nil {
		t.Fatal(err)
	}
	saved := make(chan error, 1)
	go func() { _, err := s.Save(ctx, "s", src); saved <- err }()
	<-g.writing
	type gcResult struct {
		st  snapshot.GCStats
		err error
	}
	gcDone := make(chan gcResult, 1)
	go func() { st, err := s.GC(ctx); gcDone <- gcResult{st, err} }()
	select {
	case r := <-gcDone:
		t.Fatalf("GC ran during a Save: %+v, %v", r.st, r.err)
	case <-time.After(200 * time.Millisecond):
	}
	close(g.release)
	if err := <-saved; err != nil {
		t.Fatal(err)
	}
	if r := <-gcDone; r.err != nil || r.st.RemovedChunks != 0 {
		t.Errorf("GC after the Save: %+v, %v; want nothing removed", r.st, r.err)
	}
	if err := s.Load(ctx, "s", filepath.Join(t.TempDir(), "out")); err != nil {
		t.Errorf("Load: %v", err)
	}
}

// Fetch removes an incomplete destination before loading it again, but never descends into a
// filesystem mounted beneath it.
func TestFetchKeepsMountsBeneathIncompleteDestination(t *testing.T) {
	testutil.RequireRoot(t)
	ctx := context.Background()
	b := newLocal(t)
	src := t.TempDir()
	if err := os.WriteFile(filepath.Join(src, "f"), []byte("data"), 0o600); err != nil {
		t.Fatal(err)
	}
	s := snapshot.New(b)
	if _, err := s.Save(ctx, "s", src); err != nil {
		t.Fatal(err)
	}
	dest := filepath.Join(t.TempDir(), "img")
	mnt := filepath.Join(dest, "layer")
	if err := os.MkdirAll(mnt, 0o700); err != nil {
		t.Fatal(err)
	}
	err := syscall.Mount("tmpfs", mnt, "tmpfs", 0, "size=1m")
	testutil.Need(t, err == nil, fmt.Sprintf("mount tmpfs: %v", err))
	t.Cleanup(func() { syscall.Unmount(mnt, syscall.MNT_DETACH) })
	if err := os.WriteFile(filepath.Join(mnt, "precious"), []byte("keep"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := s.Fetch(ctx, "s", dest); !errors.Is(err, errdefs.ErrConflict) {
		t.Errorf("Fetch over a mount: %v, want ErrConflict", err)
	}
	if b, err := os.ReadFile(filepath.Join(mnt, "precious")); err != nil || string(b) != "keep" {
		t.Errorf("file on the mount: %q, %v", b, err)
	}
}

// A manifest stuffed with millions of empty entries is refused before it is decoded: decoding
// it would allocate far more than its own size.
func TestStuffedManifestNotDecoded(t *testing.T) {
	for _, tc := range []struct {
		name string
		elem string
	}{
		{"numbers as files", `0`},
		{"empty objects as files", `{}`},
		{"empty chunk lists", `{"chunks":[]}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := newLocal(t)
			var buf bytes.Buffer
			buf.WriteString(`{"version":1,"id":"s","chunk_size":1048576,"files":[`)
			buf.WriteString(tc.elem)
			buf.WriteString(strings.Repeat(","+tc.elem, 1<<20))
			buf.WriteString(`],"checksum":""}`)
			if err := b.Put(context.Background(), snapshot.ManifestKey("s"), bytes.NewReader(buf.Bytes()), int64(buf.Len())); err != nil {
				t.Fatal(err)
			}
			size := uint64(buf.Len())
			buf = bytes.Buffer{}
			s := snapshot.New(b)
			var before, after runtime.MemStats
			runtime.GC()
			runtime.ReadMemStats(&before)
			if _, err := s.Stat(context.Background(), "s"); !errors.Is(err, errdefs.ErrCorrupt) {
				t.Fatalf("Stat error = %v, want ErrCorrupt", err)
			}
			runtime.ReadMemStats(&after)
			// Reading the manifest costs a few times its size (the buffer grows, and -race adds
			// its own); decoding it cost over 100 times that.
			if d := after.TotalAlloc - before.TotalAlloc; d > 10*size {
				t.Errorf("refusing a %d-byte manifest allocated %d bytes", size, d)
			}
		})
	}
}

// GC keeps the chunks a damaged but readable manifest names, and stops (deleting nothing) at a
// manifest it cannot safely decode.
func TestGCWithHostileManifests(t *testing.T) {
	ctx := context.Background()
	b := newLocal(t)
	s := snapshot.New(b, snapshot.WithChunkSize(64*kib))
	src := t.TempDir()
	if err := os.WriteFile(filepath.Join(src, "mem"), bytes.Repeat([]byte{5}, int(2*64*kib)), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Save(ctx, "good", src); err != nil {
		t.Fatal(err)
	}
	// An orphan chunk GC may remove.
	orphan := snapshot.ChunkKey(hashN(77))
	if err := b.Put(ctx, orphan, strings.NewReader("x"), 1); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	buf.WriteString(`{"version":1,"id":"stuffed","chunk_size":1048576,"files":[`)
	buf.WriteString(strings.Repeat("0,", 1<<20))
	buf.WriteString(`0]}`)
	if err := b.Put(ctx, snapshot.ManifestKey("stuffed"), bytes.NewReader(buf.Bytes()), int64(buf.Len())); err != nil {
		t.Fatal(err)
	}
	if _, err := s.GC(ctx); !errors.Is(err, errdefs.ErrCorrupt) {
		t.Errorf("GC with a stuffed manifest: %v, want ErrCorrupt", err)
	}
	if ok, _ := b.Exists(ctx, orphan); !ok {
		t.Error("GC that stopped deleted a chunk")
	}
	if err := b.Delete(ctx, snapshot.ManifestKey("stuffed")); err != nil {
		t.Fatal(err)
	}
	st, err := s.GC(ctx)
	if err != nil || st.RemovedChunks != 1 {
		t.Errorf("GC = %+v, %v; want the orphan removed", st, err)
	}
	if err := s.Load(ctx, "good", filepath.Join(t.TempDir(), "out")); err != nil {
		t.Errorf("Load after GC: %v", err)
	}
}
