package e2e

import (
	"fmt"
	"github.com/ember-sandbox/ember/internal/testutil"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
)

// A build's fromImage cannot make the daemon fetch from the host's own networks: a registry on
// a loopback address the operator did not allow (the harness allows 127.0.0.1, its registries'
// address; 127.0.0.2 is not) is refused before any request reaches it, and an allowed one's
// error answer is reported by its status, not its body.
func TestFromImageRegistryPolicy(t *testing.T) {
	d := need(t)
	var hits atomic.Int64
	banner := "SSH-2.0-OpenSSH_9.6 internal-banner"
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		w.WriteHeader(http.StatusTeapot)
		fmt.Fprint(w, banner)
	})
	ln, err := net.Listen("tcp", "127.0.0.2:0")
	testutil.Need(t, err == nil, fmt.Sprintf("a listener on 127.0.0.2: %v", err))
	hidden := httptest.NewUnstartedServer(h)
	hidden.Listener.Close()
	hidden.Listener = ln
	hidden.Start()
	t.Cleanup(hidden.Close)
	status, logs := d.stepBuild(t, "ssrf-hidden", map[string]any{"fromImage": ln.Addr().String() + "/x/y:v1",
		"steps": []map[string]any{{"type": "RUN", "args": []string{"true"}}}})
	if status != "error" || !strings.Contains(logs, "--registry-allow") || hits.Load() != 0 {
		t.Fatalf("a registry on 127.0.0.2 (not allowed): %s, %d requests reached it\n%s", status, hits.Load(), logs)
	}

	allowed := httptest.NewServer(h)
	t.Cleanup(allowed.Close)
	host := strings.TrimPrefix(allowed.URL, "http://")
	status, logs = d.stepBuild(t, "ssrf-echo", map[string]any{"fromImage": host + "/x/y:v1",
		"steps": []map[string]any{{"type": "RUN", "args": []string{"true"}}}})
	if status != "error" || hits.Load() == 0 || strings.Contains(logs, "OpenSSH") || !strings.Contains(logs, "418") {
		t.Fatalf("an allowed registry's error: %s (%d requests)\n%s", status, hits.Load(), logs)
	}
}
