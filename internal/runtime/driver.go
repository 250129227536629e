// Package runtime defines the Driver interface: the one seam between ember's sandbox lifecycle
// (internal/sandbox) and the isolation technology that runs a sandbox. gvisor/ implements it with
// runsc; a Firecracker driver for KVM hosts will implement the same interface and pass the same
// conformance suite (drivertest/). This package owns no state and must not import internal/sandbox.
package runtime

import (
	"context"
	"time"
)

// Spec describes one sandbox instance for the driver.
type Spec struct {
	// ID is the runtime's id for the instance. Fixed length (runsc matches ids by prefix).
	ID string
	// RootFS is the template's root filesystem directory. It is shared by every sandbox of the
	// template and is never written: each instance writes to its own layer.
	RootFS string
	// StateDir is a directory private to this instance (bundle, logs, upper layer). The driver
	// may create files under it; the caller removes it after Delete.
	StateDir string
	// NetNSPath is the network namespace the instance joins (e.g. /var/run/netns/ember-0001).
	// Empty means a namespace of its own with loopback only.
	NetNSPath string
	// Hostname inside the sandbox.
	Hostname string
	// Args and Env of the init process (envd), and its working directory.
	Args []string
	Env  []string
	Cwd  string
	// ConsumeImage tells Restore that the image is not used again (resume of a paused sandbox):
	// the driver may move its contents instead of copying them.
	ConsumeImage bool
	// Resource limits; zero means the driver's default.
	CPUCount int
	MemoryMB int
}

// State of an instance as the driver sees it.
type State string

const (
	StateRunning State = "running"
	StateStopped State = "stopped"
	// StateUnknown: the driver has no instance of that id (wraps errdefs.ErrNotFound from State).
	StateUnknown State = "unknown"
)

// Status is what State returns.
type Status struct {
	State State
	// Pid of the instance's host-side process (the runsc sandbox process), 0 if none.
	Pid int
}

// Stats are resource usage figures of a running instance.
type Stats struct {
	CPUUsage    time.Duration // cumulative CPU time
	MemoryBytes uint64        // current memory use
	MemoryLimit uint64        // 0 when not limited
	Timestamp   time.Time
}

// CheckpointOptions tune Checkpoint.
type CheckpointOptions struct {
	// LeaveRunning keeps the instance running after the image is written (fork, snapshot).
	// Without it the instance stops (pause).
	LeaveRunning bool
}

// Driver runs sandboxes. Every method is safe for concurrent use on different ids.
// Errors wrap errdefs categories: ErrNotFound for an unknown id, ErrConflict for a wrong state.
type Driver interface {
	// Name is the driver's name ("gvisor").
	Name() string
	// Start creates and starts an instance from spec (a cold boot).
	Start(ctx context.Context, spec Spec) error
	// Checkpoint writes the instance's full state (memory and its writable layer) into imageDir,
	// which must exist and be empty. Without LeaveRunning the instance's processes are gone when
	// it returns and it stays "stopped" until Delete; Start or Restore under the same id replace
	// a stopped instance.
	Checkpoint(ctx context.Context, id, imageDir string, opts CheckpointOptions) error
	// Restore starts a new instance described by spec from an image written by Checkpoint.
	// spec.ID, StateDir, NetNSPath, Hostname, Env and limits may differ from the checkpointed
	// instance's; Args and Cwd must not. One image may be restored into many instances at once.
	Restore(ctx context.Context, spec Spec, imageDir string) error
	// State reports whether the instance runs.
	State(ctx context.Context, id string) (Status, error)
	// Stats reports resource usage.
	Stats(ctx context.Context, id string) (Stats, error)
	// Kill stops every process of the instance. Killing a stopped instance is not an error.
	Kill(ctx context.Context, id string) error
	// Delete removes the instance's runtime state; it kills it first if needed. Idempotent:
	// deleting an unknown id returns nil.
	Delete(ctx context.Context, id string) error
	// List returns the ids of every instance the driver knows, for reconciliation at start-up.
	List(ctx context.Context) ([]string, error)
	// Exec runs a command inside a running instance out of band (not through envd) and returns
	// its combined output and exit code. For diagnostics, tests and template builds. Processes
	// it leaves in the background may not survive Restore (gVisor kills them): long-lived
	// processes belong to the init process (envd).
	Exec(ctx context.Context, id string, args []string) (output []byte, exitCode int, err error)
}
