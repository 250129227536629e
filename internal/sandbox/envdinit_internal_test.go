package sandbox

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// An envd that accepts /init but does not answer in time (a guest starved on a loaded node: CI
// saw it under 100 concurrent creates) fails the launch with a 503 that says what timed out,
// not a bare "context deadline exceeded" that the API can only answer as "internal error".
func TestInitThatDoesNotAnswerInTimeIsAClearUnavailable(t *testing.T) {
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-release:
		}
	}))
	t.Cleanup(func() { close(release); srv.Close() })
	m := &Manager{cfg: Config{EnvdTimeout: 300 * time.Millisecond}}
	sb := &Sandbox{ID: "sbx1", AccessToken: "tok"}
	err := m.initEnvd(context.Background(), srv.Client(), srv.URL, sb, "", nil)
	if err == nil {
		t.Fatal("an /init that never answers succeeded")
	}
	if got := errdefs.HTTPStatus(err); got != http.StatusServiceUnavailable {
		t.Fatalf("status %d for %q, want 503", got, err)
	}
	if msg := err.Error(); !strings.Contains(msg, "did not answer") || !strings.Contains(msg, "/init") {
		t.Fatalf("message %q does not say that envd's /init did not answer in time", msg)
	}
	// A caller that gave up is not the guest's fault: its own cancellation comes back as it is.
	ctx, cancel := context.WithCancel(context.Background())
	go func() { time.Sleep(50 * time.Millisecond); cancel() }()
	if err := m.initEnvd(ctx, srv.Client(), srv.URL, sb, "", nil); errdefs.HTTPStatus(err) == http.StatusServiceUnavailable {
		t.Fatalf("a cancelled caller's /init is reported as the guest's fault: %v", err)
	}
}
