package sandbox

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ember-sandbox/ember/internal/envdclient"
	"github.com/ember-sandbox/ember/internal/errdefs"
)

// guestTransports gives every running sandbox its own HTTP transport, keyed by the guest
// address it has now. Its connections are kept alive between requests (each new one costs a
// handshake with the sandbox's netstack and an accept in envd, a millisecond or more under
// gVisor), but never shared between sandboxes: when a sandbox stops (kill, pause) every
// connection of its transport is closed, idle and busy ones, and a new sandbox at the same
// address gets a new transport. A slot's address is reused by later sandboxes, so a kept-alive
// connection must never carry one sandbox's request to another, and a stream into a sandbox that
// is gone must end now. (A killed sandbox's netstack sends no FIN or RST: without this, a proxied
// command stream would hang until TCP keepalive gives up.)
type guestTransports struct {
	mu     sync.Mutex
	byAddr map[string]*guestTransport
	dial   dialFunc
	// warmPort, when set, is envd's port: open(warm) makes the new transport's first connection
	// at once (a GET /health), so that the sandbox's first request finds a connection ready
	// instead of dialing one (for sandboxes whose launch did not go through the transport).
	warmPort int
}

type dialFunc = func(ctx context.Context, network, addr string) (net.Conn, error)

const (
	// guestIdleConns bounds the idle connections kept per sandbox (envd holds a goroutine and
	// buffers for each, inside the sandbox's memory).
	guestIdleConns = 4
	// guestIdleTimeout closes a connection left idle this long.
	guestIdleTimeout = 30 * time.Second
)

// guestTransport is one sandbox's transport and the connections it has open.
type guestTransport struct {
	*http.Transport
	inst   string // the runtime instance it reaches
	mu     sync.Mutex
	conns  map[*trackedConn]struct{}
	closed bool
	// first, when set, is called once the next request through the transport finished
	// (watchFirst).
	first atomic.Pointer[func()]
}

// newGuestTransports makes the transports; dial reaches a guest address (nil: a net.Dialer).
// With warmPort, open(warm) opens a new transport's first connection to that port at once.
func newGuestTransports(dial dialFunc, warmPort int) *guestTransports {
	if dial == nil {
		dial = (&net.Dialer{Timeout: 3 * time.Second, KeepAlive: 30 * time.Second}).DialContext
	}
	return &guestTransports{byAddr: map[string]*guestTransport{}, dial: dial, warmPort: warmPort}
}

// open registers the transport of runtime instance inst, which now runs at guest IP addr. A
// transport already open for the same instance is kept with its connections: a launch opens
// it before envd's /health and /init, so that the connection they used is idle and ready when
// the create answers, and the sandbox's first request (the SDK's first command) dials nothing.
// A transport of any other instance at addr is replaced and all its connections closed. With
// warm, a new transport opens its first connection at once (when nothing else did).
func (g *guestTransports) open(addr, inst string, warm bool) {
	g.mu.Lock()
	old := g.byAddr[addr]
	if old != nil && old.inst == inst {
		g.mu.Unlock()
		return
	}
	gt := &guestTransport{inst: inst, conns: map[*trackedConn]struct{}{}}
	gt.Transport = &http.Transport{
		DialContext:        gt.dial(g.dial),
		DisableCompression: true,
		// The ports of network.httpsPorts serve TLS with whatever certificate the sandbox
		// has, self-signed included: it is not verified (E2B's proxy does not either; the
		// hop stays on the node).
		TLSClientConfig:     &tls.Config{InsecureSkipVerify: true}, //nolint:gosec
		TLSHandshakeTimeout: 10 * time.Second,
		MaxIdleConnsPerHost: guestIdleConns,
		IdleConnTimeout:     guestIdleTimeout,
	}
	g.byAddr[addr] = gt
	g.mu.Unlock()
	if old != nil {
		old.closeAll()
	}
	if warm && g.warmPort != 0 {
		go gt.warm(net.JoinHostPort(addr, strconv.Itoa(g.warmPort)))
	}
}

// warmTimeout bounds the request that opens a transport's first connection.
const warmTimeout = 3 * time.Second

// warm sends GET /health to hostport through the transport, leaving its connection idle for
// the next request. Failures are of no consequence: that request then dials as usual.
func (gt *guestTransport) warm(hostport string) {
	ctx, cancel := context.WithTimeout(context.Background(), warmTimeout)
	defer cancel()
	_ = envdclient.New(&http.Client{Transport: gt}, "http://"+hostport, "").Health(ctx)
}

// close drops the transport of guest IP addr and closes all its connections, idle or not.
func (g *guestTransports) close(addr string) {
	g.mu.Lock()
	gt := g.byAddr[addr]
	delete(g.byAddr, addr)
	g.mu.Unlock()
	if gt != nil {
		gt.closeAll()
	}
}

// RoundTrip sends r through the transport of the sandbox at r's host.
func (g *guestTransports) RoundTrip(r *http.Request) (*http.Response, error) {
	g.mu.Lock()
	gt := g.byAddr[r.URL.Hostname()]
	g.mu.Unlock()
	if gt == nil {
		return nil, fmt.Errorf("no running sandbox at %s: %w", r.URL.Host, errdefs.ErrUnavailable)
	}
	return gt.roundTrip(r)
}

// dial records every connection the transport makes; a dial that completes after closeAll is
// closed at once.
func (gt *guestTransport) dial(d dialFunc) dialFunc {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := d(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		tc := &trackedConn{Conn: c, owner: gt}
		gt.mu.Lock()
		defer gt.mu.Unlock()
		if gt.closed {
			c.Close()
			return nil, fmt.Errorf("sandbox at %s stopped: %w", addr, errdefs.ErrUnavailable)
		}
		gt.conns[tc] = struct{}{}
		return tc, nil
	}
}

// closeAll closes the transport's connections, in use or idle, and refuses new ones.
func (gt *guestTransport) closeAll() {
	if f := gt.first.Swap(nil); f != nil {
		(*f)() // the sandbox stopped before its first request
	}
	gt.mu.Lock()
	gt.closed = true
	conns := gt.conns
	gt.conns = map[*trackedConn]struct{}{}
	gt.mu.Unlock()
	for c := range conns {
		c.Conn.Close()
	}
	gt.CloseIdleConnections()
}

// trackedConn removes itself from its transport's set when closed.
type trackedConn struct {
	net.Conn
	owner *guestTransport
	once  sync.Once
}

func (c *trackedConn) Close() error {
	c.once.Do(func() {
		c.owner.mu.Lock()
		delete(c.owner.conns, c)
		c.owner.mu.Unlock()
	})
	return c.Conn.Close()
}
