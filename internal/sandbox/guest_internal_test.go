package sandbox

import (
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"testing"
	"time"
)

// Finished requests leave no connection tracked (no leak per request).
func TestGuestConnectionsUntracked(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "ok")
	}))
	t.Cleanup(srv.Close)
	u, _ := url.Parse(srv.URL)
	g := newGuestTransports(nil)
	g.open(u.Hostname())
	for i := 0; i < 5; i++ {
		req, _ := http.NewRequest(http.MethodGet, srv.URL, nil)
		res, err := g.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.ReadAll(res.Body)
		res.Body.Close()
	}
	gt := g.byAddr[u.Hostname()]
	deadline := time.Now().Add(2 * time.Second)
	for {
		gt.mu.Lock()
		n := len(gt.conns)
		gt.mu.Unlock()
		if n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d connections still tracked after the requests finished", n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
