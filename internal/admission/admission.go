// Package admission is the fair admission queue of a node: a create that finds the node full
// waits here, up to its deadline, instead of failing at once; room that frees up goes to the
// waiters round-robin across tenants (one admission per tenant per round, first come first
// served within a tenant), so a tenant that sends a burst cannot starve the others. The queue
// is bounded; a caller is refused (*Refusal: errdefs.ErrExhausted, HTTP 429 with Retry-After)
// only when the queue is full or its deadline passes. A caller whose context ends (a client
// that disconnected) leaves the queue.
//
// The queue does not know what room is: each waiter brings a take function that claims room
// if there is some (under the owner's lock, never blocking), and the owner calls Kick whenever
// room may have freed. The queue calls take for the waiter whose turn it is, so room is
// claimed for the waiter before it wakes and nobody can take it in between.
package admission

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// Defaults of a Queue's settings.
const (
	DefaultMaxWaiters = 1000
	DefaultWait       = 5 * time.Second
	// MaxWait bounds the wait a caller may ask for.
	MaxWait = 5 * time.Minute
	// DefaultPoll is how often waiters check for room that freed without a Kick.
	DefaultPoll = time.Second
)

// Queue is a bounded fair queue of callers waiting for room. The zero value is not usable: New.
type Queue struct {
	max        int
	poll       time.Duration
	retryAfter time.Duration

	mu      sync.Mutex
	tenants map[string][]*waiter // each tenant's waiters, first come first
	ring    []string             // tenants with waiters, in round-robin order
	next    int                  // the index in ring of the tenant whose turn is next
	n       int                  // waiters in all
}

type waiter struct {
	tenant   string
	take     func() bool
	admitted chan struct{} // closed once take claimed room for it
}

// Options configure a Queue; zero fields take the defaults.
type Options struct {
	// MaxWaiters bounds the waiters (DefaultMaxWaiters).
	MaxWaiters int
	// Poll is how often the queue looks for room without a Kick (DefaultPoll).
	Poll time.Duration
	// RetryAfter is what a refusal tells the caller to wait before trying again (1 s).
	RetryAfter time.Duration
}

// New returns an empty queue.
func New(o Options) *Queue {
	if o.MaxWaiters <= 0 {
		o.MaxWaiters = DefaultMaxWaiters
	}
	if o.Poll <= 0 {
		o.Poll = DefaultPoll
	}
	if o.RetryAfter <= 0 {
		o.RetryAfter = time.Second
	}
	return &Queue{max: o.MaxWaiters, poll: o.Poll, retryAfter: o.RetryAfter, tenants: map[string][]*waiter{}}
}

// Refusal is the queue's no: it was full, or the caller's deadline passed before room freed.
// It is an errdefs.ErrExhausted (429) and names how long to wait before trying again.
type Refusal struct {
	// Full: the queue was full (else the deadline passed).
	Full   bool
	Waited time.Duration
	Retry  time.Duration
}

func (r *Refusal) Error() string {
	if r.Full {
		return "no room, and the admission queue is full: try again later"
	}
	if r.Waited == 0 {
		return "no room: try again later"
	}
	return fmt.Sprintf("no room freed within %s in the admission queue: try again later", r.Waited.Round(time.Millisecond))
}

// Is makes a Refusal an errdefs.ErrExhausted.
func (r *Refusal) Is(target error) bool { return target == errdefs.ErrExhausted }

// RetryAfter is how long the caller should wait before trying again.
func (r *Refusal) RetryAfter() time.Duration { return r.Retry }

