package gvisor

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

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
	if err != nil && d.hostLayers() {
		releaseLayer(spec.StateDir)
	}
	return err
}

// RestoreInto implements runtime.Prestarter. On failure the instance is deleted (it cannot be
// used again); the caller still releases its state dir.
//
// It runs `runsc restore`, not the sentry's containerManager.Restore over the control socket
// (ctlsock.go): before that one call, runsc's restore of a created container applies its host
// settings, enters the sandbox's network namespace to scrape its links, addresses and routes,
// opens a packet socket per link there and hands them to the sentry
// (containerManager.SetNetworkArgs; runsc/sandbox/network.go, dependent on runsc's network
// configuration and version), and afterwards moves the container to "running" in its state file
// and sets the sandbox's and gofer's OOM scores. Doing that in the daemon means importing
// runsc/sandbox and runsc/container, which link the whole sentry (some 460 packages) into it, or
// re-implementing runsc's network set-up; neither stays safely in step with runsc.
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
	args := []string{"restore", "--detach", "--image-path", imageDir}
	if d.cfg.RestoreBackground {
		args = append(args, "--background")
	}
	logs := filepath.Join(stateDir, "logs")
	tl.Mark("prepare")
	err = d.launchOnce(ctx, id, logs, append(args, id))
	tl.Mark("runsc_restore")
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
