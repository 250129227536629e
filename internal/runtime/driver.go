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
	// RootFS is the template's root filesystem directory: its top (or only) layer. With Lowers,
	// the root filesystem is the stack RootFS, Lowers[0], Lowers[1], ... (top first), merged as
	// overlayfs merges lower layers: an entry of a higher layer hides the same path below, an
	// overlay whiteout (a 0:0 character device) hides it without replacing it, and a directory
	// with the xattr trusted.overlay.opaque=y hides everything below it. Every layer is shared
	// by the sandboxes of the template (and by other templates) and is never written: each
	// instance writes to its own layer.
	RootFS string
	Lowers []string
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
	// LayerFrom, for Start, names an image directory written by Checkpoint with FilesOnly (or
	// any checkpoint image): the instance boots on that image's writable layer instead of an
	// empty one (a filesystem-only resume: new boot, same files). With ConsumeImage the layer
	// is moved out of the image, else cloned.
	LayerFrom string
	// ConsumeImage tells Restore that the image is not used again (resume of a paused sandbox):
	// the driver may move its contents instead of copying them. Until the caller removes the
	// image directory (once the resume is recorded), deleting the instance gives the moved
	// contents back to the image, so a resume that fails or is cut by a crash loses nothing.
	ConsumeImage bool
	// Resource limits; zero means the driver's default.
	CPUCount int
	MemoryMB int
	// DiskMB bounds the instance's writable layer (writes past it fail with ENOSPC inside the
	// sandbox); 0 = unlimited.
	DiskMB int
	// PidsLimit bounds the number of tasks in the sandbox; 0 = the driver's default.
	PidsLimit int
	// Binds are host directories mounted read-write into the instance (volumes). A checkpoint
	// of an instance with binds restores only with the same binds.
	Binds []Bind
}

// Bind is a host directory mounted read-write at Path inside the instance.
type Bind struct {
	Source string // absolute host path
	Path   string // absolute path inside the instance
	// Remote: Source is a filesystem shared with other hosts whose open files keep what they
	// read (s3fs: a cluster's volumes), so the runtime holds no host file open beyond the
	// guest's own opens: a guest open sees what other hosts closed before.
	Remote bool
}

// Stack is the root filesystem's read-only layers, top first: RootFS, then Lowers.
func (s Spec) Stack() []string {
	return append([]string{s.RootFS}, s.Lowers...)
}

// ExitReason says why an instance stopped on its own (Driver.Wait).
type ExitReason string

const (
	// ExitExited: the init process (envd) exited by itself.
	ExitExited ExitReason = "exited"
	// ExitOOM: the instance exceeded its memory limit and was stopped.
	ExitOOM ExitReason = "out of memory"
	// ExitKilled: the instance's processes were killed from outside (a signal to the runtime's
	// host processes), or it was stopped by Kill, Delete or Checkpoint.
	ExitKilled ExitReason = "killed"
)

// Exit is what Wait reports.
type Exit struct {
	Reason ExitReason
	// Code is the init process's exit status when known, else -1.
	Code int
	// At is when the driver noticed the exit.
	At time.Time
	// Detail is a short human-readable explanation ("" when there is none).
	Detail string
}

