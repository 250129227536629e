// Package sandbox is ember's domain core: the sandbox record and state machine, and the Manager
// that creates, pauses, resumes, snapshots, forks and kills sandboxes by combining a runtime
// Driver, a network slot, the template catalogue and the metadata store. It must not know about
// HTTP or the E2B wire format (internal/api translates).
package sandbox

import (
	"context"
	"net/http"
	"time"
)

// Service is what the API edge needs from the sandbox domain. *Manager implements it; the API's
// unit tests use a fake.
type Service interface {
	Create(ctx context.Context, req CreateRequest) (*Sandbox, error)
	Get(ctx context.Context, id string) (*Sandbox, error)
	List(ctx context.Context, f ListFilter) ([]*Sandbox, error)
	Kill(ctx context.Context, id string) error
	SetTimeout(ctx context.Context, id string, d time.Duration) error
	Pause(ctx context.Context, id string) error
	// PauseWith pauses with options (a filesystem-only pause with KeepMemory false).
	PauseWith(ctx context.Context, id string, opts PauseOptions) error
	// Connect resumes a paused sandbox (resumed=true) or extends a running one's timeout
	// (only ever extends).
	Connect(ctx context.Context, id string, timeout time.Duration) (sbx *Sandbox, resumed bool, err error)
	// ConnectWith is Connect with options (a reboot on the files of a paused sandbox).
	ConnectWith(ctx context.Context, id string, opts ConnectOptions) (sbx *Sandbox, resumed bool, err error)
	Snapshot(ctx context.Context, id, name string) (*Template, error)
	ListSnapshots(ctx context.Context, sandboxID string) ([]*Template, error)
	DeleteTemplate(ctx context.Context, id string) error
	Fork(ctx context.Context, id string, count int, timeout time.Duration) ([]ForkResult, error)
	Metrics(ctx context.Context, id string) ([]Metric, error)
	ListTemplates(ctx context.Context) ([]*Template, error)
	// Pools reports the warm pools (ready instances, targets, demand).
	Pools(ctx context.Context) []PoolState
	// WarmPool keeps at least count restored sandboxes of a template ready (0: demand alone).
	WarmPool(ctx context.Context, templateID string, count int) (PoolState, error)
	// Transport returns a RoundTripper-ready base URL (http://ip:port) to reach a running
	// sandbox's guest port, or an error wrapping ErrNotFound / ErrConflict (not running).
	GuestURL(ctx context.Context, id string, port int) (string, error)
	// GuestTransport is the transport for requests into sandboxes.
	GuestTransport() http.RoundTripper
}

// BuildRequest asks for a template build.
type BuildRequest struct {
	Name     string // template id / alias, e.g. "base"
	Team     string // the team the template belongs to
	From     string // "debian:bookworm" (default), "docker://REF", "docker+http://REF", "archive:NAME" (an import)
	StartCmd string // optional command started before the checkpoint
	ReadyCmd string // optional command that must succeed before the checkpoint
	// StartUser runs the start and ready commands ("" = root).
	StartUser string
	CPUCount  int
	MemoryMB  int

	// FromImage builds from an OCI/Docker image in a registry; FromArchive from a `docker save`
	// or OCI layout tarball in the node's import directory (its name there). Insecure reaches FromImage's registry over plain HTTP.
	FromImage   string
	FromArchive string
	Insecure    bool
	Auth        *RegistryAuth // credentials for FromImage's registry (else ~/.docker/config.json)
}

// RegistryAuth is a registry credential: a username and password, or a token.
type RegistryAuth struct {
	Username, Password, Token string
}
