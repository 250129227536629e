package sandbox_test

import (
	"context"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/envdclient"
	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// A create from the pool does not start the pool's refill under the caller's first command:
// the refill waits until the sandbox's first request has finished (its response read to the
// end), or for a grace period (200 ms) when none comes; then it runs.
func TestPoolRefillWaitsForTheFirstRequest(t *testing.T) {
	var mu sync.Mutex
	var launches []time.Time
	n := newNode(t, func(c *sandbox.Config) { c.PoolSize = 1 })
	n.rig.Driver.Fail = func(op, id string) error {
		switch op {
		case "Restore", "Prestart", "Start":
			mu.Lock()
			launches = append(launches, time.Now())
			mu.Unlock()
		}
		return nil
	}
	tpl := n.build("base")
	testutil.Eventually(t, 5*time.Second, "pool filled", func() bool { return poolOf(n, tpl.ID, "restored").Ready == 1 })
	time.Sleep(100 * time.Millisecond) // nothing else in flight
	mu.Lock()
	before := len(launches)
	mu.Unlock()

	called := time.Now()
	sb := n.create(sandbox.CreateRequest{})
	base, err := n.m.GuestURL(context.Background(), sb.ID, envdclient.Port)
	if err != nil {
		t.Fatal(err)
	}
	req, _ := http.NewRequest(http.MethodGet, base+"/health", nil)
	resp, err := n.m.GuestTransport().RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	// The first request's response stays open a while, as a command's stream does.
	time.Sleep(100 * time.Millisecond)
	closed := time.Now()
	resp.Body.Close()

	testutil.Eventually(t, 5*time.Second, "the refill started", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(launches) > before
	})
	mu.Lock()
	first := launches[before]
	mu.Unlock()
	// Not before the first request finished, unless the grace since the create passed.
	earliest := called.Add(200 * time.Millisecond)
	if closed.Before(earliest) {
		earliest = closed
	}
	if first.Before(earliest) {
		t.Fatalf("the refill started %s after the create was called, before the first request finished (%s) or the grace (200 ms) passed",
			first.Sub(called).Round(time.Millisecond), closed.Sub(called).Round(time.Millisecond))
	}

	testutil.Eventually(t, 5*time.Second, "pool refilled", func() bool { return poolOf(n, tpl.ID, "restored").Ready == 1 })

	// A sandbox that sends no request holds the refill back for the grace only.
	n.create(sandbox.CreateRequest{})
	testutil.Eventually(t, 5*time.Second, "pool refilled without a first request", func() bool {
		return poolOf(n, tpl.ID, "restored").Ready == 1
	})
}
