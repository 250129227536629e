package cluster_test

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/cluster/clustertest"
	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// The cluster follows a node's lifecycle events: a start claims the sandbox (consuming its
// reservation), a stored pause routes it as stored, a resume (however caused) routes it as
// running again and deletes the stale pause image, an end releases it and deletes its image;
// the end of a copy whose sandbox another node holds touches nothing of that node's.
func TestEventsKeepRoutingInStep(t *testing.T) {
	e := clustertest.Start(t, 1)
	la, lb := newLocal("base"), newLocal("base")
	a := join(t, e.Endpoints(), "a", 4, la)
	b := join(t, e.Endpoints(), "b", 4, lb)
	pa, pb := &fakePorter{local: la}, &fakePorter{local: lb}
	ma, mb := cluster.NewMoves(a, pa), cluster.NewMoves(b, pb)
	t.Cleanup(ma.Close)
	t.Cleanup(mb.Close)
	ea, eb := cluster.NewEvents(a, ma, nil), cluster.NewEvents(b, mb, nil)
	ctx := context.Background()
	testutil.Eventually(t, 5*time.Second, "a sees b", func() bool { return len(a.Live()) == 2 })
	sbx := func(id string, st sandbox.State) *sandbox.Sandbox {
		return &sandbox.Sandbox{ID: id, TemplateID: "base", State: st, CPUCount: 1, MemoryMB: 512}
	}
	located := func(cl *cluster.Cluster, id string) cluster.Location {
		t.Helper()
		l, err := cl.Locate(ctx, id, true)
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	deleted := func(p *fakePorter) []string {
		p.mu.Lock()
		defer p.mu.Unlock()
		return slices.Clone(p.deleted)
	}

	// Started with a reservation.
	resv, err := b.Place(ctx, cluster.PlaceRequest{TemplateID: "base", Exclude: []string{"b"}})
	if err != nil || resv.Node != "a" {
		t.Fatalf("place on a: %+v %v", resv, err)
	}
	la.add("s1")
	if err := ea.Changed(ctx, sandbox.Event{Kind: sandbox.EventStarted, Sandbox: sbx("s1", sandbox.StateRunning), Reservation: resv.ID}); err != nil {
		t.Fatal(err)
	}
	if a.HasReservation(ctx, resv.ID) {
		t.Fatal("the start did not consume its reservation")
	}
	if l := located(b, "s1"); l.Node != "a" || l.Stored {
		t.Fatalf("s1 started: %+v", l)
	}

	// Paused and stored, then resumed (traffic woke it): running, its image deleted.
	if err := ea.Changed(ctx, sandbox.Event{Kind: sandbox.EventStored, Sandbox: sbx("s1", sandbox.StatePaused), Stored: stored("s1", "paused-s1-1")}); err != nil {
		t.Fatal(err)
	}
	if l := located(b, "s1"); l.Node != "a" || !l.Stored {
		t.Fatalf("s1 stored: %+v", l)
	}
	if err := ea.Changed(ctx, sandbox.Event{Kind: sandbox.EventResumed, Sandbox: sbx("s1", sandbox.StateRunning)}); err != nil {
		t.Fatal(err)
	}
	if l := located(b, "s1"); l.Node != "a" || l.Stored {
		t.Fatalf("s1 resumed: %+v, want running on a", l)
	}
	if got := deleted(pa); !slices.Equal(got, []string{"paused-s1-1"}) {
		t.Fatalf("images deleted after the resume: %v", got)
	}

	// Stored again, then ended: no route, no stored record, no image.
	if err := ea.Changed(ctx, sandbox.Event{Kind: sandbox.EventStored, Sandbox: sbx("s1", sandbox.StatePaused), Stored: stored("s1", "paused-s1-2")}); err != nil {
		t.Fatal(err)
	}
	la.Kill(ctx, "s1")
	if err := ea.Changed(ctx, sandbox.Event{Kind: sandbox.EventEnded, Sandbox: sbx("s1", sandbox.StateKilled), Reason: sandbox.EndTimeout}); err != nil {
		t.Fatal(err)
	}
	if l := located(b, "s1"); l.Known() {
		t.Fatalf("s1 ended: %+v, want unknown", l)
	}
	if got := deleted(pa); !slices.Equal(got, []string{"paused-s1-1", "paused-s1-2"}) {
		t.Fatalf("images deleted after the end: %v", got)
	}

	// A copy on b of a's stored sandbox ends (an adoption that lost): a's route and image stay.
	la.add("s2")
	if err := ea.Changed(ctx, sandbox.Event{Kind: sandbox.EventStarted, Sandbox: sbx("s2", sandbox.StateRunning)}); err != nil {
		t.Fatal(err)
	}
	if err := ea.Changed(ctx, sandbox.Event{Kind: sandbox.EventStored, Sandbox: sbx("s2", sandbox.StatePaused), Stored: stored("s2", "paused-s2-1")}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 5*time.Second, "b sees s2 stored", func() bool { l, _ := b.Locate(ctx, "s2", false); return l.Stored })
	if err := eb.Changed(ctx, sandbox.Event{Kind: sandbox.EventEnded, Sandbox: sbx("s2", sandbox.StateKilled), Reason: sandbox.EndKilled}); err != nil {
		t.Fatal(err)
	}
	if l := located(b, "s2"); l.Node != "a" || !l.Stored {
		t.Fatalf("s2 after b's copy ended: %+v, want a's, stored", l)
	}
	if got := deleted(pb); len(got) != 0 {
		t.Fatalf("b deleted %v", got)
	}
	if got := mb.StoredImage(ctx, "s2"); got != "paused-s2-1" {
		t.Fatalf("s2's stored image: %q", got)
	}
}

// A stored pause whose route another writer of this node rewrote a moment before (the sync
// loop's claim of a sandbox the create claimed too) is still recorded: the route is read again
// rather than the pause failing with "its route changed" (seen in CI).
func TestStoredPauseSurvivesARouteRewrittenBehindTheCache(t *testing.T) {
	e := clustertest.Start(t, 1)
	la := newLocal("base")
	a := join(t, e.Endpoints(), "a", 4, la)
	pa := &fakePorter{local: la}
	ma := cluster.NewMoves(a, pa)
	t.Cleanup(ma.Close)
	ea := cluster.NewEvents(a, ma, nil)
	ctx := context.Background()
	c := e.Client(t)
	sbx := func(id string, st sandbox.State) *sandbox.Sandbox {
		return &sandbox.Sandbox{ID: id, TemplateID: "base", State: st, CPUCount: 1, MemoryMB: 512}
	}
	la.add("s3")
	if err := ea.Changed(ctx, sandbox.Event{Kind: sandbox.EventStarted, Sandbox: sbx("s3", sandbox.StateRunning)}); err != nil {
		t.Fatal(err)
	}
	var key string
	resp, err := c.Get(ctx, "", clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		t.Fatal(err)
	}
	for _, kv := range resp.Kvs {
		if k := string(kv.Key); strings.HasSuffix(k, "/sandboxes/s3") {
			key = k
		}
	}
	if key == "" {
		t.Fatal("no route of s3 in etcd")
	}
	for i := 0; i < 20; i++ {
		cur, err := c.Get(ctx, key)
		if err != nil || len(cur.Kvs) != 1 {
			t.Fatalf("read the route: %v", err)
		}
		// The same route written again: a new revision the node's cache may not have yet.
		if _, err := c.Put(ctx, key, string(cur.Kvs[0].Value)); err != nil {
			t.Fatal(err)
		}
		img := "paused-s3-" + strconv.Itoa(i)
		if err := ea.Changed(ctx, sandbox.Event{Kind: sandbox.EventStored, Sandbox: sbx("s3", sandbox.StatePaused), Stored: stored("s3", img)}); err != nil {
			t.Fatalf("round %d: the stored pause failed: %v", i, err)
		}
		if err := ea.Changed(ctx, sandbox.Event{Kind: sandbox.EventResumed, Sandbox: sbx("s3", sandbox.StateRunning)}); err != nil {
			t.Fatalf("round %d: resume: %v", i, err)
		}
	}
}
