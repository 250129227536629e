// Package quota keeps every team within its quotas (auth.Quota): running sandboxes, their
// vCPUs and memory, paused sandboxes' disk, builds at once and templates' disk. A change that
// would take a team past one is refused with a 429 that names the quota, in E2B's words for
// the sandbox limit. Usage is read from the node's sandboxes, templates and builds (plus what
// is being admitted right now), so it needs no bookkeeping of its own that could drift. In a
// cluster (SetBlocks) every quota but templates' disk (sandboxes, vCPUs, memory, paused disk,
// builds) holds across the nodes: a node admits a change only within the block of the team's
// quota it holds (cluster.QuotaBlocks), growing it when needed. Templates' disk needs no
// blocks: the templates are the cluster's (Source lists them alike on every node); what one
// node alone counts is a build or snapshot still in flight there (and a snapshot still
// uploading), so a team can exceed it by what it makes at the same moment on other nodes.
package quota

import (
	"context"
	"fmt"
	"net/http"
	"sync"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/template/build"
)

// Source is what usage is counted from (*sandbox.Manager).
type Source interface {
	List(ctx context.Context, f sandbox.ListFilter) ([]*sandbox.Sandbox, error)
	ListTemplates(ctx context.Context) ([]*sandbox.Template, error)
}

// Builds lists the builds (build.TemplateBuilder's ListBuilds with "": every template's).
type Builds interface {
	ListBuilds(ctx context.Context, templateID string) ([]*build.TemplateBuild, error)
}

// Teams reads the teams' quotas (*auth.Keys).
type Teams interface {
	GetTeam(ctx context.Context, id string) (*auth.Team, error)
	ListTeams(ctx context.Context) ([]*auth.Team, error)
}

// Blocks holds this node's blocks of the teams' quotas in a cluster (*cluster.QuotaBlocks).
type Blocks interface {
	// Cover makes the node's block of team's quota (limit) cover need, what the node holds
	// with the change (more) being admitted; ok false: the other nodes' blocks (others) leave
	// too little of the quota.
	Cover(ctx context.Context, team string, limit, need, more Usage) (others Usage, ok bool, err error)
}

// Usage is what a team holds, in the quota's units.
type Usage = auth.Quota

// TeamUsage is a team with its quota and its usage.
type TeamUsage struct {
	Team  *auth.Team
	Usage Usage
}

// Quotas counts usage and admits changes.
type Quotas struct {
	src    Source
	builds Builds // nil: no builds counted
	teams  Teams
	// defaultDiskMB is a template's disk when it names none (the node's default).
	defaultDiskMB int
	blocks        Blocks // nil: one node

	mu sync.Mutex
	// pending is what changes admitted and not finished yet add, by team: counted as usage
	// until they end (the sandbox then counts itself).
	pending map[string]Usage
}

// New returns the quotas of teams over src. defaultDiskMB is a template's disk when it names
// none.
func New(src Source, builds Builds, teams Teams, defaultDiskMB int) *Quotas {
	return &Quotas{src: src, builds: builds, teams: teams, defaultDiskMB: defaultDiskMB, pending: map[string]Usage{}}
}

// SetBlocks makes the quotas but templates' disk hold across a cluster: each node within
// the block of a team's quota it holds (call it before serving).
func (q *Quotas) SetBlocks(b Blocks) { q.blocks = b }

