package gvisor

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
	"gvisor.dev/gvisor/pkg/control/client"
	"gvisor.dev/gvisor/pkg/sentry/state/checkpointfiles"
	"gvisor.dev/gvisor/pkg/state/statefile"
	"gvisor.dev/gvisor/pkg/urpc"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// The control socket (issue 18 item 4). Every runsc subcommand that acts on a running sandbox
// (pause, resume, checkpoint, ...) loads the container's state file under --root, connects to
// the sandbox's control socket (<root>/runsc-<id>.sock, recorded in the state file) and calls
// one method of the sentry's containerManager over gVisor's uRPC; the ~15-20 ms of CPU before
// that call is the runsc binary starting. The driver makes the same calls itself, with gVisor's
// own client (pkg/control/client, pkg/urpc) at the version runsc is built from, so that freeze,
// thaw and checkpoint start no process. Config.RunscCLI selects the CLI instead (benchmarks
// compare the two in one run).
//
// Where runsc records a change in its state file (pause and resume set the container's status),
// the driver does the same, the way runsc's container package does it: under the container's
// lock file (<root>/<id>_sandbox:<id>.lock, flock), the state file read, the call made, then the
// status written. runsc's own later commands (checkpoint, kill, delete, state) and a later
// daemon's reconcile therefore see "paused" exactly when the sentry is paused.
//
// A restore into a pre-started instance stays on the CLI (RestoreInto says why).

// Method names of the sentry's containerManager (runsc/boot/controller.go). runsc/boot itself is
// not imported: it links the whole sentry into the daemon.
const (
	ctlPause      = "containerManager.Pause"
	ctlResume     = "containerManager.Resume"
	ctlCheckpoint = "containerManager.Checkpoint"
)

// saveOpts is the argument of containerManager.Checkpoint (pkg/sentry/control SaveOpts; uRPC
// encodes it as JSON and passes FilePayload's files as SCM_RIGHTS). Mirrored rather than
// imported: pkg/sentry/control links the sentry. The conformance suite's checkpoints against the
// runsc built from the same gVisor version exercise every field the driver sets.
type saveOpts struct {
	Key                            []byte            `json:"key"`
	Metadata                       map[string]string `json:"metadata"`
	AppMFExcludeCommittedZeroPages bool              `json:"app_mf_exclude_committed_zero_pages"`
	HavePagesFile                  bool              `json:"have_pages_file"`
	urpc.FilePayload
	Resume                   bool
	ExecOpts                 saveRestoreExecOpts
	UseCheckpointGofer       bool   `json:"use_checkpoint_gofer"`
	CudaCheckpointPath       string `json:"cuda_checkpoint_path"`
	CudaCheckpointSequential bool   `json:"cuda_checkpoint_sequential"`
}

// saveRestoreExecOpts is pkg/sentry/control SaveRestoreExecOpts.
type saveRestoreExecOpts struct {
	Argv        string
	Timeout     time.Duration
	ContainerID string
}

// ctlCall calls method on instance id's control socket (path: "" reads it from the state file).
// A call cut short by ctx closes the connection; what the sentry already started goes on.
func (d *Driver) ctlCall(ctx context.Context, id, path, method string, arg, result any) error {
	if path == "" {
		var err error
		if path, err = d.controlSocket(id); err != nil {
			return err
		}
	}
	// Paths longer than a sockaddr_un holds are reached through an O_PATH descriptor, as runsc
	// does itself.
	if len(path) >= len(unix.RawSockaddrUnix{}.Path) {
		fd, err := unix.Open(path, unix.O_PATH|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("gvisor: %s %s: control socket: %v: %w", method, id, err, errdefs.ErrConflict)
		}
		defer unix.Close(fd)
		path = "/proc/self/fd/" + strconv.Itoa(fd)
	}
	conn, err := client.ConnectTo(path)
	if err != nil {
		return fmt.Errorf("gvisor: %s %s: connect to its control socket: %v: %w", method, id, err, errdefs.ErrConflict)
	}
	defer conn.Close()
	done := make(chan error, 1)
	go func() { done <- conn.Call(method, arg, result) }()
	select {
	case err = <-done:
	case <-ctx.Done():
		conn.Close() // unblocks the call
		<-done
		err = ctx.Err()
	}
	if err != nil {
		return fmt.Errorf("gvisor: %s %s: %w", method, id, err)
	}
	return nil
}

