// Package gvisor is the runtime.Driver that runs each sandbox in its own gVisor sandbox through
// the runsc binary (platform systrap). It owns the runsc state directory (Config.Root), each
// instance's OCI bundle and runsc logs under runtime.Spec.StateDir, and the cgroups runsc makes
// for an instance. It never writes the template rootfs: the instance's writes live in its own
// host overlayfs layer under its StateDir (layers.go, fsdelta.go; mounted nosuid,nodev, in a
// directory only root may enter), which checkpoints carry next to the memory image. It also owns
// the exported image format (image.go) and watches instances for their exit (wait.go).
package gvisor

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

// Config configures the driver. Zero fields take the defaults noted.
type Config struct {
	// Runsc is the runsc binary (default: "runsc" from PATH).
	Runsc string
	// Root is runsc's --root state directory (default /var/run/ember/runsc).
	Root string
	// Platform is runsc's --platform (default "systrap"; there is no KVM here).
	Platform string
	// Overlay is runsc's --overlay2. Default OverlayHost ("none"): each instance runs on a host
	// overlayfs mount with its own upper directory (layers.go), so writes are host files and
	// checkpoints hold memory only. "root:memory": sandbox writes live in sandbox memory,
	// are captured by checkpoints, and the shared rootfs directory is never written).
	Overlay string
	// IgnoreCgroups passes --ignore-cgroups: no host cgroups, so MemoryMB and CPUCount are not
	// enforced (saves a few ms per start).
	IgnoreCgroups bool
	// CgroupParent is the cgroup, relative to the daemon's own, under which each instance gets
	// <CgroupParent>/<id> (default "ember").
	CgroupParent string
	// FailedLogDir keeps the runsc logs of the last 20 failed starts and restores, one
	// directory <instance>-<op>-<time> each (default <dir of Root>/logs/failed: the daemon's
	// <data-dir>/logs/failed).
	FailedLogDir string
	// SandboxLogs makes every start and restore write the sandbox's and gofer's logs (info
	// level) into <StateDir>/logs, kept with a failed launch: about 70 KB an instance and, on
	// 2 busy cores, 8-16 ms a start or restore (BenchmarkLaunchLogs), so off by default.
	SandboxLogs bool
	// Debug adds --debug and per-command debug logs under <StateDir>/logs/.
	Debug bool
	// ExtraFlags are appended to runsc's global flags (e.g. "--net-raw").
	ExtraFlags []string
	// RunscCLI makes Freeze, Thaw and Checkpoint run runsc's CLI (runsc pause, resume,
	// checkpoint: a process each, ~15-20 ms of CPU) instead of calling the sandbox's control
	// socket (ctlsock.go). For benchmarks that compare the two.
	RunscCLI bool

	// Restore flags, measured (issue 11 lever 4; bench BenchmarkBaselines, 2 shared cores): a sandbox's
	// memory image is small (2 MiB of pages for `base`: files live in host layers), so loading
	// its pages is not what a restore waits for. Neither --background nor --direct changed the
	// CPU a restore costs (16 restores of one image at once, median of 3 rounds: 1.46 s of CPU,
	// 1.47 s with --direct, 1.57 s with --background) nor, beyond the host's noise, their wall
	// time; excluding zero pages left the image as large and made checkpoints slower. So the
	// defaults stay: uncompressed images, the page cache shared by concurrent restores of one
	// image (no --direct), pages loaded before restore returns, zero pages kept.

	// Compression of checkpoint images: "none" (default; fastest restore, allows background
	// restore) or "flate-best-speed" (smaller images).
	Compression string
	// ExcludeZeroPages passes --exclude-committed-zero-pages to checkpoint.
	ExcludeZeroPages bool
	// RestoreBackground passes --background to restore: restore returns before every page is
	// loaded (needs Compression "none"). The image must then stay in place while the instance runs.
	RestoreBackground bool

	// LayerIdentity names a read-only layer of a rootfs stack by its content rather than its
	// host path (default: the path), so that a checkpoint taken on one node restores on another
	// whose copy of the same layers lives elsewhere: a checkpoint image records its stack as
	// these names, and a restore compares them (layers.go). It must map a name it returns to
	// itself (the names recorded by older images, host paths, go through it too).
	LayerIdentity func(path string) string
	// SentryGC and GoferGC set the Go GC of each instance's sentry and gofer processes (memory.go;
	// needs the runsc ember's set-up builds). Zero fields leave runsc's defaults.
	SentryGC, GoferGC GCConfig

	// Logger receives the driver's logs (default slog.Default()).
	Logger *slog.Logger
}