// ImportOptions bound what ImportImage accepts from an untrusted source.
type ImportOptions struct {
	// MaxBytes bounds the bytes the unpacked image may occupy (data of regular files, sparse
	// holes excluded); 0 = no bound.
	MaxBytes int64
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
	// Frozen: the instance is StateRunning but frozen in place (Freeze): its processes, memory
	// and files are kept and none of its tasks runs until Thaw.
	Frozen bool
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
	// FilesOnly keeps the instance's writable layer but not its memory: the instance is stopped
	// and its layer moved into imageDir; no memory image is written (a filesystem-only pause;
	// resume with Start and Spec.LayerFrom). Not combined with LeaveRunning.
	FilesOnly bool
	// DeferLayer (without LeaveRunning or FilesOnly) returns as soon as the memory image is
	// written: the instance is killed but not waited for, and its writable layer stays where it
	// is, owed to imageDir, until Delete (or, after a crash, Release of its state dir) has waited
	// for the instance's processes and moved the layer into imageDir. Until then imageDir holds
	// no layer and must not be restored; a crash in between loses nothing (issue 11 lever 3).
	DeferLayer bool
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
	// instance's; Args, Cwd and the rootfs stack (RootFS, Lowers) must not (another stack is
	// ErrInvalid). One image may be restored into many instances at once.
	Restore(ctx context.Context, spec Spec, imageDir string) error
	// State reports whether the instance runs.
	State(ctx context.Context, id string) (Status, error)
	// Stats reports resource usage.
	Stats(ctx context.Context, id string) (Stats, error)
	// Freeze stops every task of a running instance in place: nothing of it runs (no CPU used)
	// and everything is kept — processes, memory, files, network namespace, host processes — so
	// that Thaw continues it where it stopped. State then reports it running with Frozen, also to
	// a later process of the daemon (reconcile after a restart). A frozen instance can be
	// Checkpointed (with LeaveRunning it stays frozen; without, it stops as a running one does),
	// Killed and Deleted; Exec into it is ErrConflict. Freezing a frozen instance does nothing;
	// a stopped one is ErrConflict.
	Freeze(ctx context.Context, id string) error
	// Thaw continues a frozen instance: its processes run again from where they stopped. Thawing
	// a running instance that is not frozen does nothing; a stopped one is ErrConflict.
	Thaw(ctx context.Context, id string) error
	// Delete removes the instance's runtime state; it kills it first if needed. Idempotent:
	// deleting an unknown id returns nil.
	Delete(ctx context.Context, id string) error
	// List returns the ids of every instance the driver knows, for reconciliation at start-up.
	List(ctx context.Context) ([]string, error)
	// Sweep stops and deletes every instance of this driver's that is not in keep, including
	// launches another process (an earlier daemon that died) left in flight, so that nothing
	// can come up afterwards under a directory reconciliation then removes. It returns the ids
	// it removed.
	Sweep(ctx context.Context, keep []string) ([]string, error)
	// Release releases what an instance state directory (Spec.StateDir) still holds once no
	// instance runs there — mounts, and a layer taken from an image with ConsumeImage, which
	// goes back to that image — so that the caller may remove the directory. Idempotent; a
	// directory that holds nothing is fine.
	Release(ctx context.Context, stateDir string) error
	// Wait blocks until the instance stops, or ctx is done (then it returns ctx's error), and
	// reports why. It works for instances started by an earlier process of the daemon (adopted
	// after a restart) as well. An unknown or already stopped instance returns at once: unknown
	// (never started, or deleted) with an error wrapping errdefs.ErrNotFound, stopped with the
	// reason the driver can still tell. Any number of concurrent Waits is cheap.
	Wait(ctx context.Context, id string) (Exit, error)
	// ExportImage writes the image in imageDir (written by Checkpoint) into dstDir (existing,
	// empty) as a flat set of regular files, for a content-addressed store to keep. The image
	// format is the driver's own; imageDir is left unchanged. While it runs it may keep entries
	// named ".*" (mounts among them) in dstDir's parent, which a crash can leave behind: clean
	// them up with the export's leftovers, unmounting what is mounted beneath them.
	ExportImage(ctx context.Context, imageDir, dstDir string) error
	// ImportImage turns the files ExportImage wrote (srcDir; untrusted: they may come from a
	// shared bucket) back into an image directory at imageDir (must not exist). It never writes
	// outside imageDir, never follows a symlink while writing, creates no device nodes (overlay
	// whiteouts excepted), and refuses input over opts.MaxBytes. On error imageDir is absent.
	ImportImage(ctx context.Context, srcDir, imageDir string, opts ImportOptions) error
}

// Prober is what the conformance suite (drivertest), the driver's own tests and diagnostics
// use beyond Driver: out-of-band commands and a kill. The Manager never calls them (its
// commands go through envd; an instance ends by Delete).
type Prober interface {
	// Kill stops every process of the instance (frozen or not). Killing a stopped instance is
	// not an error.
	Kill(ctx context.Context, id string) error
	// Exec runs a command inside a running (not frozen) instance out of band (not through envd) and returns
	// its combined output and exit code. For diagnostics and tests. Processes
	// it leaves in the background may not survive Restore (gVisor kills them): long-lived
	// processes belong to the init process (envd).
	Exec(ctx context.Context, id string, args []string) (output []byte, exitCode int, err error)
}

// UpperDirer is implemented by drivers whose filesystem-only checkpoints (CheckpointOptions
// FilesOnly) keep the instance's writable layer as an overlayfs upper directory on the host:
// whiteouts as 0:0 character devices, opaque directories marked trusted.overlay.opaque. The
// template builder turns that directory into a layer of the template it builds.
type UpperDirer interface {
	// UpperDir returns the upper directory inside imageDir (a disk-limited layer made a plain
	// directory first), or an error wrapping errdefs.ErrNotFound when the image holds none.
	UpperDir(imageDir string) (string, error)
}
