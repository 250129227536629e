package sandbox

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/testutil"
)

// connCounter is a test server that counts the connections it accepted and the ones closed.
type connCounter struct {
	mu             sync.Mutex
	opened, closed int
}

func (c *connCounter) state(_ net.Conn, s http.ConnState) {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch s {
	case http.StateNew:
		c.opened++
	case http.StateClosed, http.StateHijacked:
		c.closed++
	}
}

func (c *connCounter) get() (opened, closed int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.opened, c.closed
}

func okServer(t *testing.T) (*httptest.Server, *connCounter) {
	t.Helper()
	cc := &connCounter{}
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "ok")
	}))
	srv.Config.ConnState = cc.state
	srv.Start()
	t.Cleanup(srv.Close)
	return srv, cc
}

func get(t *testing.T, g *guestTransports, u string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, u, nil)
	res, err := g.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.ReadAll(res.Body)
	res.Body.Close()
}

// Requests into one sandbox reuse its connection: no handshake with the sandbox's netstack and
// no accept in envd per request.
func TestGuestReusesConnections(t *testing.T) {
	srv, cc := okServer(t)
	u, _ := url.Parse(srv.URL)
	g := newGuestTransports(nil, 0)
	g.open(u.Hostname(), "inst-1", false)
	for i := 0; i < 5; i++ {
		get(t, g, srv.URL)
	}
	if opened, _ := cc.get(); opened != 1 {
		t.Fatalf("5 sequential requests opened %d connections; want 1", opened)
	}
}

// When the sandbox stops (or its address goes to a new sandbox), its idle connections are
// closed too, and none stays tracked: nothing leaks, and no later request reuses one.
func TestGuestStopClosesIdleConnections(t *testing.T) {
	cases := []struct {
		name string
		stop func(g *guestTransports, addr string)
	}{
		{"close (kill, pause)", func(g *guestTransports, addr string) { g.close(addr) }},
		{"address reused by a new sandbox", func(g *guestTransports, addr string) { g.open(addr, "inst-2", true) }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			srv, cc := okServer(t)
			u, _ := url.Parse(srv.URL)
			g := newGuestTransports(nil, 0)
			g.open(u.Hostname(), "inst-1", false)
			get(t, g, srv.URL)
			get(t, g, srv.URL)
			gt := g.byAddr[u.Hostname()]
			tc.stop(g, u.Hostname())
			var tracked, opened, closed int
			testutil.EventuallyOr(t, 2*time.Second, func() bool {
				gt.mu.Lock()
				tracked = len(gt.conns)
				gt.mu.Unlock()
				opened, closed = cc.get()
				return tracked == 0 && opened == 1 && closed == 1
			}, func() string {
				return fmt.Sprintf("after the stop: %d connections tracked, server saw %d opened and %d closed; want 0, 1, 1", tracked, opened, closed)
			})
			if tc.name == "address reused by a new sandbox" {
				get(t, g, srv.URL)
				if opened, _ := cc.get(); opened != 2 {
					t.Fatalf("the new sandbox's request opened no connection of its own (%d in all)", opened)
				}
			}
		})
	}
}

// Opening the transport of the instance that already has one (a launch opened it for envd's
// /health and /init, then the sandbox is registered) keeps it and its connection: the
// sandbox's first request reuses the one /init left idle, and no warm-up is sent.
func TestGuestOpenOfTheSameInstanceKeepsItsConnection(t *testing.T) {
	var mu sync.Mutex
	var paths []string
	cc := &connCounter{}
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		paths = append(paths, r.URL.Path)
		mu.Unlock()
		_, _ = io.WriteString(w, "ok")
	}))
	srv.Config.ConnState = cc.state
	srv.Start()
	t.Cleanup(srv.Close)
	u, _ := url.Parse(srv.URL)
	port, _ := strconv.Atoi(u.Port())
	g := newGuestTransports(nil, port)
	g.open(u.Hostname(), "inst-1", false)
	get(t, g, srv.URL+"/init")
	g.open(u.Hostname(), "inst-1", true)
	get(t, g, srv.URL+"/process.Process/Start")
	time.Sleep(50 * time.Millisecond) // room for a warm-up request, if one were sent
	mu.Lock()
	defer mu.Unlock()
	if opened, closed := cc.get(); opened != 1 || closed != 0 || len(paths) != 2 {
		t.Fatalf("requests %q over %d connections (%d closed); want /init and the command over 1, none closed", paths, opened, closed)
	}
}

// A new transport opens its first connection at once (envd's /health), and the sandbox's first
// request uses it: no dial on the way of the SDK's first command after create.
func TestGuestOpenWarmsAConnection(t *testing.T) {
	var mu sync.Mutex
	var paths []string
	cc := &connCounter{}
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		paths = append(paths, r.URL.Path)
		mu.Unlock()
		_, _ = io.WriteString(w, "ok")
	}))
	srv.Config.ConnState = cc.state
	srv.Start()
	t.Cleanup(srv.Close)
	u, _ := url.Parse(srv.URL)
	port, _ := strconv.Atoi(u.Port())
	g := newGuestTransports(nil, port)
	g.open(u.Hostname(), "inst-1", true)
	testutil.Eventually(t, 2*time.Second, "open made no request of its own", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(paths) == 1
	})
	time.Sleep(20 * time.Millisecond) // the warm-up's connection back to idle
	get(t, g, srv.URL+"/process.Process/Start")
	mu.Lock()
	defer mu.Unlock()
	if opened, _ := cc.get(); opened != 1 || paths[0] != "/health" {
		t.Fatalf("warm-up %q, %d connections for it and the first request; want /health and 1", paths, opened)
	}
}
