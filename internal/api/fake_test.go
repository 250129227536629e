package api

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// fakeService is an in-memory sandbox.Service with the Manager's user-visible state machine.
// Calls a test did not arrange for (a build or fork without a hook, a guest lookup with no
// guest server) fail the test.
type fakeService struct {
	t testing.TB

	mu        sync.Mutex
	seq       int
	base      time.Time
	sbxs      map[string]*sandbox.Sandbox
	templates map[string]*sandbox.Template
	guestURL  string
	guestHits []string // "id:port" per GuestURL call that succeeded
	transport *http.Transport

	build func(ctx context.Context, req sandbox.BuildRequest, progress func(string)) (*sandbox.Template, error)
	fork  func(ctx context.Context, id string, count int, timeout time.Duration) ([]sandbox.ForkResult, error)
}

func newFake(t testing.TB) *fakeService {
	f := &fakeService{
		t:         t,
		base:      time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC),
		sbxs:      map[string]*sandbox.Sandbox{},
		templates: map[string]*sandbox.Template{"base": {ID: "base", Kind: "template", Ready: true, Aliases: []string{"base"}, CPUCount: 2, MemoryMB: 512}},
		transport: &http.Transport{},
	}
	t.Cleanup(f.transport.CloseIdleConnections)
	return f
}

func (f *fakeService) unexpected(call string) error {
	f.t.Errorf("unexpected call to sandbox.Service.%s", call)
	return fmt.Errorf("unexpected call %s", call)
}

// add puts a sandbox in the given state directly.
func (f *fakeService) add(state sandbox.State, md map[string]string) *sandbox.Sandbox {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.addLocked("base", state, md, sandbox.DefaultTimeout)
}

func (f *fakeService) addLocked(tmpl string, state sandbox.State, md map[string]string, timeout time.Duration) *sandbox.Sandbox {
	f.seq++
	id := fmt.Sprintf("sbx%03d", f.seq)
	start := f.base.Add(time.Duration(f.seq) * time.Second)
	sb := &sandbox.Sandbox{
		ID: id, TemplateID: tmpl, State: state, Metadata: md,
		AccessToken: "tok-" + id, StartedAt: start, EndAt: start.Add(timeout),
		CPUCount: 2, MemoryMB: 512, DiskSizeMB: 1024, AllowInternet: true,
	}
	f.sbxs[id] = sb
	return sb
}

func (f *fakeService) live(id string) (*sandbox.Sandbox, error) {
	sb, ok := f.sbxs[id]
	if !ok || sb.State == sandbox.StateKilled {
		return nil, fmt.Errorf("sandbox %q: %w", id, errdefs.ErrNotFound)
	}
	return sb, nil
}

func clone(sb *sandbox.Sandbox) *sandbox.Sandbox { c := *sb; return &c }

func (f *fakeService) Create(_ context.Context, req sandbox.CreateRequest) (*sandbox.Sandbox, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.templates[req.TemplateID]; !ok {
		return nil, fmt.Errorf("template %q: %w", req.TemplateID, errdefs.ErrNotFound)
	}
	sb := f.addLocked(req.TemplateID, sandbox.StateRunning, req.Metadata, req.Timeout)
	sb.EnvVars = req.EnvVars
	sb.AutoPause = req.AutoPause
	if req.AllowInternet != nil {
		sb.AllowInternet = *req.AllowInternet
	}
	return clone(sb), nil
}

func (f *fakeService) Get(_ context.Context, id string) (*sandbox.Sandbox, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	sb, err := f.live(id)
	if err != nil {
		return nil, err
	}
	return clone(sb), nil
}

func (f *fakeService) List(_ context.Context, flt sandbox.ListFilter) ([]*sandbox.Sandbox, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	states := flt.States
	if len(states) == 0 {
		states = []sandbox.State{sandbox.StateRunning, sandbox.StatePaused}
	}
	var out []*sandbox.Sandbox
	for _, sb := range f.sbxs {
		ok := false
		for _, st := range states {
			ok = ok || sb.State == st
		}
		if !ok || !matchesMetadata(sb, flt.Metadata) || (flt.TemplateID != "" && sb.TemplateID != flt.TemplateID) ||
			(!flt.StartedAfter.IsZero() && !sb.StartedAt.After(flt.StartedAfter)) {
			continue
		}
		out = append(out, clone(sb))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID }) // not the API's order
	return out, nil
}

func (f *fakeService) Kill(_ context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	sb, err := f.live(id)
	if err != nil {
		return err
	}
	sb.State = sandbox.StateKilled
	return nil
}

func (f *fakeService) SetTimeout(_ context.Context, id string, d time.Duration) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	sb, err := f.live(id)
	if err != nil {
		return err
	}
	if sb.State != sandbox.StateRunning {
		return fmt.Errorf("sandbox %q is paused: %w", id, errdefs.ErrNotFound)
	}
	sb.EndAt = f.base.Add(d)
	return nil
}