// runscState is what the driver reads of runsc's state file of a root container.
type runscState struct {
	raw    map[string]json.RawMessage
	Status string
	Pid    int
	Socket string
}

const (
	statusRunning = "running"
	statusPaused  = "paused"
	statusCreated = "created"
)

func (d *Driver) statePath(id string) string {
	return filepath.Join(d.cfg.Root, id+"_sandbox:"+id+".state")
}

// readState reads runsc's state file of id (ErrNotFound when there is none).
func (d *Driver) readState(id string) (*runscState, error) {
	b, err := os.ReadFile(d.statePath(id))
	if err != nil {
		return nil, fmt.Errorf("gvisor: instance %s: %v: %w", id, err, errdefs.ErrNotFound)
	}
	st := &runscState{}
	if err := json.Unmarshal(b, &st.raw); err != nil {
		return nil, fmt.Errorf("gvisor: instance %s: state file: %w", id, err)
	}
	var f struct {
		ID      string `json:"id"`
		Status  string `json:"status"`
		Sandbox struct {
			Pid               int    `json:"pid"`
			ControlSocketPath string `json:"controlSocketPath"`
		} `json:"sandbox"`
	}
	if err := json.Unmarshal(b, &f); err != nil {
		return nil, fmt.Errorf("gvisor: instance %s: state file: %w", id, err)
	}
	if f.ID != id {
		return nil, fmt.Errorf("gvisor: instance %s: state file names %q: %w", id, f.ID, errdefs.ErrNotFound)
	}
	st.Status, st.Pid, st.Socket = f.Status, f.Sandbox.Pid, f.Sandbox.ControlSocketPath
	return st, nil
}

// writeStatus records status in id's state file, everything else as it was. Call it holding the
// container's lock (lockState). The file is replaced by a rename, so a reader without the lock
// (the driver's own) never sees it half written, nor does a crash leave it so.
func (d *Driver) writeStatus(id string, st *runscState, status string) error {
	v, err := json.Marshal(status)
	if err != nil {
		return err
	}
	st.raw["status"] = v
	b, err := json.Marshal(st.raw)
	if err != nil {
		return fmt.Errorf("gvisor: instance %s: state file: %w", id, err)
	}
	// Not matched by runsc's *_sandbox:*.state glob.
	tmp := d.statePath(id) + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return fmt.Errorf("gvisor: instance %s: state file: %w", id, err)
	}
	if err := os.Rename(tmp, d.statePath(id)); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("gvisor: instance %s: state file: %w", id, err)
	}
	st.Status = status
	return nil
}

// lockState takes runsc's lock of container id (flock of <root>/<id>_sandbox:<id>.lock, as
// runsc's container package takes it) and returns its release. It waits for the lock while ctx
// allows: runsc holds it for the length of one command.
func (d *Driver) lockState(ctx context.Context, id string) (unlock func(), err error) {
	p := filepath.Join(d.cfg.Root, id+"_sandbox:"+id+".lock")
	// Never created here: runsc creates it with the container and removes it with it.
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("gvisor: instance %s: lock: %v: %w", id, err, errdefs.ErrNotFound)
	}
	for delay := 100 * time.Microsecond; ; delay = min(2*delay, 10*time.Millisecond) {
		err = unix.Flock(fd, unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return func() { unix.Flock(fd, unix.LOCK_UN); unix.Close(fd) }, nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) && !errors.Is(err, unix.EINTR) {
			unix.Close(fd)
			return nil, fmt.Errorf("gvisor: instance %s: lock: %w", id, err)
		}
		select {
		case <-ctx.Done():
			unix.Close(fd)
			return nil, fmt.Errorf("gvisor: instance %s: lock: %w", id, ctx.Err())
		case <-time.After(delay):
		}
	}
}