// Driver runs sandboxes with runsc. It is safe for concurrent use.
type Driver struct {
	cfg        Config
	log        *slog.Logger
	cgroupDirs []string // the daemon's own cgroup directory in each hierarchy

	mu       sync.Mutex
	logDirs  map[string]string       // id -> <StateDir>/logs of instances started by this process
	watches  map[string]*watch       // id -> exit watcher of its sandbox process (wait.go)
	stopping map[string]string       // id -> why the driver itself stopped it (Kill, Delete, Checkpoint)
	exits    map[string]runtime.Exit // id -> how its last watched sandbox process ended
}

var (
	_ runtime.Driver = (*Driver)(nil)
	_ runtime.Prober = (*Driver)(nil)
)

// New checks cfg, fills in defaults and creates Root.
func New(cfg Config) (*Driver, error) {
	if cfg.Runsc == "" {
		cfg.Runsc = "runsc"
	}
	p, err := exec.LookPath(cfg.Runsc)
	if err != nil {
		return nil, fmt.Errorf("gvisor: config runsc: %v: %w", err, errdefs.ErrInvalid)
	}
	cfg.Runsc = p
	if cfg.Root == "" {
		cfg.Root = "/var/run/ember/runsc"
	}
	if !filepath.IsAbs(cfg.Root) {
		return nil, fmt.Errorf("gvisor: config root %q: must be absolute: %w", cfg.Root, errdefs.ErrInvalid)
	}
	if cfg.Platform == "" {
		cfg.Platform = "systrap"
	}
	if cfg.Overlay == "" {
		cfg.Overlay = OverlayHost
	}
	if cfg.CgroupParent == "" {
		cfg.CgroupParent = "ember"
	}
	if strings.HasPrefix(cfg.CgroupParent, "/") {
		return nil, fmt.Errorf("gvisor: config cgroup_parent %q: must be relative: %w", cfg.CgroupParent, errdefs.ErrInvalid)
	}
	if err := validateGC(cfg.SentryGC, cfg.GoferGC); err != nil {
		return nil, err
	}
	switch cfg.Compression {
	case "":
		cfg.Compression = "none"
	case "none", "flate-best-speed":
	default:
		return nil, fmt.Errorf("gvisor: config compression %q: want none or flate-best-speed: %w", cfg.Compression, errdefs.ErrInvalid)
	}
	if cfg.RestoreBackground && cfg.Compression != "none" {
		return nil, fmt.Errorf("gvisor: config restore_background: needs compression none: %w", errdefs.ErrInvalid)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if err := os.MkdirAll(cfg.Root, 0o700); err != nil {
		return nil, fmt.Errorf("gvisor: config root: %w", err)
	}
	privateFile(filepath.Join(cfg.Root, "runsc.log"))
	d := &Driver{
		cfg: cfg, log: cfg.Logger.With("driver", "gvisor"),
		logDirs: map[string]string{}, watches: map[string]*watch{}, stopping: map[string]string{},
		exits: map[string]runtime.Exit{},
	}
	if !cfg.IgnoreCgroups {
		d.cgroupDirs = ownCgroupDirs()
	}
	return d, nil
}

// Name implements runtime.Driver.
func (d *Driver) Name() string { return "gvisor" }

// Config returns the driver's effective configuration (defaults filled in).
func (d *Driver) Config() Config { return d.cfg }

func (d *Driver) cgroupPath(id string) string { return d.cfg.CgroupParent + "/" + id }

func (d *Driver) logDir(id string) string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.logDirs[id]
}

func (d *Driver) setLogDir(id, dir string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if dir == "" {
		delete(d.logDirs, id)
	} else {
		d.logDirs[id] = dir
	}
}

// Start implements runtime.Driver: `runsc run --detach` of a fresh bundle. A stopped instance
// left under the same id is deleted first; a running one is an ErrConflict.
func (d *Driver) Start(ctx context.Context, spec runtime.Spec) error {
	if err := validateSpec(spec); err != nil {
		return err
	}
	if spec.LayerFrom != "" && !d.hostLayers() {
		return fmt.Errorf("gvisor: start on a saved layer needs host layers (overlay %q): %w", d.cfg.Overlay, errdefs.ErrInvalid)
	}
	// A filesystem-only resume boots on the layer saved in spec.LayerFrom.
	spec, err := d.prepareLayer(spec, spec.LayerFrom)
	if err != nil {
		return err
	}
	bundle, err := d.writeBundle(spec)
	if err == nil {
		err = d.launch(ctx, spec, "run", "--detach", "--bundle", bundle, spec.ID)
	}
	if err != nil && d.hostLayers() {
		releaseLayer(spec.StateDir)
	}
	return err
}

