package sandbox

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"sync"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// guestTransports gives every running sandbox its own HTTP transport, keyed by the guest
// address it has now. Connections are never shared between sandboxes, and when a sandbox stops
// (kill, pause) its transport and connections are closed: a slot's address is reused by later
// sandboxes, and a kept-alive connection must never carry one sandbox's request to another.
type guestTransports struct {
	mu     sync.Mutex
	byAddr map[string]*http.Transport
	dial   func(ctx context.Context, network, addr string) (net.Conn, error)
}

func newGuestTransports(dial func(ctx context.Context, network, addr string) (net.Conn, error)) *guestTransports {
	return &guestTransports{
		byAddr: map[string]*http.Transport{},
		dial:   dial,
	}
}

// open registers the transport of a sandbox that now runs at guest IP addr.
func (g *guestTransports) open(addr string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if old := g.byAddr[addr]; old != nil {
		old.CloseIdleConnections()
	}
	// No keep-alive: a fresh connection per request costs a fraction of a millisecond over the
	// veth, and no connection ever outlives the request it was made for.
	g.byAddr[addr] = &http.Transport{
		DialContext:        g.dial,
		DisableKeepAlives:  true,
		DisableCompression: true,
	}
}

// close drops the transport of guest IP addr and its connections.
func (g *guestTransports) close(addr string) {
	g.mu.Lock()
	t := g.byAddr[addr]
	delete(g.byAddr, addr)
	g.mu.Unlock()
	if t != nil {
		t.CloseIdleConnections()
	}
}

// RoundTrip sends r through the transport of the sandbox at r's host.
func (g *guestTransports) RoundTrip(r *http.Request) (*http.Response, error) {
	g.mu.Lock()
	t := g.byAddr[r.URL.Hostname()]
	g.mu.Unlock()
	if t == nil {
		return nil, fmt.Errorf("no running sandbox at %s: %w", r.URL.Host, errdefs.ErrUnavailable)
	}
	return t.RoundTrip(r)
}