// Held is what this node holds now of the quotas of the teams with a quota counted in blocks
// (any but templates' disk), by team, with the changes being admitted (cluster.QuotaHeld).
func (q *Quotas) Held(ctx context.Context) (map[string]Usage, error) {
	ts, err := q.teams.ListTeams(ctx)
	if err != nil {
		return nil, err
	}
	all, err := q.usage(ctx)
	if err != nil {
		return nil, err
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	out := map[string]Usage{}
	for _, t := range ts {
		if l := t.Quota; l.Sandboxes > 0 || l.CPUs > 0 || l.MemoryMB > 0 || l.PausedDiskMB > 0 || l.Builds > 0 {
			out[t.ID] = add(all[t.ID], q.pending[t.ID], 1)
		}
	}
	return out, nil
}

// Usage counts what team holds now ("" : every team's, by team).
func (q *Quotas) usage(ctx context.Context) (map[string]Usage, error) {
	out := map[string]Usage{}
	sbxs, err := q.src.List(ctx, sandbox.ListFilter{States: []sandbox.State{sandbox.StateRunning, sandbox.StatePaused}})
	if err != nil {
		return nil, err
	}
	for _, sb := range sbxs {
		u := out[auth.Owner(sb.Team)]
		switch sb.State {
		case sandbox.StateRunning:
			u.Sandboxes++
			u.CPUs += sb.CPUCount
			u.MemoryMB += sb.MemoryMB
		case sandbox.StatePaused:
			u.PausedDiskMB += sb.DiskSizeMB
		}
		out[auth.Owner(sb.Team)] = u
	}
	tpls, err := q.src.ListTemplates(ctx)
	if err != nil {
		return nil, err
	}
	for _, t := range tpls {
		if t.Team == "" && !t.Public && t.Kind == "template" {
			continue // the node's own (base, built-in ones): no team's
		}
		u := out[auth.Owner(t.Team)]
		u.TemplateDiskMB += q.diskOf(t)
		out[auth.Owner(t.Team)] = u
	}
	if q.builds != nil {
		bs, err := q.builds.ListBuilds(ctx, "")
		if err != nil {
			return nil, err
		}
		for _, bl := range bs {
			if bl.Status == build.BuildWaiting || bl.Status == build.BuildBuilding {
				u := out[auth.Owner(bl.Team)]
				u.Builds++
				out[auth.Owner(bl.Team)] = u
			}
		}
	}
	return out, nil
}

func (q *Quotas) diskOf(t *sandbox.Template) int {
	if t.DiskMB > 0 {
		return t.DiskMB
	}
	return q.defaultDiskMB
}

// TemplateDisk is the disk a template of cpu/memory/disk asks counts at (diskMB 0: the
// node's default).
func (q *Quotas) TemplateDisk(diskMB int) int {
	if diskMB > 0 {
		return diskMB
	}
	return q.defaultDiskMB
}

// Of returns team's quota and usage.
func (q *Quotas) Of(ctx context.Context, team string) (TeamUsage, error) {
	t, err := q.teams.GetTeam(ctx, team)
	if err != nil {
		return TeamUsage{}, err
	}
	all, err := q.usage(ctx)
	if err != nil {
		return TeamUsage{}, err
	}
	return TeamUsage{Team: t, Usage: q.withPending(team, all[team])}, nil
}

// All returns every team's quota and usage.
func (q *Quotas) All(ctx context.Context) ([]TeamUsage, error) {
	ts, err := q.teams.ListTeams(ctx)
	if err != nil {
		return nil, err
	}
	all, err := q.usage(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]TeamUsage, 0, len(ts))
	for _, t := range ts {
		out = append(out, TeamUsage{Team: t, Usage: q.withPending(t.ID, all[t.ID])})
	}
	return out, nil
}

func (q *Quotas) withPending(team string, u Usage) Usage {
	q.mu.Lock()
	defer q.mu.Unlock()
	return add(u, q.pending[team], 1)
}

func add(a, b Usage, sign int) Usage {
	a.Sandboxes += sign * b.Sandboxes
	a.CPUs += sign * b.CPUs
	a.MemoryMB += sign * b.MemoryMB
	a.PausedDiskMB += sign * b.PausedDiskMB
	a.Builds += sign * b.Builds
	a.TemplateDiskMB += sign * b.TemplateDiskMB
	return a
}

// Admit checks that team may take more on top of what it holds and has pending, and holds it
// as pending until release (call it once the change is done or failed: the change's own
// record counts from then on). Over a quota: a 429 naming it.
func (q *Quotas) Admit(ctx context.Context, team string, more Usage) (release func(), err error) {
	t, err := q.teams.GetTeam(ctx, team)
	if err != nil {
		return nil, err
	}
	noop := func() {}
	if t.Quota == (auth.Quota{}) {
		return noop, nil // no limit at all: nothing to count
	}
	all, err := q.usage(ctx)
	if err != nil {
		return nil, err
	}
	q.mu.Lock()
	used := add(all[team], q.pending[team], 1)
	if err := over(t, used, more); err != nil {
		q.mu.Unlock()
		return nil, err
	}
	q.pending[team] = add(q.pending[team], more, 1)
	q.mu.Unlock()
	var once sync.Once
	release = func() {
		once.Do(func() {
			q.mu.Lock()
			q.pending[team] = add(q.pending[team], more, -1)
			if q.pending[team] == (Usage{}) {
				delete(q.pending, team)
			}
			q.mu.Unlock()
		})
	}
	if q.blocks != nil && (more.Sandboxes > 0 || more.CPUs > 0 || more.MemoryMB > 0 || more.PausedDiskMB > 0 || more.Builds > 0) {
		// The cluster's other nodes hold the rest of the quota: this node's block must cover
		// what it holds with the change (pending: the changes admitted here meanwhile too).
		need := q.withPending(team, all[team])
		others, ok, err := q.blocks.Cover(ctx, team, t.Quota, need, more)
		if err == nil && !ok {
			err = overCluster(t, others, need, more)
		}
		if err != nil {
			release()
			return nil, err
		}
	}
	return release, nil
}

