package store

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// Records written before a close are there after reopening the file, as after a daemon restart.
func TestRecordsSurviveReopen(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "ember.db")
	s, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC().Truncate(time.Millisecond)
	sb := &sandbox.Sandbox{ID: "abc", TemplateID: "base", State: sandbox.StatePaused, Metadata: map[string]string{"k": "v"},
		StartedAt: now, Runtime: sandbox.Placement{Image: "/x/image", SlotIndex: -1}}
	if err := s.PutSandbox(ctx, sb); err != nil {
		t.Fatal(err)
	}
	if err := s.PutTemplate(ctx, &sandbox.Template{ID: "base", Kind: "template", Ready: true, CreatedAt: now}); err != nil {
		t.Fatal(err)
	}
	if err := s.PutKey(ctx, &auth.Key{ID: "k1", Hash: "h1", CreatedAt: now}); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}

	s, err = Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	got, err := s.GetSandbox(ctx, "abc")
	if err != nil {
		t.Fatal(err)
	}
	if got.State != sandbox.StatePaused || got.Metadata["k"] != "v" || got.Runtime.Image != "/x/image" || !got.StartedAt.Equal(now) {
		t.Fatalf("sandbox after reopen: %+v", got)
	}
	if tpl, err := s.GetTemplate(ctx, "base"); err != nil || !tpl.Ready {
		t.Fatalf("template after reopen: %+v %v", tpl, err)
	}
	if k, err := s.GetKeyByHash(ctx, "h1"); err != nil || k.ID != "k1" {
		t.Fatalf("key after reopen: %+v %v", k, err)
	}
	if err := s.DeleteSandbox(ctx, "abc"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.GetSandbox(ctx, "abc"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("deleted sandbox: %v, want ErrNotFound", err)
	}
	if err := s.DeleteSandbox(ctx, "abc"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("second delete: %v, want ErrNotFound", err)
	}
	if _, err := s.GetKeyByHash(ctx, "nope"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("unknown key: %v", err)
	}
}

// Concurrent writes share commits, yet each one is in the file when its call returns: a copy of
// the file taken without closing the store (what a kill -9 leaves) holds every acknowledged
// record, and a failing write (a delete of a missing record) in the middle of them fails alone.
func TestConcurrentWritesDurableWhenAcknowledged(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	path := filepath.Join(dir, "ember.db")
	s, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	const writers, rounds = 32, 8
	var wg sync.WaitGroup
	errs := make(chan error, writers*rounds*2)
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := range rounds {
				id := fmt.Sprintf("sb-%02d-%d", w, r)
				if err := s.PutSandbox(ctx, &sandbox.Sandbox{ID: id, State: sandbox.StateRunning}); err != nil {
					errs <- fmt.Errorf("put %s: %w", id, err)
				}
				if err := s.DeleteSandbox(ctx, "missing-"+id); !errors.Is(err, errdefs.ErrNotFound) {
					errs <- fmt.Errorf("delete of a missing record: %v, want ErrNotFound", err)
				}
				if r%2 == 1 { // every other record is deleted again
					if err := s.DeleteSandbox(ctx, id); err != nil {
						errs <- fmt.Errorf("delete %s: %w", id, err)
					}
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}

	// The file as it is now, with the store still open: only committed transactions are in it.
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	crashed := filepath.Join(dir, "copy.db")
	if err := os.WriteFile(crashed, b, 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := Open(crashed)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	list, err := c.ListSandboxes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]bool{}
	for _, sb := range list {
		got[sb.ID] = true
	}
	for w := range writers {
		for r := range rounds {
			id := fmt.Sprintf("sb-%02d-%d", w, r)
			if want := r%2 == 0; got[id] != want {
				t.Errorf("record %s present=%v after reopening, want %v", id, got[id], want)
			}
		}
	}
	if len(got) != writers*rounds/2 {
		t.Errorf("%d records after reopening, want %d", len(got), writers*rounds/2)
	}
}

// BenchmarkConcurrentPuts: 16 writers putting sandbox records at once, as 16 concurrent pauses
// do; ns/op is the wall time per record (each one fsynced before its call returns).
func BenchmarkConcurrentPuts(b *testing.B) {
	s, err := Open(filepath.Join(b.TempDir(), "ember.db"))
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	var n atomic.Int64
	b.SetParallelism(16) // × GOMAXPROCS writers
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			id := fmt.Sprintf("sb-%d", n.Add(1)%64)
			if err := s.PutSandbox(ctx, &sandbox.Sandbox{ID: id, State: sandbox.StatePaused}); err != nil {
				b.Error(err)
				return
			}
		}
	})
}

// A checkpoint and its sandbox's new head are written together (one transaction: a step
// checkpoint pays one synced write, not two): both are there after reopening the file.
func TestCheckpointAndHeadInOneTransaction(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "ember.db")
	s, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	sb := &sandbox.Sandbox{ID: "abc", State: sandbox.StateRunning, CheckpointHead: "ckpt-000000000001"}
	ck := &sandbox.Checkpoint{ID: "ckpt-000000000001", SandboxID: "abc", CreatedAt: time.Now().UTC()}
	if err := s.PutCheckpointHead(ctx, ck, sb); err != nil {
		t.Fatal(err)
	}
	s.Close()
	if s, err = Open(path); err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	got, err := s.GetSandbox(ctx, "abc")
	if err != nil || got.CheckpointHead != ck.ID {
		t.Fatalf("sandbox after reopen: %+v %v", got, err)
	}
	cks, err := s.ListCheckpoints(ctx, "abc")
	if err != nil || len(cks) != 1 || cks[0].ID != ck.ID {
		t.Fatalf("checkpoints after reopen: %v %v", cks, err)
	}
}

// BenchmarkCheckpointRecord: what recording a step checkpoint costs, as two synced writes (the
// checkpoint, then its sandbox's head) and as one transaction (PutCheckpointHead), alternated
// write by write so that both meet the same disk load; reported as p50 ms of each.
//
//	go test -run '^$' -bench CheckpointRecord -benchtime 400x ./internal/store/
func BenchmarkCheckpointRecord(b *testing.B) {
	ctx := context.Background()
	s, err := Open(filepath.Join(b.TempDir(), "ember.db"))
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	sb := &sandbox.Sandbox{ID: "abc", State: sandbox.StateRunning, Metadata: map[string]string{"k": "v"}}
	var two, one []time.Duration
	for i := 0; i < b.N; i++ {
		c := &sandbox.Checkpoint{ID: fmt.Sprintf("ckpt-%012x", i), SandboxID: "abc", CreatedAt: time.Now().UTC(), Image: "/x/checkpoints/c"}
		sb.CheckpointHead = c.ID
		t0 := time.Now()
		if i%2 == 0 {
			if err := s.PutCheckpoint(ctx, c); err != nil {
				b.Fatal(err)
			}
			if err := s.PutSandbox(ctx, sb); err != nil {
				b.Fatal(err)
			}
			two = append(two, time.Since(t0))
		} else {
			if err := s.PutCheckpointHead(ctx, c, sb); err != nil {
				b.Fatal(err)
			}
			one = append(one, time.Since(t0))
		}
	}
	p50 := func(d []time.Duration) float64 {
		if len(d) == 0 {
			return 0
		}
		sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
		return float64(d[len(d)/2]) / 1e6
	}
	b.ReportMetric(p50(two), "two-writes_p50_ms")
	b.ReportMetric(p50(one), "one-transaction_p50_ms")
}
