package gvisor

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
	"gvisor.dev/gvisor/pkg/sentry/state/checkpointfiles"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

// Pre-started instances (runtime.Prestarter): `runsc create` of the instance's bundle ahead of
// time, `runsc restore` of the same id later. runsc's restore of a container that exists (state
// "created") skips container.New — the gofer and sandbox processes, their namespaces, the
// cgroup, the chroot and platform set-up — and runs only what follows: the network is read from
// the namespace the sandbox joined at create, the image is loaded and the root container starts.
// The rootfs and mounts are fixed at create, so the instance's writable layer (a clone of the
// image's) is in place first, and the image restored must be the one it was cloned from.

var _ runtime.Prestarter = (*Driver)(nil)

// prestartName, in a pre-started instance's state dir, names the image its layer came from.
const prestartName = "prestart-image"

// Prestart implements runtime.Prestarter.
func (d *Driver) Prestart(ctx context.Context, spec runtime.Spec, imageDir string) error {
	if err := validateSpec(spec); err != nil {
		return err
	}
	if spec.LayerFrom != "" {
		return fmt.Errorf("gvisor: prestart %s: LayerFrom is not supported: %w", spec.ID, errdefs.ErrInvalid)
	}
	if imageDir != "" {
		if _, err := os.Stat(filepath.Join(imageDir, "checkpoint.img")); err != nil {
			return fmt.Errorf("gvisor: prestart image %q: %v: %w", imageDir, err, errdefs.ErrNotFound)
		}
	}
	if err := os.MkdirAll(spec.StateDir, 0o700); err != nil {
		return fmt.Errorf("gvisor: state dir: %w", err)
	}
	if err := os.WriteFile(filepath.Join(spec.StateDir, prestartName), []byte(imageDir), 0o600); err != nil {
		return fmt.Errorf("gvisor: prestart %s: %w", spec.ID, err)
	}
	spec, err := d.prepareLayer(spec, imageDir)
	if err != nil {
		return err
	}
	bundle, err := d.writeBundle(spec)
	if err == nil {
		err = d.launch(ctx, spec, "create", "--bundle", bundle, spec.ID)
	}
	if err == nil && !d.cfg.RunscCLI {
		// The restore's network set-up, done now (netargs.go): RestoreInto is then one call.
		if err = d.prestartNetwork(ctx, spec); err != nil {
			d.cleanupFailed(spec.ID)
		}
	}
	if err != nil && d.hostLayers() {
		releaseLayer(spec.StateDir)
	}
	return err
}

// prestartNetName, in a pre-started instance's state dir, says its sentry has its network
// (prestartNetwork): RestoreInto restores over the control socket.
const prestartNetName = "prestart-network"

func (d *Driver) prestartNetwork(ctx context.Context, spec runtime.Spec) error {
	st, err := d.readState(spec.ID)
	if err != nil {
		return err
	}
	if !alive(st.Pid) {
		return fmt.Errorf("gvisor: prestart %s: sandbox process gone: %w", spec.ID, errdefs.ErrUnavailable)
	}
	// On error the namespace may have lost its addresses: Prestart deletes the instance.
	args, err := scrapeNetwork("/proc/" + strconv.Itoa(st.Pid) + "/ns/net")
	if err != nil {
		return fmt.Errorf("gvisor: network of %s: %w", spec.ID, err)
	}
	defer func() {
		for _, f := range args.FilePayload.Files {
			f.Close()
		}
	}()
	if err := d.ctlCall(ctx, spec.ID, st.Socket, ctlSetNetworkArgs, args, nil); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(spec.StateDir, prestartNetName), nil, 0o600)
}

