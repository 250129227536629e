package cluster_test

import (
	"context"
	"errors"
	"github.com/ember-sandbox/ember/internal/testutil"
	"sync"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/cluster/clustertest"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// fakePorter is a node's paused-sandbox mover without a runtime or an image store.
type fakePorter struct {
	local    *fakeLocal
	mu       sync.Mutex
	imported []string
	deleted  []string
	// settle: how long an import lasts once the sandbox is listed here (a real one loads
	// its pause image meanwhile).
	settle time.Duration
}

func (p *fakePorter) ImportPaused(_ context.Context, ps *sandbox.PortableSandbox) (*sandbox.Sandbox, error) {
	p.mu.Lock()
	p.imported = append(p.imported, ps.Sandbox.ID)
	p.mu.Unlock()
	s := p.local.add(ps.Sandbox.ID)
	p.local.mu.Lock()
	s.Running = false
	p.local.sbxs[s.ID] = s
	p.local.mu.Unlock()
	time.Sleep(p.settle)
	return &sandbox.Sandbox{ID: ps.Sandbox.ID, State: sandbox.StatePaused}, nil
}

func (p *fakePorter) List(context.Context, sandbox.ListFilter) ([]*sandbox.Sandbox, error) {
	return nil, nil
}
func (p *fakePorter) Pause(context.Context, string) error       { return nil }
func (p *fakePorter) Kill(ctx context.Context, id string) error { return p.local.Kill(ctx, id) }
func (p *fakePorter) DeleteStored(_ context.Context, image string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.deleted = append(p.deleted, image)
}

func stored(id, image string) *sandbox.PortableSandbox {
	return &sandbox.PortableSandbox{Sandbox: sandbox.Sandbox{ID: id, TemplateID: "base"}, ImageID: image}
}

// A stored paused sandbox is not lost with its node: it stays routed as stored, a live node's
// is never taken from it, and once its node is gone exactly one of two nodes adopting it at
// once gets it; a re-pause deletes the image it replaces.
func TestStoredPausedSandboxOutlivesItsNode(t *testing.T) {
	e := clustertest.Start(t, 1)
	la, lb, lc := newLocal("base"), newLocal("base"), newLocal("base")
	a := join(t, e.Endpoints(), "a", 4, la)
	b := join(t, e.Endpoints(), "b", 4, lb)
	c := join(t, e.Endpoints(), "c", 4, lc)
	pa, pb, pc := &fakePorter{local: la}, &fakePorter{local: lb}, &fakePorter{local: lc}
	ma, mb, mc := cluster.NewMoves(a, pa), cluster.NewMoves(b, pb), cluster.NewMoves(c, pc)
	t.Cleanup(ma.Close)
	t.Cleanup(mb.Close)
	t.Cleanup(mc.Close)
	ctx := context.Background()
	for _, id := range []string{"sp", "sr"} {
		if err := a.Claim(ctx, la.add(id), ""); err != nil {
			t.Fatal(err)
		}
	}
	if err := ma.Stored(ctx, stored("sp", "paused-sp-1")); err != nil {
		t.Fatal(err)
	}
	if err := ma.Stored(ctx, stored("sp", "paused-sp-2")); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 5*time.Second, "the first image deleted", func() bool {
		pa.mu.Lock()
		defer pa.mu.Unlock()
		return len(pa.deleted) == 1 && pa.deleted[0] == "paused-sp-1"
	})
	testutil.Eventually(t, 5*time.Second, "b sees sp stored", func() bool { l, _ := b.Locate(ctx, "sp", false); return l.Stored && l.Node == "a" })
	if got := mb.StoredImage(ctx, "sp"); got != "paused-sp-2" {
		t.Fatalf("stored image %q", got)
	}
	if err := mb.Adopt(ctx, "sp"); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("adopt from a live node: %v, want ErrConflict", err)
	}
	a.Close() // no Leave: the lease runs out
	testutil.Eventually(t, ttl+3*time.Second, "sr reported lost", func() bool {
		l, err := b.Locate(ctx, "sr", true)
		return err == nil && l.Lost != nil
	})
	l, err := b.Locate(ctx, "sp", true)
	if err != nil || l.Lost != nil || !l.Stored || !l.Dead {
		t.Fatalf("sp after its node died: %+v %v, want stored, its node dead, not lost", l, err)
	}
	if u, err := mc.Unheld(ctx); err != nil || len(u) != 1 || u[0].ID != "sp" || u[0].State != sandbox.StatePaused {
		t.Fatalf("unheld with its node dead: %+v %v, want sp paused", u, err)
	}
	errs := make(chan error, 2)
	go func() { errs <- mb.Adopt(ctx, "sp") }()
	go func() { errs <- mc.Adopt(ctx, "sp") }()
	e1, e2 := <-errs, <-errs
	if (e1 == nil) == (e2 == nil) {
		t.Fatalf("two adoptions at once: %v and %v, want exactly one to succeed", e1, e2)
	}
	winner, loser, lw := b, lc, lb
	if lc.has("sp") && !lb.has("sp") {
		winner, loser, lw = c, lb, lc
	}
	if !lw.has("sp") || loser.has("sp") {
		t.Fatalf("sp held by b %v, c %v: want the winner alone", lb.has("sp"), lc.has("sp"))
	}
	l, _ = winner.Locate(ctx, "sp", true)
	if !l.Local || !l.Stored {
		t.Fatalf("sp at the winner: %+v, want local and still stored", l)
	}
	// Adopted: its node lists it, no edge from the stored record; and no edge ends it there.
	for _, m := range []*cluster.Moves{mb, mc} {
		if u, err := m.Unheld(ctx); err != nil || len(u) != 0 {
			t.Fatalf("unheld once adopted: %+v %v, want none", u, err)
		}
		if u, err := m.Unheld(ctx, "sp"); err != nil || len(u) != 0 {
			t.Fatalf("unheld sp once adopted: %+v %v, want none", u, err)
		}
		if err := m.Forget(ctx, "sp"); !errors.Is(err, errdefs.ErrConflict) {
			t.Fatalf("forget once adopted: %v, want ErrConflict", err)
		}
	}
	// Running again: no longer stored.
	if err := winner.Claim(ctx, cluster.LocalSandbox{ID: "sp", TemplateID: "base", Running: true}, ""); err != nil {
		t.Fatal(err)
	}
	if l, _ := winner.Locate(ctx, "sp", true); l.Stored {
		t.Fatalf("sp resumed but still stored: %+v", l)
	}
}

