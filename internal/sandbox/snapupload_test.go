package sandbox_test

import (
	"context"
	"errors"
	"github.com/ember-sandbox/ember/internal/testutil"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/snapshot"
	"github.com/ember-sandbox/ember/internal/snapshot/local"
)

// gatedImages is the real snapshot store whose Save waits for the test to open the gate (or
// for its ctx to end), and can be made to fail.
type gatedImages struct {
	imageStore
	dir      string
	gate     chan struct{}
	mu       sync.Mutex
	fail     error
	saving   chan string // receives the id of each Save as it starts waiting
	aborted  chan string // receives the id of each Save whose ctx ended while it waited
	collects int         // guarded by mu
}

func (g *gatedImages) Collect(ctx context.Context) error {
	g.mu.Lock()
	g.collects++
	g.mu.Unlock()
	return g.imageStore.Collect(ctx)
}

func (g *gatedImages) collected() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.collects
}

func newGatedImages(t *testing.T) *gatedImages {
	dir := t.TempDir()
	backend, err := local.New(dir)
	if err != nil {
		t.Fatal(err)
	}
	return &gatedImages{imageStore: imageStore{snapshot.New(backend, snapshot.WithChunkSize(64<<10))}, dir: dir,
		gate: make(chan struct{}), saving: make(chan string, 16), aborted: make(chan string, 16)}
}

func (g *gatedImages) Save(ctx context.Context, id, dir string) error {
	g.saving <- id
	select {
	case <-g.gate:
	case <-ctx.Done():
		g.aborted <- id
		return ctx.Err()
	}
	g.mu.Lock()
	fail := g.fail
	g.mu.Unlock()
	if fail != nil {
		return fail
	}
	return g.imageStore.Save(ctx, id, dir)
}