func (f *fakeService) Pause(_ context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	sb, err := f.live(id)
	if err != nil {
		return err
	}
	if sb.State == sandbox.StatePaused {
		return fmt.Errorf("sandbox %q already paused: %w", id, errdefs.ErrConflict)
	}
	sb.State = sandbox.StatePaused
	return nil
}

func (f *fakeService) Connect(_ context.Context, id string, timeout time.Duration) (*sandbox.Sandbox, bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	sb, err := f.live(id)
	if err != nil {
		return nil, false, err
	}
	resumed := sb.State == sandbox.StatePaused
	sb.State = sandbox.StateRunning
	return clone(sb), resumed, nil
}

func (f *fakeService) Snapshot(_ context.Context, id, name string) (*sandbox.Template, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, err := f.live(id); err != nil {
		return nil, err
	}
	f.seq++
	if name == "" {
		name = fmt.Sprintf("snap%03d", f.seq)
	}
	t := &sandbox.Template{ID: name + ":default", Kind: "snapshot", Names: []string{name}, SourceSandbox: id,
		CreatedAt: f.base.Add(time.Duration(f.seq) * time.Second), Ready: true}
	f.templates[t.ID] = t
	return t, nil
}

func (f *fakeService) ListSnapshots(_ context.Context, sandboxID string) ([]*sandbox.Template, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []*sandbox.Template
	for _, t := range f.templates {
		if t.Kind == "snapshot" && (sandboxID == "" || t.SourceSandbox == sandboxID) {
			c := *t
			out = append(out, &c)
		}
	}
	return out, nil
}

func (f *fakeService) DeleteTemplate(_ context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.templates[id]; !ok {
		return fmt.Errorf("template %q: %w", id, errdefs.ErrNotFound)
	}
	delete(f.templates, id)
	return nil
}

func (f *fakeService) Fork(ctx context.Context, id string, count int, timeout time.Duration) ([]sandbox.ForkResult, error) {
	if _, err := f.Get(ctx, id); err != nil {
		return nil, err
	}
	if f.fork == nil {
		return nil, f.unexpected("Fork")
	}
	return f.fork(ctx, id, count, timeout)
}

func (f *fakeService) Metrics(_ context.Context, id string) ([]sandbox.Metric, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, err := f.live(id); err != nil {
		return nil, err
	}
	var out []sandbox.Metric
	for i := 0; i < 3; i++ {
		out = append(out, sandbox.Metric{Timestamp: f.base.Add(time.Duration(i) * 10 * time.Second), CPUCount: 2,
			CPUUsedPct: 12.5, MemUsed: 100 << 20, MemTotal: 512 << 20, DiskUsed: 1 << 20, DiskTotal: 1 << 30})
	}
	return out, nil
}

func (f *fakeService) ListTemplates(_ context.Context) ([]*sandbox.Template, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []*sandbox.Template
	for _, t := range f.templates {
		c := *t
		out = append(out, &c)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out, nil
}

func (f *fakeService) BuildTemplate(ctx context.Context, req sandbox.BuildRequest, progress func(string)) (*sandbox.Template, error) {
	if f.build == nil {
		return nil, f.unexpected("BuildTemplate")
	}
	return f.build(ctx, req, progress)
}

func (f *fakeService) GuestURL(_ context.Context, id string, port int) (string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	sb, err := f.live(id)
	if err != nil {
		return "", err
	}
	if sb.State != sandbox.StateRunning {
		return "", fmt.Errorf("sandbox %q is paused: %w", id, errdefs.ErrConflict)
	}
	if f.guestURL == "" {
		return "", f.unexpected("GuestURL")
	}
	f.guestHits = append(f.guestHits, fmt.Sprintf("%s:%d", id, port))
	return f.guestURL, nil
}

func (f *fakeService) GuestTransport() http.RoundTripper { return f.transport }

func (f *fakeService) hits() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.guestHits...)
}

func (f *fakeService) state(id string) sandbox.State {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.sbxs[id].State
}

func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(b []byte) (int, error) { w.t.Log(string(b)); return len(b), nil }

var _ sandbox.Service = (*fakeService)(nil)

func (f *fakeService) PauseWith(ctx context.Context, id string, _ sandbox.PauseOptions) error {
	return f.Pause(ctx, id)
}

func (f *fakeService) ConnectWith(ctx context.Context, id string, o sandbox.ConnectOptions) (*sandbox.Sandbox, bool, error) {
	return f.Connect(ctx, id, o.Timeout)
}

func (f *fakeService) Pools(context.Context) []sandbox.PoolState { return []sandbox.PoolState{} }