// RestoreInto implements runtime.Prestarter. On failure the instance is deleted (it cannot be
// used again); the caller still releases its state dir.
//
// An instance whose sentry got its network at pre-start (prestartNetwork) is restored with the
// sentry's containerManager.Restore over the control socket (restoreOverSocket): what `runsc
// restore` of a created container does besides that call is the network set-up, done already,
// its host-settings check (warnings only), moving the container to "running" in its state file
// (done here the way ctlsock.go does it for pause and resume) and OOM scores, which the driver's
// specs do not set. With Config.RunscCLI, or for an instance pre-started by an earlier daemon
// without that step, it runs `runsc restore`.
func (d *Driver) RestoreInto(ctx context.Context, id, imageDir string) error {
	if err := validateID(id); err != nil {
		return err
	}
	tl := runtime.NewTimeline()
	defer tl.Log(d.log, "restore into timeline", "instance", id)
	stateDir := d.instanceDir(ctx, id)
	if stateDir == "" {
		return fmt.Errorf("gvisor: restore into %s: no such instance: %w", id, errdefs.ErrNotFound)
	}
	b, err := os.ReadFile(filepath.Join(stateDir, prestartName))
	if err != nil {
		return fmt.Errorf("gvisor: restore into %s: not a pre-started instance: %w", id, errdefs.ErrConflict)
	}
	if want := string(b); want != imageDir && d.hostLayers() && (want != "" || imageHasLayer(imageDir)) {
		return fmt.Errorf("gvisor: restore into %s: pre-started for image %q, not %q: %w", id, want, imageDir, errdefs.ErrInvalid)
	}
	if _, err := os.Stat(filepath.Join(imageDir, "checkpoint.img")); err != nil {
		return fmt.Errorf("gvisor: restore image %q: %v: %w", imageDir, err, errdefs.ErrNotFound)
	}
	if _, serr := os.Stat(filepath.Join(stateDir, prestartNetName)); serr == nil && !d.cfg.RunscCLI {
		tl.Mark("prepare")
		err = d.restoreOverSocket(ctx, id, imageDir)
		tl.Mark("restore_call")
	} else {
		args := []string{"restore", "--detach", "--image-path", imageDir}
		if d.cfg.RestoreBackground {
			args = append(args, "--background")
		}
		logs := filepath.Join(stateDir, "logs")
		tl.Mark("prepare")
		err = d.launchOnce(ctx, id, logs, append(args, id))
		tl.Mark("runsc_restore")
	}
	if err != nil {
		if errors.Is(err, errdefs.ErrConflict) {
			return fmt.Errorf("gvisor: restore into %s: %w", id, err)
		}
		return err
	}
	// Used: a second RestoreInto is refused before runsc runs.
	os.Remove(filepath.Join(stateDir, prestartName))
	d.forgetExit(id)
	if err := d.raiseMemoryLimit(id, bundleMemoryMB(stateDir)); err != nil {
		d.log.Warn("no memory headroom: an out-of-memory stops the whole sandbox", "instance", id, "err", err)
	}
	return nil
}

// restoreOverSocket restores imageDir into created instance id with containerManager.Restore
// over its control socket, under runsc's lock of the container, and records it running.
func (d *Driver) restoreOverSocket(ctx context.Context, id, imageDir string) (err error) {
	unlock, err := d.lockState(ctx, id)
	if err != nil {
		return err
	}
	failed := true
	defer func() {
		unlock()
		if failed {
			d.cleanupFailed(id) // a sentry that began a restore takes no other
		}
	}()
	st, err := d.readState(id)
	if err != nil {
		return err
	}
	if st.Status != statusCreated || !alive(st.Pid) {
		return fmt.Errorf("gvisor: restore into %s: instance is %s: %w", id, st.Status, errdefs.ErrConflict)
	}
	var opts restoreOpts
	defer func() {
		for _, f := range opts.FilePayload.Files {
			f.Close()
		}
	}()
	for i, n := range []string{checkpointfiles.StateFileName, checkpointfiles.PagesMetadataFileName, checkpointfiles.PagesFileName} {
		f, err := os.OpenFile(filepath.Join(imageDir, n), os.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if i == 1 && errors.Is(err, os.ErrNotExist) {
			break // one compressed file: the pages are in the state file
		}
		if err != nil {
			return fmt.Errorf("gvisor: restore image %q: %w", imageDir, err)
		}
		opts.FilePayload.Files = append(opts.FilePayload.Files, f)
	}
	opts.HavePagesFile = len(opts.FilePayload.Files) == 3
	opts.Background = d.cfg.RestoreBackground
	if err := d.ctlCall(ctx, id, st.Socket, ctlRestore, &opts, nil); err != nil {
		return err
	}
	markRestored(st)
	if err := d.writeStatus(id, st, statusRunning); err != nil {
		return err
	}
	failed = false
	return nil
}

// markRestored sets runsc's "restored" flag of the sandbox in its state, as its restore does.
func markRestored(st *runscState) {
	var sb map[string]json.RawMessage
	if json.Unmarshal(st.raw["sandbox"], &sb) != nil || sb == nil {
		return
	}
	sb["restored"] = json.RawMessage("true")
	if b, err := json.Marshal(sb); err == nil {
		st.raw["sandbox"] = b
	}
}