// overCluster is the refusal of a change (more) that the node's block could not cover: the
// other nodes hold others, this one need with the change and those admitted meanwhile.
func overCluster(t *auth.Team, others, need, more Usage) error {
	held := add(others, need, 1)
	for _, try := range []struct{ used, more Usage }{
		{add(held, more, -1), more}, // as the change alone would take it over
		{held, more},
		{held, Usage{Sandboxes: 1, CPUs: 1, MemoryMB: 1}},
	} {
		if err := over(t, try.used, try.more); err != nil {
			return err
		}
	}
	return &ExceededError{Team: t.ID, Quota: "sandboxes", Limit: t.Quota.Sandboxes, Used: held.Sandboxes,
		Msg: fmt.Sprintf("Rate limit exceeded: you have reached the maximum number of concurrent E2B sandboxes (%d) of team %s (quota sandboxes)", t.Quota.Sandboxes, t.Name)}
}

// ExceededError is a change refused by a quota: 429, naming it.
type ExceededError struct {
	Team, Quota string
	Limit, Used int
	Msg         string
}

func (e *ExceededError) Error() string   { return e.Msg }
func (e *ExceededError) HTTPStatus() int { return http.StatusTooManyRequests }
func (e *ExceededError) Unwrap() error   { return errdefs.ErrOverQuota }

func over(t *auth.Team, used, more Usage) error {
	lim := t.Quota
	check := func(name string, limit, have, want int, msg string) error {
		if limit <= 0 || want <= 0 || have+want <= limit {
			return nil
		}
		return &ExceededError{Team: t.ID, Quota: name, Limit: limit, Used: have, Msg: msg}
	}
	for _, c := range []struct {
		name              string
		limit, have, want int
		msg               string
	}{
		{"sandboxes", lim.Sandboxes, used.Sandboxes, more.Sandboxes,
			fmt.Sprintf("Rate limit exceeded: you have reached the maximum number of concurrent E2B sandboxes (%d) of team %s (quota sandboxes)", lim.Sandboxes, t.Name)},
		{"cpus", lim.CPUs, used.CPUs, more.CPUs,
			fmt.Sprintf("Rate limit exceeded: team %s has %d of its %d vCPUs running and asked for %d more (quota cpus)", t.Name, used.CPUs, lim.CPUs, more.CPUs)},
		{"memoryMB", lim.MemoryMB, used.MemoryMB, more.MemoryMB,
			fmt.Sprintf("Rate limit exceeded: team %s has %d of its %d MiB of memory running and asked for %d more (quota memoryMB)", t.Name, used.MemoryMB, lim.MemoryMB, more.MemoryMB)},
		{"pausedDiskMB", lim.PausedDiskMB, used.PausedDiskMB, more.PausedDiskMB,
			fmt.Sprintf("Rate limit exceeded: team %s holds %d of its %d MiB of paused sandboxes' disk and this pause needs %d more (quota pausedDiskMB)", t.Name, used.PausedDiskMB, lim.PausedDiskMB, more.PausedDiskMB)},
		{"builds", lim.Builds, used.Builds, more.Builds,
			fmt.Sprintf("Rate limit exceeded: team %s has reached its maximum of %d template builds at once (quota builds)", t.Name, lim.Builds)},
		{"templateDiskMB", lim.TemplateDiskMB, used.TemplateDiskMB, more.TemplateDiskMB,
			fmt.Sprintf("Rate limit exceeded: team %s holds %d of its %d MiB of templates' disk and this one needs %d more (quota templateDiskMB)", t.Name, used.TemplateDiskMB, lim.TemplateDiskMB, more.TemplateDiskMB)},
	} {
		if err := check(c.name, c.limit, c.have, c.want, c.msg); err != nil {
			return err
		}
	}
	return nil
}
