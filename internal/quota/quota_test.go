package quota

import (
	"context"
	"errors"
	"net/http"
	"testing"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

type src struct{ sbxs []*sandbox.Sandbox }

func (s *src) List(context.Context, sandbox.ListFilter) ([]*sandbox.Sandbox, error) {
	return s.sbxs, nil
}
func (s *src) ListTemplates(context.Context) ([]*sandbox.Template, error) { return nil, nil }

func newQuotas(t *testing.T, q auth.Quota) (*Quotas, *src) {
	keys := auth.NewKeys(auth.NewMemoryBackend())
	if _, _, _, err := keys.CreateTeam(context.Background(), "b", q); err != nil {
		t.Fatal(err)
	}
	s := &src{}
	return New(s, nil, keys, 1024), s
}

// Changes admitted and not finished count: two creates at once cannot both take the last slot.
func TestAdmitCountsPending(t *testing.T) {
	qs, _ := newQuotas(t, auth.Quota{Sandboxes: 1})
	team := func() string { ts, _ := qs.teams.ListTeams(context.Background()); return ts[len(ts)-1].ID }()
	ctx := context.Background()
	release, err := qs.Admit(ctx, team, Usage{Sandboxes: 1})
	if err != nil {
		t.Fatal(err)
	}
	_, err = qs.Admit(ctx, team, Usage{Sandboxes: 1})
	var ex *ExceededError
	if !errors.As(err, &ex) || ex.Quota != "sandboxes" || errdefs.HTTPStatus(err) != http.StatusTooManyRequests || !errors.Is(err, errdefs.ErrExhausted) {
		t.Fatalf("second admit = %v, want the sandboxes quota's 429", err)
	}
	release()
	release() // idempotent
	r2, err := qs.Admit(ctx, team, Usage{Sandboxes: 1})
	if err != nil {
		t.Fatalf("after release: %v", err)
	}
	r2()
}

// Usage counts a team's running and paused sandboxes by their owner ("" : the default team).
func TestUsageByTeam(t *testing.T) {
	qs, s := newQuotas(t, auth.Quota{CPUs: 4})
	team := func() string { ts, _ := qs.teams.ListTeams(context.Background()); return ts[len(ts)-1].ID }()
	s.sbxs = []*sandbox.Sandbox{
		{Team: team, State: sandbox.StateRunning, CPUCount: 2, MemoryMB: 512},
		{Team: team, State: sandbox.StatePaused, CPUCount: 2, DiskSizeMB: 100},
		{State: sandbox.StateRunning, CPUCount: 8},
	}
	tu, err := qs.Of(context.Background(), team)
	if err != nil {
		t.Fatal(err)
	}
	if tu.Usage != (Usage{Sandboxes: 1, CPUs: 2, MemoryMB: 512, PausedDiskMB: 100}) {
		t.Fatalf("usage %+v", tu.Usage)
	}
	if _, err := qs.Admit(context.Background(), team, Usage{Sandboxes: 1, CPUs: 3}); err == nil {
		t.Fatal("2+3 vCPUs admitted under a quota of 4")
	}
	if _, err := qs.Admit(context.Background(), auth.DefaultTeamID, Usage{Sandboxes: 100, CPUs: 100}); err != nil {
		t.Fatalf("the default team has no quota: %v", err)
	}
}
