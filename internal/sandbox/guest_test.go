package sandbox

import (
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"testing"
	"time"
)

// A sandbox that stops (kill, pause) must end the requests in flight to it at once: its netstack
// is gone and sends nothing, so a proxied stream would otherwise wait for TCP keepalive.
func TestGuestCloseEndsActiveStreams(t *testing.T) {
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "first\n")
		_ = http.NewResponseController(w).Flush()
		select { // then silence, like a sandbox that was killed
		case <-release:
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(func() { close(release); srv.Close() })
	u, _ := url.Parse(srv.URL)

	cases := []struct {
		name string
		stop func(g *guestTransports)
	}{
		{"close (kill, pause)", func(g *guestTransports) { g.close(u.Hostname()) }},
		{"address reused by a new sandbox", func(g *guestTransports) { g.open(u.Hostname(), "inst-2", true) }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			g := newGuestTransports(nil, 0)
			g.open(u.Hostname(), "inst-1", false)
			req, _ := http.NewRequest(http.MethodGet, srv.URL+"/stream", nil)
			res, err := g.RoundTrip(req)
			if err != nil {
				t.Fatal(err)
			}
			defer res.Body.Close()
			buf := make([]byte, 6)
			if _, err := io.ReadFull(res.Body, buf); err != nil || string(buf) != "first\n" {
				t.Fatalf("first chunk %q: %v", buf, err)
			}
			done := make(chan error, 1)
			go func() {
				_, err := io.ReadAll(res.Body)
				done <- err
			}()
			tc.stop(g)
			select {
			case err := <-done:
				if err == nil {
					t.Fatal("stream ended cleanly; want an error")
				}
			case <-time.After(3 * time.Second):
				t.Fatal("stream still open 3 s after the sandbox stopped")
			}
		})
	}
}