// A drained node's stored sandbox adopted by another node: the drained node, drained no more
// a moment later, serves it no more from its copy (it routes it to the adopter, as every edge
// does once it reads the route) and kills the copy.
func TestAdoptedFromADrainedNode(t *testing.T) {
	e := clustertest.Start(t, 1)
	la, lb := newLocal("base"), newLocal("base")
	a := join(t, e.Endpoints(), "a", 4, la)
	b := join(t, e.Endpoints(), "b", 4, lb)
	pa, pb := &fakePorter{local: la}, &fakePorter{local: lb}
	ma, mb := cluster.NewMoves(a, pa), cluster.NewMoves(b, pb)
	t.Cleanup(ma.Close)
	t.Cleanup(mb.Close)
	ctx := context.Background()
	testutil.Eventually(t, 5*time.Second, "a sees both", func() bool { return len(a.Live()) == 2 })
	s := la.add("sd")
	if err := a.Claim(ctx, s, ""); err != nil {
		t.Fatal(err)
	}
	if err := ma.Stored(ctx, stored("sd", "paused-sd")); err != nil {
		t.Fatal(err)
	}
	if err := a.Drain(ctx, "a", true); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 5*time.Second, "b sees a drained", func() bool { return b.Draining("a") })
	if err := mb.Adopt(ctx, "sd"); err != nil {
		t.Fatal(err)
	}
	if err := a.Drain(ctx, "a", false); err != nil {
		t.Fatal(err)
	}
	if l, err := a.Locate(ctx, "sd", false); err != nil || l.Local || l.Node != "b" {
		t.Fatalf("sd through a after b adopted it: %+v %v, want b's", l, err)
	}
	testutil.Eventually(t, 5*time.Second, "a kills its copy", func() bool { return !la.has("sd") })
}

// A node adopting a stored sandbox holds it before the route is its own (the import comes
// first): its reconcile, running meanwhile, does not take it for a sandbox the cluster gives
// another node and kill it (TestStoredPausedSandboxOutlivesItsNode once found the winner of
// an adoption holding nothing).
func TestAdoptionOutlivesTheReconcile(t *testing.T) {
	e := clustertest.Start(t, 1)
	la, lb := newLocal("base"), newLocal("base")
	a := join(t, e.Endpoints(), "a", 4, la)
	b := join(t, e.Endpoints(), "b", 4, lb)
	pa, pb := &fakePorter{local: la}, &fakePorter{local: lb, settle: 5 * 200 * time.Millisecond} // 5 reconciles
	ma, mb := cluster.NewMoves(a, pa), cluster.NewMoves(b, pb)
	t.Cleanup(ma.Close)
	t.Cleanup(mb.Close)
	ctx := context.Background()
	if err := a.Claim(ctx, la.add("sp"), ""); err != nil {
		t.Fatal(err)
	}
	if err := ma.Stored(ctx, stored("sp", "paused-sp")); err != nil {
		t.Fatal(err)
	}
	a.Close() // no Leave: the lease runs out
	testutil.Eventually(t, ttl+5*time.Second, "sp's node gone", func() bool {
		l, err := b.Locate(ctx, "sp", true)
		return err == nil && l.Dead && l.Stored
	})
	if err := mb.Adopt(ctx, "sp"); err != nil {
		t.Fatal(err)
	}
	if !lb.has("sp") {
		t.Fatalf("the adopted sandbox is not held by its adopter (killed: %v)", lb.killed)
	}
	if l, err := b.Locate(ctx, "sp", false); err != nil || !l.Local {
		t.Fatalf("sp after the adoption: %+v %v, want b's", l, err)
	}
}
