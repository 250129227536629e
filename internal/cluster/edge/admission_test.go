package edge

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/admission"
	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/errdefs"
)

// fullCluster has room for as many creates as room says (Room is its view of it).
type fullCluster struct {
	*fakeCluster
	room atomic.Int32
}

func (c *fullCluster) Place(ctx context.Context, req cluster.PlaceRequest) (*cluster.Reservation, error) {
	if c.room.Add(-1) < 0 {
		c.room.Add(1)
		return nil, fmt.Errorf("no node has room for a sandbox of template %q: %w", req.TemplateID, errdefs.ErrExhausted)
	}
	return c.fakeCluster.Place(ctx, req)
}

func (c *fullCluster) Room(string) int { return int(max(c.room.Load(), 0)) }

// placeQueued sends a create with a queue timeout to an edge of fc.
func placeQueued(e *Edge, wait time.Duration) *httptest.ResponseRecorder {
	req := httptest.NewRequest(http.MethodPost, "/sandboxes", strings.NewReader(`{"templateID":"base"}`))
	req = req.WithContext(admission.WithTicket(req.Context(), admission.Ticket{Tenant: "k", Wait: wait}))
	rec := httptest.NewRecorder()
	e.Serve(rec, req, Target{Kind: Create, TemplateID: "base", Body: []byte(`{"templateID":"base"}`),
		CreateHere: func(context.Context, string) ([]byte, error) { return []byte(`{"sandboxID":"abc"}`), nil }})
	return rec
}

// In a full cluster a create waits in the edge's admission queue and is placed once room
// frees; one whose wait passes gets a 429 with Retry-After; without a wait it is refused at once.
func TestPlaceCreateWaitsForRoomInAFullCluster(t *testing.T) {
	fc := &fullCluster{fakeCluster: &fakeCluster{nodes: []cluster.NodeInfo{{ID: "a"}}, local: "a"}}
	e := New(Config{Cluster: fc, Local: fakeLocal{}})
	if rec := placeQueued(e, 0); rec.Code != http.StatusTooManyRequests {
		t.Fatalf("no wait, full cluster: %d %s", rec.Code, rec.Body)
	}
	start := time.Now()
	rec := placeQueued(e, 200*time.Millisecond)
	if rec.Code != http.StatusTooManyRequests || rec.Header().Get("Retry-After") == "" || time.Since(start) < 200*time.Millisecond {
		t.Fatalf("wait passed: %d Retry-After %q after %s", rec.Code, rec.Header().Get("Retry-After"), time.Since(start))
	}
	done := make(chan *httptest.ResponseRecorder, 1)
	go func() { done <- placeQueued(e, time.Minute) }()
	select {
	case rec := <-done:
		t.Fatalf("a create in a full cluster did not wait: %d %s", rec.Code, rec.Body)
	case <-time.After(300 * time.Millisecond):
	}
	fc.room.Store(1) // room frees elsewhere: the queue's poll finds it in the view
	if rec := <-done; rec.Code != http.StatusCreated {
		t.Fatalf("queued create: %d %s", rec.Code, rec.Body)
	}
	if fc.room.Load() != 0 {
		t.Fatalf("room left %d, want 0", fc.room.Load())
	}
}
