package snapshottest

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/snapshot"
)

// countingBackend counts Gets per key and, while gated, holds every chunk Get until the gate
// opens (or the caller's ctx ends).
type countingBackend struct {
	snapshot.Backend
	mu      sync.Mutex
	gets    map[string]int
	gate    chan struct{}
	started chan struct{} // closed at the first chunk Get
	once    sync.Once
}

func counting(b snapshot.Backend, gated bool) *countingBackend {
	c := &countingBackend{Backend: b, gets: map[string]int{}, started: make(chan struct{})}
	if gated {
		c.gate = make(chan struct{})
	}
	return c
}

func (c *countingBackend) Get(ctx context.Context, key string) (io.ReadCloser, error) {
	c.mu.Lock()
	c.gets[key]++
	c.mu.Unlock()
	if strings.HasPrefix(key, "chunks/") {
		c.once.Do(func() { close(c.started) })
		if c.gate != nil {
			select {
			case <-c.gate:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		}
	}
	return c.Backend.Get(ctx, key)
}

func (c *countingBackend) open() { close(c.gate) }

func (c *countingBackend) waitStarted(t *testing.T) {
	t.Helper()
	select {
	case <-c.started:
	case <-time.After(30 * time.Second):
		t.Fatal("no chunk was read within 30 s")
	}
}

// counts returns how many Gets each key had, and the largest count of any chunk.
func (c *countingBackend) counts() (map[string]int, int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	m := map[string]int{}
	most := 0
	for k, n := range c.gets {
		m[k] = n
		if strings.HasPrefix(k, "chunks/") {
			most = max(most, n)
		}
	}
	return m, most
}

func (c *countingBackend) total() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, v := range c.gets {
		n += v
	}
	return n
}

// fetchAll runs n Fetches at once and returns their errors, failing if they take over 60 s.
func fetchAll(t *testing.T, s *snapshot.Store, n int, id, dest string, opts ...snapshot.FetchOption) []error {
	t.Helper()
	errs := make(chan error, n)
	for range n {
		go func() { errs <- s.Fetch(context.Background(), id, dest, opts...) }()
	}
	return collect(t, errs, n)
}

func collect(t *testing.T, errs <-chan error, n int) []error {
	t.Helper()
	var out []error
	deadline := time.After(60 * time.Second)
	for range n {
		select {
		case err := <-errs:
			out = append(out, err)
		case <-deadline:
			t.Fatalf("only %d of %d Fetches returned within 60 s", len(out), n)
		}
	}
	return out
}

// eventuallyOnly waits up to 10 s for dir to hold nothing but keep (the flight of an abandoned
// fetch cleans up in the background).
func eventuallyOnly(t *testing.T, dir, keep string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ents, _ := os.ReadDir(dir)
		ok := true
		for _, e := range ents {
			ok = ok && e.Name() == keep
		}
		if ok || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	assertNoLeftovers(t, dir, keep)
}