// stored lists the ids with a manifest in the store, and counts its chunks.
func (g *gatedImages) stored(t *testing.T) (ids []string, chunks int) {
	t.Helper()
	ids, err := g.s.List(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	filepath.Walk(filepath.Join(g.dir, "chunks"), func(_ string, fi os.FileInfo, err error) error {
		if err == nil && fi.Mode().IsRegular() {
			chunks++
		}
		return nil
	})
	return ids, chunks
}

// stages is a fake Observer: it records every stage reported.
type stages struct {
	mu   sync.Mutex
	runs map[sandbox.Stage]int
	errs map[sandbox.Stage]int
}

func (s *stages) ObserveStage(st sandbox.Stage, took time.Duration, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.runs == nil {
		s.runs, s.errs = map[sandbox.Stage]int{}, map[sandbox.Stage]int{}
	}
	s.runs[st]++
	if err != nil {
		s.errs[st]++
	}
}

func (s *stages) count(st sandbox.Stage) (runs, errs int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.runs[st], s.errs[st]
}

func (n *node) snapshotState(id string) (string, string) {
	n.t.Helper()
	tpl, err := n.store.GetTemplate(context.Background(), id)
	if err != nil {
		return "absent", err.Error()
	}
	return tpl.UploadState(), tpl.SnapshotError
}

func (n *node) waitSnapshot(id, state string) {
	n.t.Helper()
	testutil.Eventually(n.t, 10*time.Second, "snapshot "+id+" "+state, func() bool {
		got, _ := n.snapshotState(id)
		return got == state
	})
}

// A named snapshot answers while its upload waits: it says uploading, creates from it work on
// this node (from the capture), and once the upload is let through it says stored and its
// capture is the store's local copy (nothing is loaded back).
func TestSnapshotAnswersBeforeItsUpload(t *testing.T) {
	g := newGatedImages(t)
	obs := &stages{}
	n := newNode(t, func(c *sandbox.Config) { c.Images, c.Observer = g, obs })
	n.build("base")
	src := n.create(sandbox.CreateRequest{})
	n.write(src.ID, "/f", "before")
	snap, err := n.m.Snapshot(context.Background(), src.ID, "early")
	if err != nil {
		t.Fatal(err)
	}
	if snap.UploadState() != sandbox.SnapshotUploading {
		t.Fatalf("snapshot answered with state %q, want uploading", snap.UploadState())
	}
	<-g.saving
	if st, _ := n.snapshotState("early"); st != sandbox.SnapshotUploading {
		t.Fatalf("recorded state %q while the upload waits", st)
	}
	child := n.create(sandbox.CreateRequest{TemplateID: "early"})
	if v, _ := n.read(child.ID, "/f"); v != "before" {
		t.Fatalf("sandbox from the uploading snapshot reads %q", v)
	}
	close(g.gate)
	n.waitSnapshot("early", sandbox.SnapshotStoredState)
	if ids, _ := g.stored(t); len(ids) != 1 || ids[0] != "early" {
		t.Fatalf("stored snapshots %v", ids)
	}
	imports := n.rig.Driver.Calls("ImportImage")
	again := n.create(sandbox.CreateRequest{TemplateID: "early"})
	if v, _ := n.read(again.ID, "/f"); v != "before" {
		t.Fatalf("sandbox from the stored snapshot reads %q", v)
	}
	if got := n.rig.Driver.Calls("ImportImage") - imports; got != 0 {
		t.Fatalf("the node that took the snapshot loaded it back %d times", got)
	}
	if runs, _ := obs.count(sandbox.StageSnapshot); runs != 1 {
		t.Errorf("snapshot capture observed %d times", runs)
	}
	if runs, errs := obs.count(sandbox.StageSnapshotUpload); runs != 1 || errs != 0 {
		t.Errorf("upload observed %d times, %d failed", runs, errs)
	}
}

// Deleting a snapshot during its upload cancels the upload and leaves nothing: no record, no
// capture, no manifest, no chunk.
func TestDeleteDuringUploadLeavesNothing(t *testing.T) {
	g := newGatedImages(t)
	n := newNode(t, func(c *sandbox.Config) { c.Images = g })
	n.build("base")
	src := n.create(sandbox.CreateRequest{})
	snap, err := n.m.Snapshot(context.Background(), src.ID, "doomed")
	if err != nil {
		t.Fatal(err)
	}
	<-g.saving
	if err := n.m.DeleteTemplate(context.Background(), "doomed"); err != nil {
		t.Fatal(err)
	}
	select {
	case <-g.aborted:
	case <-time.After(5 * time.Second):
		t.Fatal("the upload was not cancelled")
	}
	if st, _ := n.snapshotState("doomed"); st != "absent" {
		t.Fatalf("record after delete: %q", st)
	}
	if _, err := os.Stat(snap.Image); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("capture after delete: %v", err)
	}
	close(g.gate) // a Save that got through would store it now
	testutil.Eventually(t, 5*time.Second, "no stored manifest or chunk", func() bool {
		ids, chunks := g.stored(t)
		return len(ids) == 0 && chunks == 0
	})
	if _, err := n.m.Create(context.Background(), sandbox.CreateRequest{TemplateID: "doomed"}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("create from the deleted snapshot: %v", err)
	}
}

// An upload cut by a stop (the same for a crash: the record says uploading and the capture is
// on disk) resumes at the next start and completes.
func TestUploadResumesAfterRestart(t *testing.T) {
	g := newGatedImages(t)
	n := newNode(t, func(c *sandbox.Config) { c.Images = g })
	n.build("base")
	src := n.create(sandbox.CreateRequest{})
	n.write(src.ID, "/f", "kept")
	if _, err := n.m.Snapshot(context.Background(), src.ID, "cut"); err != nil {
		t.Fatal(err)
	}
	<-g.saving
	n.m.Close()
	<-g.aborted
	if st, _ := n.snapshotState("cut"); st != sandbox.SnapshotUploading {
		t.Fatalf("state after a stop during the upload: %q", st)
	}
	n.start()
	<-g.saving // resumed
	close(g.gate)
	n.waitSnapshot("cut", sandbox.SnapshotStoredState)
	child := n.create(sandbox.CreateRequest{TemplateID: "cut"})
	if v, _ := n.read(child.ID, "/f"); v != "kept" {
		t.Fatalf("sandbox from the resumed snapshot reads %q", v)
	}
}

