package sandbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/admission"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// A create over the node's capacity waits in the admission queue (its context's ticket) and
// starts when a kill frees room; one whose wait passes, or whose caller leaves, gets nothing
// and holds nothing. Without a ticket (forks, resumes, the pools) it is refused at once.
func TestCreateOverCapacityWaitsForRoom(t *testing.T) {
	n := newNode(t, func(c *sandbox.Config) { c.MaxSandboxes = 2 })
	n.build("base")
	a := n.create(sandbox.CreateRequest{})
	n.create(sandbox.CreateRequest{})
	ticket := func(wait time.Duration) context.Context {
		return admission.WithTicket(context.Background(), admission.Ticket{Tenant: "k", Wait: wait})
	}
	// The deadline passes: a 429 with a Retry-After, nothing held.
	_, err := n.m.Create(ticket(100*time.Millisecond), sandbox.CreateRequest{TemplateID: "base"})
	var ref *admission.Refusal
	if !errors.As(err, &ref) || !errors.Is(err, errdefs.ErrExhausted) || ref.RetryAfter() <= 0 {
		t.Fatalf("create whose wait passed: %v, want a refusal", err)
	}
	// The caller leaves.
	ctx, cancel := context.WithCancel(ticket(time.Minute))
	gone := make(chan error, 1)
	go func() { _, err := n.m.Create(ctx, sandbox.CreateRequest{TemplateID: "base"}); gone <- err }()
	time.Sleep(50 * time.Millisecond)
	cancel()
	if err := <-gone; err == nil {
		t.Fatal("a create whose caller left started")
	}
	n.assertHolds(2)
	// A create that waits starts once a kill frees room.
	started := make(chan error, 1)
	go func() {
		_, err := n.m.Create(ticket(time.Minute), sandbox.CreateRequest{TemplateID: "base"})
		started <- err
	}()
	select {
	case err := <-started:
		t.Fatalf("create over the cap did not wait: %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	if err := n.m.Kill(context.Background(), a.ID); err != nil {
		t.Fatal(err)
	}
	if err := <-started; err != nil {
		t.Fatalf("queued create: %v", err)
	}
	n.assertHolds(2)
	if len(n.sandboxDirs()) != 2 {
		t.Fatalf("sandbox directories %v, want the 2 running sandboxes'", n.sandboxDirs())
	}
}