// Freeze implements runtime.Driver: containerManager.Pause over the control socket (all tasks
// stopped, waited for) and "paused" in runsc's state file, as `runsc pause` does.
func (d *Driver) Freeze(ctx context.Context, id string) error {
	if err := validateID(id); err != nil {
		return err
	}
	return d.setFrozen(ctx, id, true)
}

// Thaw implements runtime.Driver: containerManager.Resume and "running" in runsc's state file,
// as `runsc resume` does.
func (d *Driver) Thaw(ctx context.Context, id string) error {
	if err := validateID(id); err != nil {
		return err
	}
	return d.setFrozen(ctx, id, false)
}

func (d *Driver) setFrozen(ctx context.Context, id string, freeze bool) error {
	op, method, from, to := "thaw", ctlResume, statusPaused, statusRunning
	if freeze {
		op, method, from, to = "freeze", ctlPause, statusRunning, statusPaused
	}
	if d.cfg.RunscCLI {
		st, err := d.readState(id)
		if err != nil {
			return err
		}
		if st.Status == to && alive(st.Pid) {
			return nil
		}
		cmd := "resume"
		if freeze {
			cmd = "pause"
		}
		if _, err := d.run(ctx, d.logDir(id), cmd, id); err != nil {
			return d.explain(ctx, id, err)
		}
		return nil
	}
	unlock, err := d.lockState(ctx, id)
	if err != nil {
		return err
	}
	defer unlock()
	st, err := d.readState(id)
	if err != nil {
		return err
	}
	switch {
	case !alive(st.Pid):
		return fmt.Errorf("gvisor: %s %s: not running: %w", op, id, errdefs.ErrConflict)
	case st.Status == to:
		return nil
	case st.Status != from:
		return fmt.Errorf("gvisor: %s %s: instance is %s: %w", op, id, st.Status, errdefs.ErrConflict)
	}
	// Not cut short by ctx: a pause or resume the sentry carried out must reach the state file,
	// or runsc's status and the sentry's would disagree. Both are quick (the pause waits for the
	// tasks to stop, a syscall's length at most).
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	// A crash of the daemon between the call and the state file's write would leave the two
	// disagreeing, and the sentry's pauses nest (a second Pause needs two Resumes; a Resume of a
	// running sentry panics it): the intent file says the status is in doubt until then
	// (resolveIntent).
	intent := d.intentPath(id)
	if err := os.WriteFile(intent, []byte(op), 0o600); err != nil {
		return fmt.Errorf("gvisor: %s %s: %w", op, id, err)
	}
	if err := d.ctlCall(cctx, id, st.Socket, method, nil, nil); err != nil {
		os.Remove(intent)
		return err
	}
	if err := d.writeStatus(id, st, to); err != nil {
		return err
	}
	return os.Remove(intent)
}

// intentPath marks a freeze or thaw in flight (setFrozen).
func (d *Driver) intentPath(id string) string {
	return filepath.Join(d.cfg.Root, id+"_sandbox:"+id+".ember-intent")
}

// intentProbe bounds the probe of resolveIntent: a process that does not finish within it is
// taken as frozen. Generous: `runsc exec` of /bin/true takes about 0.1 s, but seconds on a
// loaded host, and a running sentry taken as frozen would be resumed once too often.
const intentProbe = 10 * time.Second

// resolveIntent settles the status of id after a freeze or thaw that a crash of an earlier
// daemon cut between the sentry's call and runsc's state file: a process started in the sandbox
// tells whether its tasks run (a frozen sentry starts it stopped), and the state file is made to
// say so. A no-op without an intent file.
func (d *Driver) resolveIntent(ctx context.Context, id string) {
	intent := d.intentPath(id)
	if _, err := os.Stat(intent); err != nil {
		return
	}
	unlock, err := d.lockState(ctx, id)
	if err != nil {
		os.Remove(intent) // the instance is gone
		return
	}
	defer unlock()
	st, err := d.readState(id)
	if err != nil || !alive(st.Pid) {
		os.Remove(intent)
		return
	}
	was := st.Status
	if was != statusRunning {
		// runsc refuses to exec into a container its state file says is paused.
		if err := d.writeStatus(id, st, statusRunning); err != nil {
			return
		}
	}
	pctx, cancel := context.WithTimeout(ctx, intentProbe)
	defer cancel()
	full := append(d.globalFlags(""), "exec", id, "/bin/true")
	runs := exec.CommandContext(pctx, d.cfg.Runsc, full...).Run() == nil
	status := statusPaused
	if runs {
		status = statusRunning
	}
	if was != status {
		d.log.Warn("gvisor: a freeze or thaw cut by a crash left runsc's state wrong; fixed", "instance", id, "was", was, "is", status)
	}
	if err := d.writeStatus(id, st, status); err != nil {
		return
	}
	os.Remove(intent)
}