func testFetch(t *testing.T, newBackend func(t *testing.T) snapshot.Backend) {
	ctx := context.Background()
	setup := func(t *testing.T, gated bool) (*countingBackend, *snapshot.Store, string) {
		t.Helper()
		b := newBackend(t)
		src := sampleTree(t)
		if _, err := snapshot.New(b, snapshot.WithChunkSize(smallChunk), snapshot.WithSigningKey(testKey)).Save(ctx, "snap", src); err != nil {
			t.Fatal(err)
		}
		cb := counting(b, gated)
		return cb, snapshot.New(cb, snapshot.WithSigningKey(testKey)), src
	}

	t.Run("16 at once load once", func(t *testing.T) {
		cb, s, src := setup(t, true)
		parent := t.TempDir()
		dest := filepath.Join(parent, "img")
		errs := make(chan error, 16)
		for range 16 {
			go func() { errs <- s.Fetch(ctx, "snap", dest) }()
		}
		cb.waitStarted(t)
		time.Sleep(100 * time.Millisecond) // let the others join; late ones find it complete
		cb.open()
		for _, err := range collect(t, errs, 16) {
			if err != nil {
				t.Errorf("Fetch: %v", err)
			}
		}
		counts, most := cb.counts()
		if most != 1 || counts[snapshot.ManifestKey("snap")] != 1 {
			t.Errorf("backend reads: %v; want the manifest and each chunk read once", counts)
		}
		assertSameTree(t, src, dest)
		if _, err := os.Stat(filepath.Join(dest, snapshot.MarkerName)); err != nil {
			t.Errorf("no completion marker: %v", err)
		}
		assertNoLeftovers(t, parent, "img")

		before := cb.total()
		if err := s.Fetch(ctx, "snap", dest); err != nil {
			t.Fatal(err)
		}
		if err := snapshot.New(cb, snapshot.WithSigningKey(testKey)).Fetch(ctx, "snap", dest); err != nil {
			t.Fatal(err)
		}
		if n := cb.total() - before; n != 0 {
			t.Errorf("Fetch of a complete destination read the backend %d times", n)
		}
	})

	t.Run("leader cancelled, waiters carry on", func(t *testing.T) {
		cb, s, src := setup(t, true)
		parent := t.TempDir()
		dest := filepath.Join(parent, "img")
		lctx, cancel := context.WithCancel(ctx)
		defer cancel()
		leader := make(chan error, 1)
		go func() { leader <- s.Fetch(lctx, "snap", dest) }()
		cb.waitStarted(t)
		errs := make(chan error, 15)
		for range 15 {
			go func() { errs <- s.Fetch(ctx, "snap", dest) }()
		}
		time.Sleep(100 * time.Millisecond)
		cancel()
		select {
		case err := <-leader:
			if !errors.Is(err, context.Canceled) {
				t.Errorf("cancelled leader: %v, want context.Canceled", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("cancelled leader did not return within 5 s")
		}
		cb.open()
		for _, err := range collect(t, errs, 15) {
			if err != nil {
				t.Errorf("waiter: %v", err)
			}
		}
		assertSameTree(t, src, dest)
		assertNoLeftovers(t, parent, "img")
	})

	t.Run("every caller cancelled: nothing left, next call loads", func(t *testing.T) {
		cb, s, src := setup(t, true)
		parent := t.TempDir()
		dest := filepath.Join(parent, "img")
		cctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- s.Fetch(cctx, "snap", dest) }()
		cb.waitStarted(t)
		cancel()
		if err := collect(t, done, 1)[0]; !errors.Is(err, context.Canceled) {
			t.Errorf("cancelled Fetch: %v, want context.Canceled", err)
		}
		eventuallyOnly(t, parent, "")
		cb.open()
		if err := s.Fetch(ctx, "snap", dest); err != nil {
			t.Fatalf("Fetch after a cancelled one: %v", err)
		}
		assertSameTree(t, src, dest)
		assertNoLeftovers(t, parent, "img")
	})

	t.Run("failure reaches every waiter, next call retries", func(t *testing.T) {
		cb, s, src := setup(t, true)
		var m *snapshot.Manifest
		m, err := s.Stat(ctx, "snap")
		if err != nil {
			t.Fatal(err)
		}
		f := fileNamed(t, m, "pages.img")
		key := snapshot.ChunkKey(f.Chunks[len(f.Chunks)-2].Hash)
		good := getAll(t, cb.Backend, key)
		bad := append([]byte(nil), good...)
		bad[7] ^= 0xff
		putAll(t, cb.Backend, key, bad)

		parent := t.TempDir()
		dest := filepath.Join(parent, "img")
		errs := make(chan error, 16)
		for range 16 {
			go func() { errs <- s.Fetch(ctx, "snap", dest) }()
		}
		cb.waitStarted(t)
		time.Sleep(50 * time.Millisecond)
		cb.open()
		for _, err := range collect(t, errs, 16) {
			if !errors.Is(err, errdefs.ErrCorrupt) {
				t.Errorf("Fetch of a damaged snapshot: %v, want ErrCorrupt", err)
			}
		}
		assertNoLeftovers(t, parent, "")

		putAll(t, cb.Backend, key, good)
		if err := s.Fetch(ctx, "snap", dest); err != nil {
			t.Fatalf("Fetch after repair: %v", err)
		}
		assertSameTree(t, src, dest)
	})

	t.Run("incomplete destination replaced", func(t *testing.T) {
		_, s, src := setup(t, false)
		parent := t.TempDir()
		dest := filepath.Join(parent, "img")
		writeTree(t, dest, []entry{{path: "pages.img", mode: 0o600, data: []byte("half")}, {path: "junk", mode: 0o600}})
		if err := s.Fetch(ctx, "snap", dest); err != nil {
			t.Fatal(err)
		}
		assertSameTree(t, src, dest)
		assertNoLeftovers(t, parent, "img")
	})

	t.Run("destination of another snapshot", func(t *testing.T) {
		cb, s, src := setup(t, false)
		if _, err := s.Save(ctx, "other", src); err != nil {
			t.Fatal(err)
		}
		dest := filepath.Join(t.TempDir(), "img")
		if err := s.Fetch(ctx, "snap", dest); err != nil {
			t.Fatal(err)
		}
		before := cb.total()
		if err := s.Fetch(ctx, "other", dest); !errors.Is(err, errdefs.ErrConflict) {
			t.Errorf("Fetch into another snapshot's destination: %v, want ErrConflict", err)
		}
		if cb.total() != before {
			t.Error("refused Fetch read the backend")
		}
		assertSameTree(t, src, dest)

		// Two snapshots into one destination at once: one gets it, the other ErrConflict.
		parent := t.TempDir()
		both := filepath.Join(parent, "img")
		errs := make(chan error, 2)
		for _, id := range []string{"snap", "other"} {
			go func() { errs <- s.Fetch(ctx, id, both) }()
		}
		var ok, conflict int
		for _, err := range collect(t, errs, 2) {
			switch {
			case err == nil:
				ok++
			case errors.Is(err, errdefs.ErrConflict):
				conflict++
			default:
				t.Errorf("Fetch: %v", err)
			}
		}
		if ok != 1 || conflict != 1 {
			t.Errorf("%d succeeded, %d conflicted; want 1 and 1", ok, conflict)
		}
		assertSameTree(t, src, both)
		assertNoLeftovers(t, parent, "img")
	})

	t.Run("import runs once", func(t *testing.T) {
		_, s, src := setup(t, false)
		var calls atomic.Int32
		imp := snapshot.FetchImport(func(ctx context.Context, srcDir, dstDir string) error {
			calls.Add(1)
			if err := os.Rename(srcDir, dstDir); err != nil {
				return err
			}
			return os.WriteFile(filepath.Join(dstDir, "imported"), []byte("yes"), 0o600)
		})
		parent := t.TempDir()
		dest := filepath.Join(parent, "img")
		for _, err := range fetchAll(t, s, 8, "snap", dest, imp) {
			if err != nil {
				t.Errorf("Fetch: %v", err)
			}
		}
		if n := calls.Load(); n != 1 {
			t.Errorf("import ran %d times, want 1", n)
		}
		if b, err := os.ReadFile(filepath.Join(dest, "imported")); err != nil || string(b) != "yes" {
			t.Errorf("imported file: %q, %v", b, err)
		}
		if err := os.Remove(filepath.Join(dest, "imported")); err != nil {
			t.Fatal(err)
		}
		assertSameTree(t, src, dest)
		assertNoLeftovers(t, parent, "img")

		failing := snapshot.FetchImport(func(ctx context.Context, srcDir, dstDir string) error {
			return errors.New("import refused")
		})
		other := filepath.Join(parent, "img2")
		if err := s.Fetch(ctx, "snap", other, failing); err == nil || !strings.Contains(err.Error(), "import refused") {
			t.Errorf("Fetch with a failing import: %v", err)
		}
		assertNoLeftovers(t, parent, "img")
	})
}
