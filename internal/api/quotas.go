package api

import (
	"context"
	"net/http"
	"time"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/quota"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// Quotas per team (internal/quota): every change that makes a team hold more (a create, a
// resume, a fork, a pause, a snapshot, a build) is admitted against its quota first, in scoped
// (teams.go and below); over one it answers 429 naming it.

// newQuotas is the quotas over this node when the daemon gave none.
func (s *server) newQuotas() *quota.Quotas {
	disk := 0
	if res := s.resources(); res != nil {
		_, _, disk = res.TemplateResources(&sandbox.Template{})
	}
	var builds quota.Builds
	if s.cfg.Builds != nil {
		builds = s.cfg.Builds
	}
	return quota.New(quotaSource{s}, builds, s.keys, disk)
}

// quotaBlocker is a cluster that holds blocks of the teams' quotas (*cluster.Cluster): the
// running part of a quota then holds across the nodes.
type quotaBlocker interface {
	NewQuotaBlocks(held cluster.QuotaHeld) *cluster.QuotaBlocks
}

// quotaSource counts a node's sandboxes and the cluster's templates.
type quotaSource struct{ s *server }

func (q quotaSource) List(ctx context.Context, f sandbox.ListFilter) ([]*sandbox.Sandbox, error) {
	return q.s.node.List(ctx, f)
}

// ListTemplates lists the cluster's templates (the node's own in one): a template counts
// against its team's disk quota once, on every node, wherever it was built.
func (q quotaSource) ListTemplates(ctx context.Context) ([]*sandbox.Template, error) {
	return q.s.shared.ListTemplates(ctx)
}

// admit admits more for the caller's team (nothing to do without a caller).
func (s *server) admit(ctx context.Context, more quota.Usage) (func(), error) {
	if _, ok := auth.CallerOf(ctx); !ok || s.quotas == nil {
		return func() {}, nil
	}
	return s.quotas.Admit(ctx, auth.TeamOf(ctx), more)
}

// running is what a sandbox of cpu and memory counts while it runs, n times.
func running(n, cpu, memoryMB int) quota.Usage {
	return quota.Usage{Sandboxes: n, CPUs: n * cpu, MemoryMB: n * memoryMB}
}

// createUsage is what a create from templateID adds.
func (s *server) createUsage(ctx context.Context, templateID string) quota.Usage {
	t, err := s.findTemplate(ctx, templateID)
	if err != nil {
		t = &sandbox.Template{}
	}
	cpu, mem := t.CPUCount, t.MemoryMB
	if res := s.resources(); res != nil {
		cpu, mem, _ = res.TemplateResources(t)
	}
	return running(1, cpu, mem)
}

// resumeUsage is what resuming sandbox id adds (nothing when it runs).
func (c scoped) resumeUsage(ctx context.Context, id string) quota.Usage {
	sb, err := c.Service.Get(ctx, id)
	if err != nil || sb.State != sandbox.StatePaused {
		return quota.Usage{}
	}
	return running(1, sb.CPUCount, sb.MemoryMB)
}

// Connect resumes within the team's quota.
func (c scoped) Connect(ctx context.Context, id string, timeout time.Duration) (*sandbox.Sandbox, bool, error) {
	release, err := c.s.admit(ctx, c.resumeUsage(ctx, id))
	if err != nil {
		return nil, false, err
	}
	defer release()
	return c.Service.Connect(ctx, id, timeout)
}

// ConnectWith resumes within the team's quota.
func (c scoped) ConnectWith(ctx context.Context, id string, opts sandbox.ConnectOptions) (*sandbox.Sandbox, bool, error) {
	release, err := c.s.admit(ctx, c.resumeUsage(ctx, id))
	if err != nil {
		return nil, false, err
	}
	defer release()
	return c.Service.ConnectWith(ctx, id, opts)
}

// Fork makes count children within the team's quota.
func (c scoped) Fork(ctx context.Context, id string, count int, timeout time.Duration) ([]sandbox.ForkResult, error) {
	var more quota.Usage
	if sb, err := c.Service.Get(ctx, id); err == nil {
		more = running(count, sb.CPUCount, sb.MemoryMB)
	}
	release, err := c.s.admit(ctx, more)
	if err != nil {
		return nil, err
	}
	defer release()
	return c.Service.Fork(ctx, id, count, timeout)
}

// pauseUsage is what pausing sandbox id adds.
func (c scoped) pauseUsage(ctx context.Context, id string) quota.Usage {
	sb, err := c.Service.Get(ctx, id)
	if err != nil || sb.State != sandbox.StateRunning {
		return quota.Usage{}
	}
	return quota.Usage{PausedDiskMB: sb.DiskSizeMB}
}

// Pause pauses within the team's quota of paused disk.
func (c scoped) Pause(ctx context.Context, id string) error {
	release, err := c.s.admit(ctx, c.pauseUsage(ctx, id))
	if err != nil {
		return err
	}
	defer release()
	return c.Service.Pause(ctx, id)
}

// PauseWith pauses within the team's quota of paused disk.
func (c scoped) PauseWith(ctx context.Context, id string, opts sandbox.PauseOptions) error {
	release, err := c.s.admit(ctx, c.pauseUsage(ctx, id))
	if err != nil {
		return err
	}
	defer release()
	return c.Service.PauseWith(ctx, id, opts)
}

// Snapshot snapshots within the team's quota of templates' disk.
func (c scoped) Snapshot(ctx context.Context, id, name string) (*sandbox.Template, error) {
	var more quota.Usage
	if sb, err := c.Service.Get(ctx, id); err == nil {
		more.TemplateDiskMB = c.s.quotas.TemplateDisk(sb.DiskSizeMB)
	}
	release, err := c.s.admit(ctx, more)
	if err != nil {
		return nil, err
	}
	defer release()
	return c.Service.Snapshot(ctx, id, name)
}

// buildUsage is what a build adds: a build at once and a template's disk.
func (s *server) buildUsage() quota.Usage {
	return quota.Usage{Builds: 1, TemplateDiskMB: s.quotas.TemplateDisk(0)}
}

type teamUsageJSON struct {
	teamJSON
	Usage quota.Usage `json:"usage"`
}

// teamUsage is GET /ember/teams/{team}/usage: the team, its quota and what it holds.
func (s *server) teamUsage(w http.ResponseWriter, r *http.Request, p params) error {
	if _, err := s.team(r, p); err != nil {
		return err
	}
	tu, err := s.quotas.Of(r.Context(), p["team"])
	if err != nil {
		return teamNotFound(err, p["team"])
	}
	writeJSON(w, http.StatusOK, teamUsageJSON{teamJSON: toTeam(tu.Team), Usage: tu.Usage})
	return nil
}
