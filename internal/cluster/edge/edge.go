// Package edge is the cluster side of ember's HTTP edge: where a request for a sandbox of
// another node goes (forwarding, with one fresh look-up and one retry on a stale route),
// placement of creates (retried on the next node when one refuses), relocation and adoption
// of stored paused sandboxes, forks across nodes, the signed-URL fan-out, the node proofs on
// every request between nodes, and the answer without quorum.
//
// internal/api decides a request's target once (Target) and either serves it or hands it to
// Edge.Serve; the edge serves what stays on this node through Local, which api implements. It
// must not import internal/api. Errors cross nodes through errdefs.WriteHTTP / FromHTTP.
package edge

import (
	"context"
	"log/slog"
	"net"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/ember-sandbox/ember/internal/admission"
	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// Cluster is what the edge consults (*cluster.Cluster).
type Cluster interface {
	NodeID() string
	Locate(ctx context.Context, id string, fresh bool) (cluster.Location, error)
	Place(ctx context.Context, req cluster.PlaceRequest) (*cluster.Reservation, error)
	// Room is how many sandboxes of a template the live nodes have room for, as this node's
	// view of the cluster has it (no etcd read): the admission queue asks it.
	Room(templateID string) int
	Cancel(ctx context.Context, r *cluster.Reservation)
	HasReservation(ctx context.Context, id string) bool
	Live() []cluster.NodeInfo
	Nodes() []cluster.NodeView
	Node(id string) (cluster.NodeView, error)
	Drain(ctx context.Context, id string, on bool) error
	LostSandboxes(ctx context.Context) ([]cluster.LostSandbox, error)
	// Secret signs the requests between nodes (auth.go).
	Secret() []byte
	// Available is nil while the cluster store can commit; else why not (ErrUnavailable).
	Available() error
}

// PausedMover moves stored paused sandboxes to this node (*cluster.Moves).
type PausedMover interface {
	// Adopt makes stored sandbox id this node's (loaded from the image store, paused here).
	Adopt(ctx context.Context, id string) error
	// Unheld returns the stored paused sandboxes whose node is gone (of ids, or all).
	Unheld(ctx context.Context, ids ...string) ([]sandbox.Sandbox, error)
	// Forget ends stored sandbox id of a gone node without moving it (ErrConflict: it is not).
	Forget(ctx context.Context, id string) error
}

// Forker forks across nodes (*sandbox.Manager).
type Forker interface {
	ExportFork(ctx context.Context, id string) (*sandbox.PortableFork, error)
	// ForkFrom restores count children of pf here, child i consuming reservations[i].
	ForkFrom(ctx context.Context, pf *sandbox.PortableFork, count int, timeout time.Duration, reservations []string) ([]sandbox.ForkResult, error)
	DeleteStored(ctx context.Context, imageID string)
}

// Local is this node's API: what the edge serves here, and the answers in the API's format.
type Local interface {
	// WriteError writes err as the API's error answer.
	WriteError(w http.ResponseWriter, r *http.Request, err error)
	// ServeControl serves an authenticated control request here.
	ServeControl(w http.ResponseWriter, r *http.Request)
	// ServeForwarded serves a control request another node sent (its node proof checked: the
	// sending edge authenticated the client).
	ServeForwarded(w http.ResponseWriter, r *http.Request)
	// ServeSandbox serves a sandbox-plane request for a sandbox of this node (port "" = envd).
	ServeSandbox(w http.ResponseWriter, r *http.Request, id, port string)
	// WriteLost answers for a sandbox lost with its node: the control plane's 404, the
	// sandbox plane's "not running".
	WriteLost(w http.ResponseWriter, r *http.Request, id string, gone *sandbox.GoneError, sandboxPlane bool)
	// WriteStored answers GET /sandboxes/{id} for a stored paused sandbox no node holds.
	WriteStored(w http.ResponseWriter, r *http.Request, sb *sandbox.Sandbox)
	// Holds reports whether this node holds sandbox id.
	Holds(ctx context.Context, id string) bool
	// SignedOwner returns the id of this node's sandbox whose access token made q's
	// signature, or "".
	SignedOwner(ctx context.Context, q SignedQuery) (string, error)
	// SandboxJSON is a sandbox as a create or a fork answers it.
	SandboxJSON(sb *sandbox.Sandbox) any
	// MaxBodyBytes bounds the control bodies the edge reads.
	MaxBodyBytes() int64
}

// Config configures an Edge.
type Config struct {
	Cluster Cluster
	Local   Local
	// Mover, when set, moves stored paused sandboxes of gone or draining nodes.
	Mover PausedMover
	// Forker, when set, places the children of a fork on other nodes.
	Forker Forker
	Logger *slog.Logger
	// MaxQueued bounds the creates waiting for room in a full cluster (0 = 1000).
	MaxQueued int
}

// Edge is one node's edge of the cluster.
type Edge struct {
	cl        Cluster
	local     Local
	mover     PausedMover
	forker    Forker
	log       *slog.Logger
	transport *http.Transport
	fanout    fanoutLimit
	// queue holds the creates waiting for room in a full cluster; placing counts those of
	// them placing now (place.go).
	queue   *admission.Queue
	placing atomic.Int32
}

// New returns the edge of cfg.Cluster.
func New(cfg Config) *Edge {
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	return &Edge{cl: cfg.Cluster, local: cfg.Local, mover: cfg.Mover, forker: cfg.Forker, log: log,
		queue: admission.New(admission.Options{MaxWaiters: cfg.MaxQueued, Poll: 250 * time.Millisecond}),
		transport: &http.Transport{
			DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
			MaxIdleConnsPerHost: 64,
			IdleConnTimeout:     90 * time.Second,
		}}
}

// Cluster is the cluster this edge consults.
func (e *Edge) Cluster() Cluster { return e.cl }

// Kind is what a request is for, as api decided it.
type Kind int

const (
	// Other is a request the edge leaves to this node (templates, keys, health...).
	Other Kind = iota
	// SandboxPlane is a request for a sandbox's envd or guest port.
	SandboxPlane
	// SandboxControl is a control request under /sandboxes/{id}.
	SandboxControl
	// Create is POST /sandboxes.
	Create
	// List is GET /sandboxes (the caller gathers the nodes' pages: ListOthers).
	List
)

// Target is where api says a request goes.
type Target struct {
	Kind Kind
	// ID is the sandbox (SandboxPlane, SandboxControl).
	ID string
	// Port is the guest port of a sandbox-plane request ("" = envd's).
	Port string
	// TemplateID is a create's template ("" or invalid: not placeable, served here).
	TemplateID string
	// Body is a create's body, already read.
	Body []byte
	// CreateHere creates the sandbox on this node, consuming reservation ("" = none), and
	// returns the answer's JSON body.
	CreateHere func(ctx context.Context, reservation string) ([]byte, error)
}
