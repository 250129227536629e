package api

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/ember-sandbox/ember/internal/auth"
)

// GET /metrics on the API listener is the Metrics handler's, behind the API key (X-API-Key or
// a bearer token, as Prometheus sends it).
func TestMetricsNeedTheAPIKey(t *testing.T) {
	keys := auth.NewKeys(auth.NewMemoryBackend())
	key, _, err := keys.Create(context.Background(), "test")
	if err != nil {
		t.Fatal(err)
	}
	g := newGuest(t)
	metrics := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ember_up 1\n") })
	svc := newService(t, g.srv.Listener.Addr().String())
	h := New(Config{Domain: testDomain, Metrics: metrics, Builds: svc.builds()}, svc, keys, testLogger(t))
	srv := httptest.NewServer(h)
	defer srv.Close()
	for _, c := range []struct {
		name, header, value string
		status              int
	}{
		{"no key", "", "", 401},
		{"wrong key", "X-API-Key", "e2b_nope", 401},
		{"api key", "X-API-Key", key, 200},
		{"bearer", "Authorization", "Bearer " + key, 200},
	} {
		req, _ := http.NewRequest("GET", srv.URL+"/metrics", nil)
		if c.header != "" {
			req.Header.Set(c.header, c.value)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != c.status || (c.status == 200 && string(body) != "ember_up 1\n") {
			t.Errorf("%s: %d %q, want %d", c.name, resp.StatusCode, body, c.status)
		}
	}
}