// Restore implements runtime.Driver: `runsc restore --detach` of imageDir into a fresh bundle.
// spec.Args and spec.Cwd must equal the checkpointed instance's (runsc validates them); id,
// hostname, env, netns, state dir and limits may differ. With Config.RestoreBackground the image
// is read after Restore returns, so it must stay until the instance is deleted.
func (d *Driver) Restore(ctx context.Context, spec runtime.Spec, imageDir string) error {
	if err := validateSpec(spec); err != nil {
		return err
	}
	if _, err := os.Stat(filepath.Join(imageDir, filesOnlyMarker)); err == nil {
		return fmt.Errorf("gvisor: restore image %q: a filesystem-only image holds no memory (boot it with Spec.LayerFrom): %w", imageDir, errdefs.ErrInvalid)
	}
	if _, err := os.Stat(filepath.Join(imageDir, "checkpoint.img")); err != nil {
		return fmt.Errorf("gvisor: restore image %q: %v: %w", imageDir, err, errdefs.ErrNotFound)
	}
	spec, err := d.prepareLayer(spec, imageDir)
	if err != nil {
		return err
	}
	bundle, err := d.writeBundle(spec)
	if err == nil {
		args := []string{"restore", "--detach", "--bundle", bundle, "--image-path", imageDir}
		if d.cfg.RestoreBackground {
			args = append(args, "--background")
		}
		err = d.launch(ctx, spec, append(args, spec.ID)...)
	}
	if err != nil && d.hostLayers() {
		releaseLayer(spec.StateDir)
	}
	return err
}

// launch runs a runsc command that creates a sandbox (run/restore --detach). The sandbox inherits
// runsc's stdio, so those are files under <StateDir>/logs, never pipes, and runsc runs in a
// session of its own so the sandbox outlives the daemon.
func (d *Driver) launch(ctx context.Context, spec runtime.Spec, args ...string) error {
	logs := filepath.Join(spec.StateDir, "logs")
	// runsc creates its log 0644 and its state file 0640, and keeps the mode of files that
	// exist: make them owner-only first (the directories above are 0700 too).
	privateFile(filepath.Join(logs, "runsc.log"))
	err := d.launchOnce(ctx, spec.ID, logs, args)
	if errors.Is(err, errdefs.ErrConflict) {
		// An instance of that id exists: replace it only if it no longer runs.
		st, serr := d.State(ctx, spec.ID)
		if serr == nil && st.State == runtime.StateStopped {
			if derr := d.Delete(ctx, spec.ID); derr != nil {
				return derr
			}
			err = d.launchOnce(ctx, spec.ID, logs, args)
		}
	}
	if err != nil {
		return err
	}
	d.setLogDir(spec.ID, logs)
	d.forgetExit(spec.ID)
	if err := d.raiseMemoryLimit(spec.ID, spec.MemoryMB); err != nil {
		d.log.Warn("no memory headroom: an out-of-memory stops the whole sandbox", "instance", spec.ID, "err", err)
	}
	if err := os.Chmod(filepath.Join(d.cfg.Root, spec.ID+"_sandbox:"+spec.ID+".state"), 0o600); err != nil && !errors.Is(err, os.ErrNotExist) {
		d.log.Warn("state file mode", "instance", spec.ID, "err", err)
	}
	return nil
}

// privateFile creates path 0600 (or makes it 0600) so a program that opens it later keeps it
// owner-only.
func privateFile(path string) {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return
	}
	f.Chmod(0o600)
	f.Close()
}

