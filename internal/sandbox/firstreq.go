package sandbox

import (
	"io"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// firstRequestGrace bounds how long a new sandbox's first request (the SDK's first
// commands.run) holds pool refills back: a caller that sends none holds none for longer.
const firstRequestGrace = 200 * time.Millisecond

// firstRequests are the sandboxes created lately whose first guest request has not finished.
// Refills wait for them (pool.fill): in a create → commands.run → kill loop, a refill started
// as the create answers ran its restore on the CPU the caller's first command needed.
type firstRequests struct {
	mu    sync.Mutex
	until map[string]time.Time // sandbox id -> when the wait for it ends anyway
}

// add registers sandbox id as waiting for its first request, for firstRequestGrace at most.
func (f *firstRequests) add(id string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.until == nil {
		f.until = map[string]time.Time{}
	}
	f.until[id] = time.Now().Add(firstRequestGrace)
}

// done ends the wait for id (its first request finished, or it ended).
func (f *firstRequests) done(id string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.until, id)
}

// pending says whether some sandbox still waits for its first request to finish.
func (f *firstRequests) pending() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	now := time.Now()
	for id, t := range f.until {
		if now.After(t) {
			delete(f.until, id)
		}
	}
	return len(f.until) > 0
}

// watchFirst calls done once the next request through the transport of guest IP addr has
// finished: its response body read to the end or closed (a command's stream ends with the
// command), or the request failed, or the transport closed (the sandbox stopped). Without a
// transport at addr, done is called at once.
func (g *guestTransports) watchFirst(addr string, done func()) {
	g.mu.Lock()
	gt := g.byAddr[addr]
	g.mu.Unlock()
	if gt == nil {
		done()
		return
	}
	gt.first.Store(&done)
}

// roundTrip is RoundTrip through gt that reports the end of the first request watched.
func (gt *guestTransport) roundTrip(r *http.Request) (*http.Response, error) {
	f := gt.first.Swap(nil)
	if f == nil {
		return gt.RoundTrip(r)
	}
	resp, err := gt.RoundTrip(r)
	if err != nil || resp.StatusCode == http.StatusSwitchingProtocols {
		// An upgraded connection (a WebSocket) may stay open for good, and its body must stay
		// writable for the proxy: it is done as it starts.
		(*f)()
		return resp, err
	}
	resp.Body = &endBody{ReadCloser: resp.Body, end: *f}
	return resp, nil
}

// endBody calls end once, when the body is read to its end (or fails) or closed.
type endBody struct {
	io.ReadCloser
	end  func()
	once atomic.Bool
}

func (b *endBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err != nil && b.once.CompareAndSwap(false, true) {
		b.end()
	}
	return n, err
}

func (b *endBody) Close() error {
	err := b.ReadCloser.Close()
	if b.once.CompareAndSwap(false, true) {
		b.end()
	}
	return err
}
