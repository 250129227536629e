package cli

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// ember node ls prints the nodes GET /nodes gives (table and --json); ember node drain posts.
func TestNodeCommands(t *testing.T) {
	var drained string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		switch {
		case r.Method == http.MethodGet && r.URL.Path == "/nodes":
			io.WriteString(w, `[{"nodeID":"n1","state":"active","url":"http://10.0.0.1:3000","capacity":{"cpu":8,"memoryMB":16000,"slots":500},"allocated":{"slots":2,"memoryMB":1024},"sandboxes":["a","b"],"routes":2,"leaseTTLSeconds":10,"leaseAgeSeconds":3},
				{"nodeID":"n2","state":"lost","capacity":{},"allocated":{},"sandboxes":[]}]`)
		case r.Method == http.MethodPost && r.URL.Path == "/nodes/n1/drain":
			drained = r.Header.Get("X-API-Key")
			io.WriteString(w, `{"nodeID":"n1","state":"draining","sandboxes":[]}`)
		default:
			http.NotFound(w, r)
		}
	}))
	defer srv.Close()
	key := "e2b_00112233445566778899aabbccddeeff00112233"
	out := captureStdout(t, func() { Main([]string{"--url", srv.URL, "--api-key", key, "node", "ls"}) })
	for _, want := range []string{"NODE", "n1", "active", "2/500", "1024/16000", "ROUTES", "LEASE AGE/TTL", "3s/10s", "n2", "lost"} {
		if !strings.Contains(out, want) {
			t.Fatalf("node ls misses %q:\n%s", want, out)
		}
	}
	out = captureStdout(t, func() { Main([]string{"--url", srv.URL, "--api-key", key, "--json", "node", "ls"}) })
	if !strings.Contains(out, `"nodeID": "n2"`) || !strings.Contains(out, `"leaseAgeSeconds": 3`) || !strings.Contains(out, `"routes": 2`) {
		t.Fatalf("node ls --json:\n%s", out)
	}
	out = captureStdout(t, func() { Main([]string{"--url", srv.URL, "--api-key", key, "node", "drain", "n1"}) })
	if !strings.Contains(out, "n1 draining") || drained != key {
		t.Fatalf("node drain: %q (key %q)", out, drained)
	}
}