// Admit claims room with take: at once when nobody waits and take succeeds, else after
// waiting in tenant's line for up to wait (0: no waiting). It returns nil once take claimed
// room (the caller then holds it and must give it back as the owner does), a *Refusal when
// the queue is full or the wait is over, or ctx's error when ctx ends first (the caller left).
func (q *Queue) Admit(ctx context.Context, tenant string, wait time.Duration, take func() bool) error {
	start := time.Now()
	q.mu.Lock()
	// Nobody is ahead: no need to line up. With waiters, a newcomer goes behind them (room
	// that freed is theirs first).
	if q.n == 0 && take() {
		q.mu.Unlock()
		return nil
	}
	if wait <= 0 {
		q.mu.Unlock()
		return &Refusal{Retry: q.retryAfter}
	}
	if q.n >= q.max {
		q.mu.Unlock()
		return &Refusal{Full: true, Retry: q.retryAfter}
	}
	w := &waiter{tenant: tenant, take: take, admitted: make(chan struct{})}
	q.pushLocked(w)
	q.kickLocked() // room the waiters ahead missed (freed without a Kick) goes in their order
	q.mu.Unlock()

	timer := time.NewTimer(wait)
	defer timer.Stop()
	poll := time.NewTicker(q.poll)
	defer poll.Stop()
	var err error
	for err == nil {
		select {
		case <-w.admitted:
			return nil
		case <-poll.C:
			q.Kick()
		case <-ctx.Done():
			err = ctx.Err()
		case <-timer.C:
			err = &Refusal{Waited: time.Since(start), Retry: q.retryAfter}
		}
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	select {
	case <-w.admitted:
		return nil // room was claimed for it as it gave up: the caller holds it all the same
	default:
	}
	q.removeLocked(w)
	return err
}

// Kick gives room that may have freed to the waiters, in their fair order, for as long as
// there is some. The owner calls it whenever it gives room back.
func (q *Queue) Kick() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.kickLocked()
}

func (q *Queue) kickLocked() {
	for q.n > 0 {
		t := q.ring[q.next]
		w := q.tenants[t][0]
		if !w.take() {
			return
		}
		q.removeLocked(w)
		close(w.admitted)
		// The next tenant's turn (removeLocked kept next on the tenant after a removed one).
		if len(q.tenants[t]) > 0 && len(q.ring) > 0 {
			q.next = (q.next + 1) % len(q.ring)
		}
	}
}

// Len is the number of waiters.
func (q *Queue) Len() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.n
}

func (q *Queue) pushLocked(w *waiter) {
	if len(q.tenants[w.tenant]) == 0 {
		// A new tenant joins the round just before the tenant whose turn is next: it waits
		// at most one round.
		q.ring = append(q.ring, "")
		copy(q.ring[q.next+1:], q.ring[q.next:])
		q.ring[q.next] = w.tenant
		q.next = (q.next + 1) % len(q.ring)
	}
	q.tenants[w.tenant] = append(q.tenants[w.tenant], w)
	q.n++
}

// removeLocked takes w out of the queue; a tenant left without waiters leaves the round, and
// next keeps pointing at the same tenant (or, if that one left, the one after it).
func (q *Queue) removeLocked(w *waiter) {
	ws := q.tenants[w.tenant]
	for i, x := range ws {
		if x == w {
			ws = append(ws[:i], ws[i+1:]...)
			q.n--
			break
		}
	}
	if len(ws) > 0 {
		q.tenants[w.tenant] = ws
		return
	}
	delete(q.tenants, w.tenant)
	for i, t := range q.ring {
		if t != w.tenant {
			continue
		}
		q.ring = append(q.ring[:i], q.ring[i+1:]...)
		if i < q.next {
			q.next--
		}
		if q.next >= len(q.ring) {
			q.next = 0
		}
		break
	}
}

// ---- what a request carries to the queue ----

type ticketKey struct{}

// Ticket is what a caller brings to the queue: who it is (the tenant it is fair among) and how
// long it may wait.
type Ticket struct {
	Tenant string
	Wait   time.Duration
	// Waited, if set, is told how long the caller waited for room (0: it was let in at once).
	Waited func(time.Duration)
}

// WithTicket returns ctx carrying t.
func WithTicket(ctx context.Context, t Ticket) context.Context {
	return context.WithValue(ctx, ticketKey{}, t)
}

// TicketOf is ctx's ticket; without one a caller does not wait (Wait 0).
func TicketOf(ctx context.Context) Ticket {
	t, _ := ctx.Value(ticketKey{}).(Ticket)
	return t
}