// An upload that keeps failing is retried, then the snapshot says failed with the reason, and
// it still serves this node from its capture. A capture lost before its upload resumed fails
// the snapshot at the next start.
func TestUploadFailureIsVisible(t *testing.T) {
	g := newGatedImages(t)
	close(g.gate)
	g.fail = errors.New("bucket unreachable")
	obs := &stages{}
	n := newNode(t, func(c *sandbox.Config) { c.Images, c.Observer, c.UploadRetryDelay = g, obs, time.Millisecond })
	n.build("base")
	src := n.create(sandbox.CreateRequest{})
	n.write(src.ID, "/f", "local")
	if _, err := n.m.Snapshot(context.Background(), src.ID, "unlucky"); err != nil {
		t.Fatal(err)
	}
	n.waitSnapshot("unlucky", sandbox.SnapshotFailed)
	if _, why := n.snapshotState("unlucky"); why == "" {
		t.Fatal("failed snapshot without a reason")
	}
	if len(g.saving) != 3 {
		t.Errorf("%d upload attempts, want 3", len(g.saving))
	}
	if _, errs := obs.count(sandbox.StageSnapshotUpload); errs != 1 {
		t.Errorf("upload failures observed: %d, want 1", errs)
	}
	child := n.create(sandbox.CreateRequest{TemplateID: "unlucky"})
	if v, _ := n.read(child.ID, "/f"); v != "local" {
		t.Fatalf("sandbox from the failed snapshot reads %q", v)
	}

	// A capture lost while its upload was pending.
	g.mu.Lock()
	g.fail = nil
	g.mu.Unlock()
	g.gate = make(chan struct{})
	snap, err := n.m.Snapshot(context.Background(), src.ID, "lost")
	if err != nil {
		t.Fatal(err)
	}
	<-g.saving
	n.m.Close()
	os.RemoveAll(snap.Image)
	n.start()
	if st, why := n.snapshotState("lost"); st != sandbox.SnapshotFailed || why == "" {
		t.Fatalf("snapshot whose capture was lost: %q %q", st, why)
	}
}

// A delete while another snapshot uploads collects unused chunks only once that upload is done
// (collecting would stall every save and load of the store meanwhile).
func TestCollectWaitsForUploadsInFlight(t *testing.T) {
	g := newGatedImages(t)
	open := g.gate
	close(open)
	n := newNode(t, func(c *sandbox.Config) { c.Images = g })
	n.build("base")
	src := n.create(sandbox.CreateRequest{})
	if _, err := n.m.Snapshot(context.Background(), src.ID, "first"); err != nil {
		t.Fatal(err)
	}
	n.waitSnapshot("first", sandbox.SnapshotStoredState)
	<-g.saving
	g.gate = make(chan struct{})
	second, err := n.m.Snapshot(context.Background(), src.ID, "second")
	if err != nil {
		t.Fatal(err)
	}
	<-g.saving
	if err := n.m.DeleteTemplate(context.Background(), "first"); err != nil {
		t.Fatal(err)
	}
	if ids, _ := g.stored(t); len(ids) != 0 {
		t.Fatalf("stored after deleting first: %v", ids)
	}
	time.Sleep(50 * time.Millisecond)
	if c := g.collected(); c != 0 {
		t.Fatalf("collected %d times while an upload ran", c)
	}
	close(g.gate)
	n.waitSnapshot("second", sandbox.SnapshotStoredState)
	testutil.Eventually(t, 5*time.Second, "a collection after the upload", func() bool { return g.collected() == 1 })
	// The collection kept what second needs: loaded from the store alone, it restores.
	os.RemoveAll(second.Image)
	imports := n.rig.Driver.Calls("ImportImage")
	n.create(sandbox.CreateRequest{TemplateID: "second"})
	if n.rig.Driver.Calls("ImportImage") != imports+1 {
		t.Fatal("second was not loaded from the store")
	}
}