func (d *Driver) launchOnce(ctx context.Context, id, logs string, args []string) error {
	stdin, err := os.Open(os.DevNull)
	if err != nil {
		return fmt.Errorf("gvisor: %w", err)
	}
	defer stdin.Close()
	openLog := func(name string) (*os.File, error) {
		return os.OpenFile(filepath.Join(logs, name), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	}
	stdout, err := openLog("init.out")
	if err != nil {
		return fmt.Errorf("gvisor: %w", err)
	}
	defer stdout.Close()
	stderr, err := openLog("init.err")
	if err != nil {
		return fmt.Errorf("gvisor: %w", err)
	}
	defer stderr.Close()
	errStart, _ := stderr.Seek(0, 1)

	flags := append(d.globalFlags(logs), d.launchLogFlags(logs)...)
	cmd := exec.Command(d.cfg.Runsc, append(flags, args...)...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = stdin, stdout, stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	t0, since := time.Now(), monotonicNow()
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("gvisor: runsc %s: %w", args[0], err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err = <-done:
	case <-ctx.Done():
		_ = cmd.Process.Kill()
		<-done
		err := fmt.Errorf("gvisor: runsc %s %s: %w", args[0], id, ctx.Err())
		if !errors.Is(ctx.Err(), context.DeadlineExceeded) {
			d.cleanupFailed(id) // cancelled: nothing to explain
			return err
		}
		return d.failedLaunch(id, logs, args[0], errStart, since, err)
	}
	if err != nil {
		msg := readFrom(filepath.Join(logs, "init.err"), errStart)
		rerr := runscError(args, msg, err)
		if !errors.Is(rerr, errdefs.ErrConflict) {
			rerr = d.failedLaunch(id, logs, args[0], errStart, since, rerr)
		}
		return rerr
	}
	d.log.Debug("sandbox launched", "instance", id, "op", args[0], "ms", time.Since(t0).Milliseconds())
	return nil
}

// cleanupFailed removes what a failed create/restore left behind.
func (d *Driver) cleanupFailed(id string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := d.Delete(ctx, id); err != nil {
		d.log.Warn("cleanup after failed launch", "instance", id, "err", err)
	}
}

func readFrom(path string, off int64) string {
	b, err := os.ReadFile(path)
	if err != nil || off > int64(len(b)) {
		return ""
	}
	b = b[off:]
	if len(b) > 4096 {
		b = b[len(b)-4096:]
	}
	return string(b)
}

// ociState is the part of `runsc state` output the driver reads.
type ociState struct {
	ID     string `json:"id"`
	Status string `json:"status"`
	Pid    int    `json:"pid"`
	Bundle string `json:"bundle"`
}

// State implements runtime.Driver via `runsc state`.
func (d *Driver) State(ctx context.Context, id string) (runtime.Status, error) {
	if err := validateID(id); err != nil {
		return runtime.Status{State: runtime.StateUnknown}, err
	}
	if !d.cfg.RunscCLI {
		d.resolveIntent(ctx, id)
	}
	out, err := d.run(ctx, d.logDir(id), "state", id)
	if err != nil {
		return runtime.Status{State: runtime.StateUnknown}, err
	}
	var s ociState
	if err := json.Unmarshal(out, &s); err != nil {
		return runtime.Status{State: runtime.StateUnknown}, fmt.Errorf("gvisor: runsc state %s: %w", id, err)
	}
	if s.ID != id {
		return runtime.Status{State: runtime.StateUnknown}, fmt.Errorf("gvisor: runsc state %s answered for %q: %w", id, s.ID, errdefs.ErrNotFound)
	}
	if s.Bundle != "" && thawCutLayer(filepath.Dir(s.Bundle)) {
		d.log.Warn("gvisor: thawed a layer a cut checkpoint had left frozen", "instance", id)
	}
	// runsc says running while kill(pid, 0) succeeds, which includes an exited sandbox process
	// its parent (init, usually) has not reaped yet.
	if s.Status == "running" && alive(s.Pid) {
		return runtime.Status{State: runtime.StateRunning, Pid: s.Pid}, nil
	}
	if s.Status == statusPaused && alive(s.Pid) {
		return runtime.Status{State: runtime.StateRunning, Pid: s.Pid, Frozen: true}, nil
	}
	// created and stopped: nothing runs.
	return runtime.Status{State: runtime.StateStopped}, nil
}

// runscEvent is `runsc events --stats` output (the parts used).
type runscEvent struct {
	Type string `json:"type"`
	Data struct {
		CPU struct {
			Usage struct {
				Total uint64 `json:"total"`
			} `json:"usage"`
		} `json:"cpu"`
		Memory struct {
			Usage struct {
				Limit uint64 `json:"limit"`
				Usage uint64 `json:"usage"`
			} `json:"usage"`
		} `json:"memory"`
	} `json:"data"`
}

// Stats implements runtime.Driver via `runsc events --stats`. CPU time and memory are the
// sandbox's own accounting (the Sentry's); MemoryLimit is the cgroup limit, 0 when unlimited.
func (d *Driver) Stats(ctx context.Context, id string) (runtime.Stats, error) {
	if err := validateID(id); err != nil {
		return runtime.Stats{}, err
	}
	out, err := d.run(ctx, d.logDir(id), "events", "--stats", id)
	if err != nil {
		if st, serr := d.State(ctx, id); serr == nil && st.State != runtime.StateRunning {
			return runtime.Stats{}, fmt.Errorf("gvisor: stats %s: not running: %w", id, errdefs.ErrConflict)
		} else if serr != nil {
			return runtime.Stats{}, serr
		}
		return runtime.Stats{}, err
	}
	var ev runscEvent
	if err := json.Unmarshal(out, &ev); err != nil {
		return runtime.Stats{}, fmt.Errorf("gvisor: runsc events %s: %w", id, err)
	}
	limit := ev.Data.Memory.Usage.Limit
	if limit == 0 {
		limit = guestMemory(d.cgroupMemoryLimit(id)) // what the guest sees, not its headroom
	}
	if limit >= 1<<62 { // cgroup v1 "unlimited"
		limit = 0
	}
	return runtime.Stats{
		CPUUsage:    time.Duration(ev.Data.CPU.Usage.Total),
		MemoryBytes: ev.Data.Memory.Usage.Usage,
		MemoryLimit: limit,
		Timestamp:   time.Now(),
	}, nil
}

// Kill implements runtime.Driver: SIGKILL to every process (`runsc kill --all`), then it waits
// until the instance is stopped. A frozen instance is thawed first (runsc signals only running
// containers; a frozen sentry's tasks could not act on the signal anyway).
func (d *Driver) Kill(ctx context.Context, id string) error {
	if err := validateID(id); err != nil {
		return err
	}
	d.setStopping(id, "killed by the driver (Kill)")
	if d.frozen(id) {
		if err := d.Thaw(ctx, id); err != nil && !errors.Is(err, errdefs.ErrConflict) {
			return err
		}
	}
	if _, err := d.run(ctx, d.logDir(id), "kill", "--all", id, "KILL"); err != nil {
		st, serr := d.State(ctx, id)
		switch {
		case serr != nil:
			if errors.Is(serr, errdefs.ErrNotFound) {
				d.setStopping(id, "")
			}
			return serr
		case st.State != runtime.StateRunning:
			return nil
		}
		return err
	}
	return d.waitStopped(ctx, id, 10*time.Second)
}

// waitStopped waits until runsc reports id stopped. When the root process dies the sandbox
// process exits too; if it does not within timeout, it is killed.
func (d *Driver) waitStopped(ctx context.Context, id string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for delay := 2 * time.Millisecond; ; delay = min(delay*2, 50*time.Millisecond) {
		st, err := d.State(ctx, id)
		if err != nil || st.State != runtime.StateRunning {
			return nil // gone or stopped
		}
		if time.Now().After(deadline) {
			d.log.Warn("sandbox still running; killing its process", "instance", id, "pid", st.Pid)
			return killAndWait(ctx, st.Pid, 5*time.Second)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(delay):
		}
	}
}

// Delete implements runtime.Driver: `runsc delete --force`, then removal of the instance's
// cgroup directories that a killed runsc can leave behind.
func (d *Driver) Delete(ctx context.Context, id string) error {
	if err := validateID(id); err != nil {
		return err
	}
	stateDir := ""
	if d.hostLayers() {
		stateDir = d.instanceDir(ctx, id)
	}
	d.mu.Lock()
	if d.stopping[id] == "" {
		d.stopping[id] = "deleted by the driver (Delete)"
	}
	w := d.watches[id]
	d.mu.Unlock()
	_, err := d.run(ctx, d.logDir(id), "delete", "--force", id)
	if err != nil && !errors.Is(err, errdefs.ErrNotFound) {
		return err
	}
	if w != nil {
		// Let a pending Wait see why before the reason is forgotten.
		select {
		case <-w.done:
		case <-time.After(2 * time.Second):
		}
	}
	if layerOwed(stateDir) {
		// A deferred checkpoint's layer moves into its image below: nothing of the instance
		// may still use it (its gofer's mount namespace holds the layer's filesystem).
		d.waitGone(ctx, id, 10*time.Second)
	}
	d.forgetExit(id)
	d.setLogDir(id, "")
	os.Remove(d.statePath(id) + ".tmp") // a state write a crash cut short (writeStatus)
	if err := releaseLayer(stateDir); err != nil {
		return err
	}
	return d.removeCgroups(id)
}

// List implements runtime.Driver via `runsc list`.
func (d *Driver) List(ctx context.Context) ([]string, error) {
	out, err := d.run(ctx, "", "list", "--format", "json")
	if err != nil {
		return nil, err
	}
	var states []ociState
	if err := json.Unmarshal(out, &states); err != nil {
		return nil, fmt.Errorf("gvisor: runsc list: %w", err)
	}
	ids := make([]string, 0, len(states))
	for _, s := range states {
		ids = append(ids, s.ID)
	}
	return ids, nil
}

// Exec implements runtime.Driver via `runsc exec`. Output goes through a file, not a pipe: a
// background process started by the command keeps the descriptor open, and a pipe would never
// reach EOF. gVisor kills every process descended from an exec when an image is restored (its
// caller is gone), so long-lived processes must be started by the init process (envd).
func (d *Driver) Exec(ctx context.Context, id string, args []string) ([]byte, int, error) {
	if err := validateID(id); err != nil {
		return nil, -1, err
	}
	if len(args) == 0 {
		return nil, -1, fmt.Errorf("gvisor: exec: no args: %w", errdefs.ErrInvalid)
	}
	if d.frozen(id) {
		// runsc would create the process and wait for it forever.
		return nil, -1, fmt.Errorf("gvisor: exec %s: frozen: %w", id, errdefs.ErrConflict)
	}
	out, err := os.CreateTemp("", "ember-exec-*")
	if err != nil {
		return nil, -1, fmt.Errorf("gvisor: exec: %w", err)
	}
	defer os.Remove(out.Name())
	defer out.Close()
	stdin, err := os.Open(os.DevNull)
	if err != nil {
		return nil, -1, fmt.Errorf("gvisor: exec: %w", err)
	}
	defer stdin.Close()

	full := append(d.globalFlags(d.logDir(id)), "exec", id)
	cmd := exec.CommandContext(ctx, d.cfg.Runsc, append(full, args...)...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = stdin, out, out
	runErr := cmd.Run()
	output, rerr := os.ReadFile(out.Name())
	if rerr != nil {
		return nil, -1, fmt.Errorf("gvisor: exec: %w", rerr)
	}
	if runErr == nil {
		return output, 0, nil
	}
	var ee *exec.ExitError
	if !errors.As(runErr, &ee) || ctx.Err() != nil {
		return output, -1, fmt.Errorf("gvisor: exec %s: %w", id, errors.Join(runErr, ctx.Err()))
	}
	code := ee.ExitCode()
	// runsc exits with the command's status, and with 128 when it fails itself: tell them apart.
	st, serr := d.State(ctx, id)
	switch {
	case serr != nil:
		return nil, -1, serr
	case st.State != runtime.StateRunning:
		return nil, -1, fmt.Errorf("gvisor: exec %s: not running: %w", id, errdefs.ErrConflict)
	case code == 128:
		if c := classify(string(output)); c != nil {
			return nil, -1, fmt.Errorf("gvisor: exec %s: %s: %w", id, strings.TrimSpace(string(output)), c)
		}
	}
	return output, code, nil
}

// Checkpoint implements runtime.Driver: the sentry's checkpoint over the control socket
// (checkpointImage; `runsc checkpoint` with Config.RunscCLI). Without LeaveRunning the sandbox
// would linger about a second after runsc returns; the driver kills it at once (the image is
// complete when runsc returns) and waits for it to exit, so its memory and network namespace are
// free for the next restore. The stopped instance stays listed until Delete (or until Start or
// Restore reuse its id).
func (d *Driver) Checkpoint(ctx context.Context, id, imageDir string, opts runtime.CheckpointOptions) error {
	return d.checkpoint(ctx, id, imageDir, opts, nil)
}

// checkpoint is Checkpoint; with LeaveRunning and host layers, capture (when not nil) takes the
// paused instance's layer instead of the clone into the image (CheckpointToLayer).
func (d *Driver) checkpoint(ctx context.Context, id, imageDir string, opts runtime.CheckpointOptions, capture func(stateDir string, resume func()) error) error {
	if err := validateID(id); err != nil {
		return err
	}
	if ents, err := os.ReadDir(imageDir); err != nil {
		return fmt.Errorf("gvisor: checkpoint %s: image dir: %w", id, err)
	} else if len(ents) > 0 {
		return fmt.Errorf("gvisor: checkpoint %s: image dir %s not empty: %w", id, imageDir, errdefs.ErrInvalid)
	}
	if opts.FilesOnly {
		return d.checkpointFiles(ctx, id, imageDir, opts)
	}
	tl := runtime.NewTimeline()
	defer func() {
		tl.Log(d.log, "checkpoint timeline", "instance", id, "leave_running", opts.LeaveRunning, "image_mib", imageMiB(imageDir))
	}()
	// Without LeaveRunning the sandbox process is killed afterwards: hold it by pidfd first so
	// the kill cannot hit a recycled pid.
	pidfd := -1
	if !opts.LeaveRunning {
		pid, err := d.sandboxPid(ctx, id)
		if err != nil {
			return err
		}
		if pidfd, err = unix.PidfdOpen(pid, 0); err != nil {
			return fmt.Errorf("gvisor: checkpoint %s: pidfd: %w", id, err)
		}
		defer unix.Close(pidfd)
	}
	tl.Mark("pid")

	stateDir := ""
	resume := func() {}
	if d.hostLayers() {
		if stateDir = d.instanceDir(ctx, id); stateDir == "" {
			return fmt.Errorf("gvisor: checkpoint %s: state directory unknown: %w", id, errdefs.ErrNotFound)
		}
		if opts.LeaveRunning {
			// Files and memory must agree: nothing runs between the checkpoint and the layer
			// clone. A frozen instance stays frozen throughout and after.
			stopStart := time.Now()
			thaw, err := d.holdFrozen(ctx, id)
			if err != nil {
				return d.explain(ctx, id, err)
			}
			tl.Mark("freeze")
			sw := runtime.StopWatchFrom(ctx) // how long the processes were stopped, for the caller
			// Resumed once its layer can no longer change the clone (cloneUpper's frozen): a
			// disk-limited layer is copied while the instance runs again, its writes waiting.
			// Checkpoint returns once it is resumed either way.
			var once sync.Once
			resumed := make(chan struct{})
			resume = func() {
				once.Do(func() {
					go func() {
						defer close(resumed)
						if err := thaw(context.WithoutCancel(ctx)); err != nil {
							d.log.Warn("thaw after checkpoint", "instance", id, "err", err)
						}
						sw.Record(time.Since(stopStart))
					}()
				})
			}
			defer func() { resume(); <-resumed; tl.Mark("thaw") }()
		}
	}
	if !opts.LeaveRunning {
		// Set before runsc runs: the sandbox may exit on its own as soon as its image is written.
		d.setStopping(id, "stopped by the driver (Checkpoint)")
	}
	tl.Mark("prepare")
	cerr := d.checkpointImage(ctx, id, imageDir, opts.LeaveRunning)
	tl.Mark("runsc_checkpoint")
	if cerr != nil {
		if !opts.LeaveRunning {
			d.setStopping(id, "")
		}
		return d.explain(ctx, id, cerr)
	}
	privateFiles(imageDir)
	if opts.LeaveRunning {
		if stateDir != "" && capture != nil {
			defer tl.Mark("capture")
			return capture(stateDir, resume)
		}
		if stateDir != "" {
			defer tl.Mark("layer_clone")
			return d.checkpointLayer(stateDir, imageDir, true, resume)
		}
		return nil
	}
	if opts.DeferLayer && stateDir != "" {
		// The memory image is complete: the layer is owed to it from here on (Delete or
		// Release moves it there once nothing uses it), and the caller need not wait.
		defer tl.Mark("owe_layer")
		return d.oweLayer(pidfd, stateDir, imageDir)
	}
	// The image is complete; without the kill the sandbox would linger about a second.
	_ = unix.PidfdSendSignal(pidfd, unix.SIGKILL, nil, 0)
	if err := waitPidfd(ctx, pidfd, 10*time.Second); err != nil {
		return err
	}
	tl.Mark("sandbox_exit")
	if stateDir != "" {
		d.waitGone(ctx, id, 10*time.Second)
		tl.Mark("gofer_exit")
		defer tl.Mark("layer_move")
		return d.checkpointLayer(stateDir, imageDir, false, nil)
	}
	return nil
}

// filesOnlyMarker marks an image that holds a writable layer and no memory.
const filesOnlyMarker = "files-only"

// checkpointFiles is Checkpoint with FilesOnly: the sandbox's file data is flushed to the host
// (sync inside it), the instance is stopped and its layer moved into imageDir. No memory image
// is written; Start with Spec.LayerFrom boots on the layer.
func (d *Driver) checkpointFiles(ctx context.Context, id, imageDir string, opts runtime.CheckpointOptions) error {
	if opts.LeaveRunning {
		return fmt.Errorf("gvisor: checkpoint %s: FilesOnly with LeaveRunning: %w", id, errdefs.ErrInvalid)
	}
	if !d.hostLayers() {
		return fmt.Errorf("gvisor: checkpoint %s: a filesystem-only checkpoint needs host layers: %w", id, errdefs.ErrInvalid)
	}
	stateDir := d.instanceDir(ctx, id)
	if stateDir == "" {
		return fmt.Errorf("gvisor: checkpoint %s: state directory unknown: %w", id, errdefs.ErrNotFound)
	}
	pid, err := d.sandboxPid(ctx, id)
	if err != nil {
		return err
	}
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return fmt.Errorf("gvisor: checkpoint %s: pidfd: %w", id, err)
	}
	defer unix.Close(pidfd)
	if d.frozen(id) {
		// The sync below runs inside it.
		if err := d.Thaw(ctx, id); err != nil {
			return err
		}
	}
	// Data the sandbox wrote may still sit in its kernel's page cache: flush it to the layer.
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	if out, code, err := d.Exec(sctx, id, []string{"/bin/sync"}); err != nil || code != 0 {
		d.log.Warn("sync before a filesystem-only checkpoint", "instance", id, "code", code, "err", err, "out", strings.TrimSpace(string(out)))
	}
	cancel()
	d.setStopping(id, "stopped by the driver (Checkpoint)")
	_ = unix.PidfdSendSignal(pidfd, unix.SIGKILL, nil, 0)
	if err := waitPidfd(ctx, pidfd, 10*time.Second); err != nil {
		return err
	}
	d.waitGone(ctx, id, 10*time.Second)
	if err := d.checkpointLayer(stateDir, imageDir, false, nil); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(imageDir, filesOnlyMarker), nil, 0o600)
}

// sandboxPid returns the pid of id's running sandbox process. It reads runsc's state file
// (<root>/<id>_sandbox:<id>.state, for the pinned runsc) to save a runsc invocation, and falls
// back to `runsc state`.
func (d *Driver) sandboxPid(ctx context.Context, id string) (int, error) {
	if pid, err := readStatePid(d.cfg.Root, id); err == nil && alive(pid) {
		return pid, nil
	}
	st, err := d.State(ctx, id)
	if err != nil {
		return 0, err
	}
	if st.State != runtime.StateRunning {
		return 0, fmt.Errorf("gvisor: %s: not running: %w", id, errdefs.ErrConflict)
	}
	return st.Pid, nil
}

// privateFiles makes the regular files directly in dir readable by their owner (root) only:
// memory images hold the sandbox's secrets.
func privateFiles(dir string) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, e := range ents {
		if e.Type().IsRegular() {
			_ = os.Chmod(filepath.Join(dir, e.Name()), 0o600)
		}
	}
}

