package daemon

import (
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/testutil"
)

// The keyless --metrics-listen server is bounded like any exposed listener: connections that
// never send a request are dropped after a timeout, and at most a few are served at once.
func TestMetricsServerIsBounded(t *testing.T) {
	defer func(n int, d time.Duration) { metricsMaxConns, metricsTimeout = n, d }(metricsMaxConns, metricsTimeout)
	metricsMaxConns, metricsTimeout = 2, 500*time.Millisecond
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	srv := serveMetrics(ln, h)
	defer srv.Close()
	url := "http://" + ln.Addr().String() + "/metrics"
	get := func(timeout time.Duration) error {
		c := &http.Client{Timeout: timeout, Transport: &http.Transport{DisableKeepAlives: true}}
		resp, err := c.Get(url)
		if err == nil {
			resp.Body.Close()
		}
		return err
	}
	if err := get(2 * time.Second); err != nil {
		t.Fatal(err)
	}
	// Idle connections that send nothing fill the cap...
	for i := 0; i < 2; i++ {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
	}
	time.Sleep(50 * time.Millisecond)
	if err := get(200 * time.Millisecond); err == nil {
		t.Fatal("a request was served past the connection cap")
	}
	// ...until the server drops them.
	testutil.Eventually(t, 5*time.Second, "idle connections dropped", func() bool { return get(time.Second) == nil })
}
