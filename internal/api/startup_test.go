package api

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// fakeStartup is a daemon still building its start-up templates until built or failed.
type fakeStartup struct {
	mu       sync.Mutex
	building []string
	done     chan struct{}
	err      error
}

func (f *fakeStartup) Building() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.building)
}

func (f *fakeStartup) Wait(ctx context.Context, name string) error {
	if !slices.Contains(f.Building(), name) {
		return nil
	}
	select {
	case <-f.done:
		return f.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (f *fakeStartup) end(err error) {
	f.mu.Lock()
	f.building, f.err = nil, err
	f.mu.Unlock()
	close(f.done)
}

// While the daemon builds its start-up templates, /health answers 503 naming them, every other
// call is served, a create of one of them waits for its build (and gets its error if it fails),
// and a create of another template does not wait.
func TestAPIWhileStartupTemplatesBuild(t *testing.T) {
	for _, fail := range []bool{false, true} {
		t.Run(fmt.Sprintf("fail=%v", fail), func(t *testing.T) {
			st := &fakeStartup{building: []string{"base"}, done: make(chan struct{})}
			e := newEnvConfig(t, Config{Domain: testDomain, Startup: st})
			if r := e.do("GET", "/health", ""); r.status != http.StatusServiceUnavailable || !strings.Contains(string(r.body), `"building":["base"]`) {
				t.Fatalf("/health while base builds: %d %s", r.status, r.body)
			}
			if r := e.ctl("GET", "/sandboxes", ""); r.status != http.StatusOK {
				t.Fatalf("list while base builds: %d %s", r.status, r.body)
			}
			created := make(chan resp, 1)
			go func() { created <- e.ctl("POST", "/sandboxes", `{"templateID":"base"}`) }()
			select {
			case r := <-created:
				t.Fatalf("the create did not wait for the build: %d %s", r.status, r.body)
			case <-time.After(200 * time.Millisecond):
			}
			var err error
			if fail {
				err = fmt.Errorf("template %q: its start-up build failed: disk full: %w", "base", errdefs.ErrUnavailable)
			}
			st.end(err)
			r := <-created
			if !fail && r.status != http.StatusCreated {
				t.Fatalf("create after the build: %d %s", r.status, r.body)
			}
			if fail && (r.status != http.StatusServiceUnavailable || !strings.Contains(string(r.body), "start-up build failed")) {
				t.Fatalf("create after a failed build: %d %s", r.status, r.body)
			}
			if r := e.do("GET", "/health", ""); r.status != http.StatusOK {
				t.Fatalf("/health once built: %d %s", r.status, r.body)
			}
		})
	}
}