// readStatePid reads the sandbox pid recorded in runsc's state file of id under root.
func readStatePid(root, id string) (int, error) {
	var f struct {
		ID      string `json:"id"`
		Sandbox struct {
			Pid int `json:"pid"`
		} `json:"sandbox"`
	}
	b, err := os.ReadFile(filepath.Join(root, id+"_sandbox:"+id+".state"))
	if err != nil {
		return 0, err
	}
	if err := json.Unmarshal(b, &f); err != nil {
		return 0, err
	}
	if f.ID != id || f.Sandbox.Pid <= 0 {
		return 0, fmt.Errorf("gvisor: state file of %s: no pid: %w", id, errdefs.ErrNotFound)
	}
	return f.Sandbox.Pid, nil
}

// explain turns a failed command on id into ErrNotFound or ErrConflict when runsc's message does
// not already say which.
func (d *Driver) explain(ctx context.Context, id string, err error) error {
	if errors.Is(err, errdefs.ErrNotFound) || errors.Is(err, errdefs.ErrConflict) {
		return err
	}
	st, serr := d.State(ctx, id)
	switch {
	case serr != nil:
		return serr
	case st.State != runtime.StateRunning:
		return fmt.Errorf("%v: not running: %w", err, errdefs.ErrConflict)
	}
	return err
}

// alive reports whether pid exists and is not a zombie.
func alive(pid int) bool {
	if pid <= 0 {
		return false
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 || i+2 >= len(b) {
		return false
	}
	return b[i+2] != 'Z' && b[i+2] != 'X'
}

// waitPidfd waits until the process behind pidfd has exited.
func waitPidfd(ctx context.Context, pidfd int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		fds := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
		n, err := unix.Poll(fds, 20)
		if err != nil && !errors.Is(err, unix.EINTR) {
			return fmt.Errorf("gvisor: wait for sandbox exit: %w", err)
		}
		if n > 0 {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("gvisor: sandbox process did not exit: %w", errdefs.ErrUnavailable)
		}
	}
}

func killAndWait(ctx context.Context, pid int, timeout time.Duration) error {
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return nil // already gone
	}
	defer unix.Close(fd)
	_ = unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0)
	return waitPidfd(ctx, fd, timeout)
}