// frozen reports whether id is frozen (runsc's state file says paused).
func (d *Driver) frozen(id string) bool {
	st, err := d.readState(id)
	return err == nil && st.Status == statusPaused && alive(st.Pid)
}

// holdFrozen freezes id for the length of a checkpoint, unless it is frozen already, and returns
// what undoes it (nothing for an instance that was frozen before: it stays frozen).
func (d *Driver) holdFrozen(ctx context.Context, id string) (thaw func(context.Context) error, err error) {
	if d.frozen(id) {
		return func(context.Context) error { return nil }, nil
	}
	if err := d.Freeze(ctx, id); err != nil {
		return nil, err
	}
	return func(ctx context.Context) error { return d.Thaw(ctx, id) }, nil
}

// checkpointImage writes id's memory image into imageDir: containerManager.Checkpoint over the
// control socket, or `runsc checkpoint` with Config.RunscCLI. With leaveRunning the sentry
// continues (a frozen one stays frozen: the save's own pause nests in it); without, it exits.
func (d *Driver) checkpointImage(ctx context.Context, id, imageDir string, leaveRunning bool) error {
	if d.cfg.RunscCLI {
		args := []string{"checkpoint", "--image-path", imageDir, "--compression=" + d.cfg.Compression}
		if leaveRunning {
			args = append(args, "--leave-running")
		}
		if d.cfg.ExcludeZeroPages {
			args = append(args, "--exclude-committed-zero-pages")
		}
		_, err := d.run(ctx, d.logDir(id), append(args, id)...)
		return err
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, 10*time.Minute)
		defer cancel()
	}
	st, err := d.readState(id)
	if err != nil {
		return err
	}
	// runsc checkpoint accepts these states only.
	if (st.Status != statusRunning && st.Status != statusPaused && st.Status != statusCreated) || !alive(st.Pid) {
		return fmt.Errorf("gvisor: checkpoint %s: instance is %s: %w", id, st.Status, errdefs.ErrConflict)
	}
	// The files runsc's checkpoint creates, in the order the sentry expects: the state file,
	// then, uncompressed, the pages' metadata and the pages.
	names := []string{checkpointfiles.StateFileName}
	if statefile.CompressionLevel(d.cfg.Compression) == statefile.CompressionLevelNone {
		names = append(names, checkpointfiles.PagesMetadataFileName, checkpointfiles.PagesFileName)
	}
	opts := saveOpts{
		Metadata:                       statefile.CompressionLevel(d.cfg.Compression).ToMetadata(),
		AppMFExcludeCommittedZeroPages: d.cfg.ExcludeZeroPages,
		HavePagesFile:                  len(names) > 1,
		Resume:                         leaveRunning,
		ExecOpts:                       saveRestoreExecOpts{ContainerID: id},
	}
	defer func() {
		for _, f := range opts.FilePayload.Files {
			f.Close()
		}
	}()
	for _, n := range names {
		f, err := os.OpenFile(filepath.Join(imageDir, n), os.O_CREATE|os.O_EXCL|os.O_RDWR|unix.O_NOFOLLOW, 0o600)
		if err != nil {
			return fmt.Errorf("gvisor: checkpoint %s: %w", id, err)
		}
		opts.FilePayload.Files = append(opts.FilePayload.Files, f)
	}
	if err := d.ctlCall(ctx, id, st.Socket, ctlCheckpoint, &opts, nil); err != nil {
		for _, n := range names {
			os.Remove(filepath.Join(imageDir, n))
		}
		return err
	}
	return nil
}
