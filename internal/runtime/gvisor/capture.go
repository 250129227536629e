package gvisor

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/overlayfs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

// Captured layers (runtime.LayerCapturer): a checkpoint whose writable layer is not cloned
// into the image but into a directory of its own, which restores of the image stack read-only
// under a fresh writable layer each. The layer is captured once, while the instance is paused
// (files and memory agree), the same clone a fork's image got before: a btrfs snapshot, a
// reflink or copy of the files, or for a disk-limited layer a copy of its frozen ext4 image,
// which is then mounted read-only (noload: the freeze left its journal empty) over its own
// directory and shared by every instance that stacks it. Each of those instances gets an empty
// writable layer of its own (a fresh disk image when limited: its limit bounds what it writes
// itself, the captured files are not counted), so nothing is copied per instance.
//
// The layer is captured after runsc checkpoint, never before it: the sentry's save first flushes
// the file data it caches to the host (the gofer filesystem's PrepareSave syncs), so only then
// does the layer hold what the memory image expects. Instances on the captured stack can thus
// only be created once the image is written (pre-starting them during the checkpoint would
// need the layer first).
//
// Layout: <layerDir>/layer is the clone as CloneUpper makes it; the top (the directory to stack)
// is <layerDir>/layer/upper, an overlayfs upper directory whose whiteouts and opaque
// directories overlayfs honours in a lower layer as well.

var _ runtime.LayerCapturer = (*Driver)(nil)

// CapturesLayers implements runtime.LayerCapturer: with host layers only.
func (d *Driver) CapturesLayers() bool { return d.hostLayers() }

// CheckpointToLayer implements runtime.LayerCapturer.
func (d *Driver) CheckpointToLayer(ctx context.Context, id, imageDir, layerDir string) (top string, err error) {
	if !d.hostLayers() {
		return "", fmt.Errorf("gvisor: checkpoint %s to a layer: needs host layers (overlay %q): %w", id, d.cfg.Overlay, errdefs.ErrInvalid)
	}
	if !filepath.IsAbs(layerDir) || strings.ContainsAny(layerDir, ",:\\\n") {
		return "", fmt.Errorf("gvisor: checkpoint %s to a layer: path %q: must be absolute without , : or \\: %w", id, layerDir, errdefs.ErrInvalid)
	}
	err = d.checkpoint(ctx, id, imageDir, runtime.CheckpointOptions{LeaveRunning: true}, func(stateDir string, resume func()) error {
		var cerr error
		top, cerr = captureLayer(stateDir, imageDir, layerDir, resume)
		return cerr
	})
	return top, err
}

// captureLayer clones the paused instance's layer in stateDir into layerDir, opens it, and
// records in imageDir the stack the image restores onto: the captured top over the
// instance's own stack.
func captureLayer(stateDir, imageDir, layerDir string, resume func()) (top string, err error) {
	stack, err := os.ReadFile(filepath.Join(stateDir, stackName))
	if err != nil {
		return "", fmt.Errorf("gvisor: capture layer: rootfs stack: %w", err)
	}
	if err := os.Mkdir(layerDir, 0o700); err != nil {
		return "", fmt.Errorf("gvisor: capture layer: %w", err)
	}
	defer func() {
		if err != nil {
			removeCaptured(layerDir)
		}
	}()
	if _, err := cloneUpper(stateDir, layerDir, resume); err != nil {
		return "", err
	}
	if top, err = openCaptured(layerDir); err != nil {
		return "", err
	}
	if err := os.WriteFile(filepath.Join(imageDir, stackName), []byte(top+"\n"+string(stack)), 0o600); err != nil {
		return "", fmt.Errorf("gvisor: capture layer: rootfs stack: %w", err)
	}
	return top, nil
}

// OpenCapturedLayer implements runtime.LayerCapturer.
func (d *Driver) OpenCapturedLayer(ctx context.Context, layerDir string) (string, error) {
	return openCaptured(layerDir)
}

// openCaptured mounts a captured disk image read-only over its directory unless it is, and
// returns the layer's top.
func openCaptured(layerDir string) (string, error) {
	layer := filepath.Join(layerDir, layerDirName)
	if hasDiskImage(layer) && !overlayfs.IsMountPoint(layer) {
		dev, lfd, err := attachLoop(filepath.Join(layer, diskImageName))
		if err != nil {
			return "", err
		}
		err = unix.Mount(dev, layer, "ext4", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV, "noload")
		unix.Close(lfd) // the mount keeps the device; autoclear detaches it at unmount
		if err != nil {
			return "", fmt.Errorf("gvisor: captured layer: mount %s on %s: %w", dev, layer, err)
		}
	}
	top := filepath.Join(layer, upperDirName)
	if err := checkLayerDir(top); err != nil {
		return "", fmt.Errorf("gvisor: captured layer %s: %w", layerDir, err)
	}
	return top, nil
}

// CloseCapturedLayer implements runtime.LayerCapturer.
func (d *Driver) CloseCapturedLayer(ctx context.Context, layerDir string) error {
	layer := filepath.Join(layerDir, layerDirName)
	if !overlayfs.IsMountPoint(layer) {
		return nil
	}
	return unmountStrict(layer, 15*time.Second)
}

// RemoveCapturedLayer implements runtime.LayerCapturer.
func (d *Driver) RemoveCapturedLayer(ctx context.Context, layerDir string) error {
	return removeCaptured(layerDir)
}

func removeCaptured(layerDir string) error {
	if _, err := os.Lstat(layerDir); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err := RemoveLayer(layerDir); err != nil {
		return err
	}
	if err := os.RemoveAll(layerDir); err != nil {
		return fmt.Errorf("gvisor: remove captured layer: %w", err)
	}
	return nil
}
