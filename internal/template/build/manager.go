// Package build builds templates: from a rootfs source (a Debian suite, an image, an archive:
// BuildTemplate) and from steps (E2B's template build flow: RequestBuild, StartBuild, GetBuild),
// with the build records, the uploaded COPY files, the import directory and the node's built-in
// templates. A build boots its sandboxes on the node's sandbox Manager through a narrow Host
// (sandbox.BuildHost) and ends the same way on both paths: the template in the store, then
// Host.TemplateBuilt (pools refreshed, EventTemplateReady).
package build

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"maps"
	"path/filepath"
	"regexp"
	"time"

	"github.com/ember-sandbox/ember/internal/datadir"
	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// The sandbox records a build reads and writes.
type (
	Template     = sandbox.Template
	TemplateTag  = sandbox.TemplateTag
	BuildRequest = sandbox.BuildRequest
	RootFSInfo   = sandbox.RootFSInfo
	RegistryAuth = sandbox.RegistryAuth
)

// TemplateFormat is the format of the templates a build writes.
const TemplateFormat = sandbox.TemplateFormat

// Host is what builds need of the node's sandbox Manager (sandbox.BuildHost implements it).
type Host interface {
	// LaunchBuildSandbox boots a build sandbox through the Manager's launch path.
	LaunchBuildSandbox(ctx context.Context, spec sandbox.BuildSandboxSpec) (*sandbox.BuildSandbox, error)
	// TemplateBuilt publishes a template written to the store (pools, listeners).
	TemplateBuilt(tpl *Template)
	// Op registers a build in flight with the Manager (its Close waits for it).
	Op(ctx context.Context) (context.Context, func(), error)
	// ReserveName keeps a template name for one build or snapshot at a time.
	ReserveName(name string, existingOK bool) (release func(), err error)
	// BuildStarted holds layer collections off until ended; CollectLayers runs one.
	BuildStarted() (ended func())
	CollectLayers(ctx context.Context, why string)
	// CheckStack refuses a stack of directories that are not ember's layers.
	CheckStack(top string, lowers []string) error
	GetTemplate(ctx context.Context, id string) (*Template, error)
	// TemplateResources applies the node's defaults to t's resources.
	TemplateResources(t *Template) (cpu, memoryMB, diskMB int)
	Observe(stage sandbox.Stage, start time.Time, err error)
}

var _ Host = sandbox.BuildHost{}

// Config of a build Manager.
type Config struct {
	DataDir string
	Driver  runtime.Driver
	Store   sandbox.Store
	Builder sandbox.RootFSBuilder
	Logger  *slog.Logger
	// MaxBuilds caps concurrent template builds (default 2).
	MaxBuilds int
	// MaxImportBytes bounds an uploaded image archive (default DefaultMaxImportBytes).
	MaxImportBytes int64
	// MaxBuildFileBytes bounds one uploaded COPY tarball of a step build (default
	// DefaultMaxBuildFileBytes).
	MaxBuildFileBytes int64
	// Builtins are the templates this node builds itself when first asked for (builtin.go).
	Builtins map[string]BuiltinTemplate
}

// Manager runs this node's template builds.
type Manager struct {
	cfg     Config
	host    Host
	log     *slog.Logger
	builds  chan struct{} // one token per concurrent template build
	tb      *builds       // records of step builds (builds.go)
	builtin builtinRuns   // built-in templates being built (builtin.go)
	// bg is the context of the builds nobody waits for (built-in templates).
	bg       context.Context
	cancelBG context.CancelFunc
}

// New opens the build records in the data directory. A build that a restart interrupted is
// recorded as failed.
func New(cfg Config, host Host) (*Manager, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.MaxBuilds == 0 {
		cfg.MaxBuilds = 2
	}
	if cfg.MaxBuildFileBytes == 0 {
		cfg.MaxBuildFileBytes = DefaultMaxBuildFileBytes
	}
	m := &Manager{cfg: cfg, host: host, log: cfg.Logger, builds: make(chan struct{}, cfg.MaxBuilds)}
	tb, err := openBuilds(datadir.Builds(cfg.DataDir), m.log.Warn)
	if err != nil {
		return nil, fmt.Errorf("build records: %w", err)
	}
	m.tb = tb
	m.bg, m.cancelBG = context.WithCancel(context.Background())
	return m, nil
}

// Close cancels the built-in template builds nobody waits for any more.
func (m *Manager) Close() { m.cancelBG() }

func (m *Manager) op(ctx context.Context) (context.Context, func(), error) { return m.host.Op(ctx) }

func (m *Manager) reserveName(name string, existingOK bool) (func(), error) {
	return m.host.ReserveName(name, existingOK)
}

func (m *Manager) buildStarted() (ended func())                  { return m.host.BuildStarted() }
func (m *Manager) collectLayers(ctx context.Context, why string) { m.host.CollectLayers(ctx, why) }
func (m *Manager) checkStack(top string, lowers []string) error {
	return m.host.CheckStack(top, lowers)
}
func (m *Manager) observe(st sandbox.Stage, t time.Time, err error) { m.host.Observe(st, t, err) }

// publish ends both build paths: the built template in the store, then the pools refreshed on
// it and EventTemplateReady (Host.TemplateBuilt).
func (m *Manager) publish(ctx context.Context, tpl *Template) error {
	if err := m.cfg.Store.PutTemplate(ctx, tpl); err != nil {
		return err
	}
	m.host.TemplateBuilt(tpl)
	return nil
}

// GetTemplate returns a template or snapshot by id or name.
func (m *Manager) GetTemplate(ctx context.Context, id string) (*Template, error) {
	return m.host.GetTemplate(ctx, id)
}

// launch boots a build sandbox of kind ('t' a warm-up, 'b' a step build's).
func (m *Manager) launch(ctx context.Context, spec sandbox.BuildSandboxSpec) (*sandbox.BuildSandbox, error) {
	return m.host.LaunchBuildSandbox(ctx, spec)
}

func (m *Manager) templateDir(name string) string {
	return filepath.Join(datadir.Templates(m.cfg.DataDir), name)
}

var nameRe = regexp.MustCompile(`^[a-z0-9][a-z0-9_.-]{0,62}$`)

func randomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b) // never fails (Go 1.24)
	return hex.EncodeToString(b)
}

func copyMap(in map[string]string) map[string]string { return maps.Clone(in) }
