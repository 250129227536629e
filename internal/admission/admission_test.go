package admission

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// room is a fake owner of capacity: free slots, taken under its own lock.
type room struct {
	mu   sync.Mutex
	free int
}

func (r *room) take() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.free == 0 {
		return false
	}
	r.free--
	return true
}

func (r *room) give(q *Queue, n int) {
	r.mu.Lock()
	r.free += n
	r.mu.Unlock()
	q.Kick()
}

// waitFor polls until the queue holds n waiters (bounded).
func waitFor(t *testing.T, q *Queue, n int) {
	t.Helper()
	testutil.Eventually(t, 10*time.Second, fmt.Sprintf("the queue holds %d waiters", n), func() bool { return q.Len() == n })
}

// queued starts one caller of tenant that waits up to a minute, returns once it is queued,
// and the channel its answer comes on.
func queued(t *testing.T, ctx context.Context, q *Queue, r *room, tenant string) chan error {
	t.Helper()
	n := q.Len()
	done := make(chan error, 1)
	go func() { done <- q.Admit(ctx, tenant, time.Minute, r.take) }()
	waitFor(t, q, n+1)
	return done
}

// assertUnclaimed gives one unit of room back and checks that no waiter that left claims it.
func (r *room) assertUnclaimed(t *testing.T, q *Queue) {
	t.Helper()
	r.give(q, 1)
	if r.free != 1 {
		t.Fatalf("room claimed for a waiter that left")
	}
}

func TestAdmitsAtOnceWhenThereIsRoom(t *testing.T) {
	q := New(Options{})
	r := &room{free: 1}
	if err := q.Admit(context.Background(), "a", 0, r.take); err != nil {
		t.Fatal(err)
	}
	err := q.Admit(context.Background(), "a", 0, r.take)
	var ref *Refusal
	if !errors.As(err, &ref) || ref.Full || !errors.Is(err, errdefs.ErrExhausted) || ref.RetryAfter() <= 0 {
		t.Fatalf("no room and no wait: %v, want a refusal (429 with Retry-After)", err)
	}
}

// Room that frees goes to the tenants in turn, not to the one that queued the most.
func TestRoomGoesRoundRobinAcrossTenants(t *testing.T) {
	q := New(Options{Poll: time.Hour})
	r := &room{}
	var mu sync.Mutex
	var order []string
	var wg sync.WaitGroup
	enqueue := func(tenant string, i int) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := q.Admit(context.Background(), tenant, time.Minute, r.take); err != nil {
				t.Errorf("%s%d: %v", tenant, i, err)
				return
			}
			mu.Lock()
			order = append(order, tenant)
			mu.Unlock()
		}()
	}
	// a queues 6 first, then b and c queue 2 each.
	for i := 0; i < 6; i++ {
		enqueue("a", i)
		waitFor(t, q, i+1)
	}
	for i := 0; i < 2; i++ {
		enqueue("b", i)
		waitFor(t, q, 6+2*i+1)
		enqueue("c", i)
		waitFor(t, q, 6+2*i+2)
	}
	// One at a time, so the order of admission is the order of the wake-ups.
	for i := 0; i < 10; i++ {
		r.give(q, 1)
		waitFor(t, q, 10-i-1)
		for {
			mu.Lock()
			n := len(order)
			mu.Unlock()
			if n == i+1 {
				break
			}
			time.Sleep(time.Millisecond)
		}
	}
	wg.Wait()
	got := fmt.Sprint(order)
	// b and c are served within the first round after they came, not after a's six.
	if want := "[a b c a b c a a a a]"; got != want {
		t.Fatalf("admission order %s, want %s", got, want)
	}
}

// A burst of frees admits as many waiters as there is room for, in one Kick.
func TestKickAdmitsAsManyAsThereIsRoomFor(t *testing.T) {
	q := New(Options{Poll: time.Hour})
	r := &room{}
	var wg sync.WaitGroup
	errs := make(chan error, 5)
	for i := 0; i < 5; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			errs <- q.Admit(context.Background(), fmt.Sprint("t", i%2), time.Minute, r.take)
		}(i)
	}
	waitFor(t, q, 5)
	r.give(q, 3)
	waitFor(t, q, 2)
	r.give(q, 2)
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if r.free != 0 {
		t.Fatalf("room left %d, want 0", r.free)
	}
}

func TestQueueIsBounded(t *testing.T) {
	q := New(Options{MaxWaiters: 2, Poll: time.Hour})
	r := &room{}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for i := 0; i < 2; i++ {
		go q.Admit(ctx, "a", time.Minute, r.take)
	}
	waitFor(t, q, 2)
	err := q.Admit(context.Background(), "b", time.Minute, r.take)
	var ref *Refusal
	if !errors.As(err, &ref) || !ref.Full || !errors.Is(err, errdefs.ErrExhausted) {
		t.Fatalf("third waiter: %v, want a refusal for a full queue", err)
	}
}

func TestDeadlinePassesWithARefusal(t *testing.T) {
	q := New(Options{Poll: time.Hour})
	r := &room{}
	start := time.Now()
	err := q.Admit(context.Background(), "a", 50*time.Millisecond, r.take)
	var ref *Refusal
	if !errors.As(err, &ref) || ref.Full || ref.Waited < 50*time.Millisecond || time.Since(start) < 50*time.Millisecond {
		t.Fatalf("after the deadline: %v, want a refusal after waiting", err)
	}
	if q.Len() != 0 {
		t.Fatalf("the waiter that gave up is still queued")
	}
	r.assertUnclaimed(t, q) // room that frees later is not claimed for it
}

// A caller whose context ends (a client that disconnected) leaves the queue and claims nothing.
func TestCancelLeavesTheQueue(t *testing.T) {
	q := New(Options{Poll: time.Hour})
	r := &room{}
	ctx, cancel := context.WithCancel(context.Background())
	done := queued(t, ctx, q, r, "a")
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled waiter: %v", err)
	}
	waitFor(t, q, 0)
	r.assertUnclaimed(t, q)
}

// Newcomers do not jump the queue: with waiters, even a caller that may not wait is refused
// while room goes to the waiters first.
func TestNewcomersGoBehindTheWaiters(t *testing.T) {
	q := New(Options{Poll: time.Hour})
	r := &room{}
	done := queued(t, context.Background(), q, r, "a")
	r.mu.Lock()
	r.free = 1 // freed without a Kick
	r.mu.Unlock()
	if err := q.Admit(context.Background(), "b", 0, r.take); err == nil {
		t.Fatal("a caller that may not wait took room a waiter was owed")
	}
	// A newcomer that queues hands the room to the waiter ahead of it.
	go q.Admit(context.Background(), "b", 100*time.Millisecond, r.take)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// Room that frees without a Kick is found by the poll.
func TestPollFindsRoomWithoutAKick(t *testing.T) {
	q := New(Options{Poll: 10 * time.Millisecond})
	r := &room{}
	done := queued(t, context.Background(), q, r, "a")
	r.mu.Lock()
	r.free = 1
	r.mu.Unlock()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

func TestTicketTravelsInTheContext(t *testing.T) {
	if got := TicketOf(context.Background()); got.Tenant != "" || got.Wait != 0 || got.Waited != nil {
		t.Fatalf("no ticket: %+v", got)
	}
	want := Ticket{Tenant: "k1", Wait: 3 * time.Second}
	if got := TicketOf(WithTicket(context.Background(), want)); got.Tenant != want.Tenant || got.Wait != want.Wait {
		t.Fatalf("ticket %+v, want %+v", got, want)
	}
}
