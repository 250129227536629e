package sandbox

import (
	"context"
	"net/http"
	"sync"
	"time"
)

// Template builds live in internal/template/build. They reach this node's sandboxes only
// through a BuildHost (the Manager's BuildHost): a build sandbox launched through the one launch
// path and ended by its Close, the name reservations and the layer collection that builds share
// with snapshots and forks, and one call that publishes a built template (pools refreshed,
// EventTemplateReady).

// BuildHost is the part of a Manager that template builds use.
type BuildHost struct{ m *Manager }

// BuildHost returns the Manager's side of template builds (internal/template/build).
func (m *Manager) BuildHost() BuildHost { return BuildHost{m} }

// BuildSandboxSpec says what a build sandbox boots.
type BuildSandboxSpec struct {
	// Kind is the first letter of the instance's throw-away owner id ('t': a template's
	// warm-up, 'b': a step build's sandbox).
	Kind byte
	// Template is the stack booted, with its defaults (its env is envd's).
	Template *Template
	// Token is envd's access token from its first moments.
	Token string
	// Image, when set, is restored (read, not consumed) instead of booting Template's stack:
	// its envd already holds Token. A template build restores its new image once before it
	// publishes it.
	Image string
	// Resources (0: the node's defaults) and egress.
	CPUCount, MemoryMB, DiskMB int
	Internet                   bool
}

// BuildSandbox is a running build sandbox.
type BuildSandbox struct {
	Placement
	// EnvdURL reaches its envd through Client.
	EnvdURL string
	Client  *http.Client
	owner   string
	m       *Manager
	once    sync.Once
}

// LaunchBuildSandbox boots a build sandbox; Close ends it.
func (h BuildHost) LaunchBuildSandbox(ctx context.Context, spec BuildSandboxSpec) (*BuildSandbox, error) {
	m := h.m
	owner := string(spec.Kind) + newID()[1:]
	ident := &Sandbox{ID: owner, AccessToken: spec.Token, EnvVars: spec.Template.Env}
	ls := launchSpec{owner: owner, tpl: spec.Template, init: ident,
		cpu: orDefault(spec.CPUCount, m.cfg.CPUCount), memMB: orDefault(spec.MemoryMB, m.cfg.MemoryMB), diskMB: orDefault(spec.DiskMB, m.cfg.DiskMB)}
	if spec.Internet {
		ls.egress = Egress{AllowInternet: true}
	}
	if spec.Image != "" {
		ls.image, ls.initToken = spec.Image, spec.Token
	}
	p, err := m.launch(ctx, ls)
	if err != nil {
		m.removeSandboxDir(owner)
		return nil, err
	}
	return &BuildSandbox{Placement: p, EnvdURL: envdBase(p.GuestIP), Client: m.client, owner: owner, m: m}, nil
}

// Close tears the build sandbox down and removes its directory (idempotent).
func (b *BuildSandbox) Close(ctx context.Context) {
	b.once.Do(func() {
		b.m.teardownSandbox(ctx, b.owner, b.Placement)
	})
}

// TemplateBuilt publishes a template a build wrote to the store: the pools refresh on it and
// listeners get EventTemplateReady.
func (h BuildHost) TemplateBuilt(tpl *Template) {
	h.m.pool.templateChanged(tpl)
	h.m.prestarts.templateChanged(tpl)
	h.m.templateReady(tpl)
}

// Op registers a build as an operation in flight (Close waits for it, then cancels its ctx).
func (h BuildHost) Op(ctx context.Context) (context.Context, func(), error) { return h.m.op(ctx) }

// ReserveName keeps a template name for one build or snapshot at a time.
func (h BuildHost) ReserveName(name string, existingOK bool) (release func(), err error) {
	return h.m.reserveName(name, existingOK)
}

// BuildStarted holds layer collections off until the build ends (ended).
func (h BuildHost) BuildStarted() (ended func()) { return h.m.buildStarted() }

// CollectLayers removes the layers nothing uses any more.
func (h BuildHost) CollectLayers(ctx context.Context, why string) { h.m.collectLayers(ctx, why) }

// CheckStack refuses a stack of directories that are not ember's layers.
func (h BuildHost) CheckStack(top string, lowers []string) error { return h.m.checkStack(top, lowers) }

// GetTemplate returns a template or snapshot by id or name.
func (h BuildHost) GetTemplate(ctx context.Context, id string) (*Template, error) {
	return h.m.GetTemplate(ctx, id)
}

// TemplateResources returns the vCPUs, memory and disk a sandbox of t gets.
func (h BuildHost) TemplateResources(t *Template) (cpu, memoryMB, diskMB int) {
	return h.m.TemplateResources(t)
}

// Observe reports a stage's duration and outcome to the node's Observer.
func (h BuildHost) Observe(stage Stage, start time.Time, err error) { h.m.observe(stage, start, err) }
