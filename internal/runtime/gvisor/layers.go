package gvisor

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/overlayfs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

// OverlayHost is Config.Overlay's value for host layers: runsc runs with --overlay2=none on a
// kernel overlayfs mount whose upper is a directory of the instance (fsdelta.go). A sandbox's
// writes are then host files, not sentry memory, so checkpoint images hold memory only and their
// cost does not grow with what the sandbox wrote; checkpoints carry the layer as a copy-on-write
// clone (btrfs snapshot or reflinks where the filesystem has them, a copy elsewhere).
const OverlayHost = "none"

func (d *Driver) hostLayers() bool { return d.cfg.Overlay == OverlayHost }

// imageLayer is where a checkpoint image keeps the instance's writable layer.
func imageHasLayer(imageDir string) bool {
	_, err := os.Stat(filepath.Join(imageDir, layerDirName, upperDirName))
	return err == nil || hasDiskImage(filepath.Join(imageDir, layerDirName))
}

// prepareLayer gives spec's instance its writable root before start or restore: the layer of
// imageDir (moved when spec.ConsumeImage, else cloned), or an empty one. It returns the spec to
// hand to runsc (RootFS = the overlay mount of the instance's layer over spec's read-only stack,
// Lowers cleared).
func (d *Driver) prepareLayer(spec runtime.Spec, imageDir string) (runtime.Spec, error) {
	if !d.hostLayers() {
		if len(spec.Lowers) > 0 {
			return spec, fmt.Errorf("gvisor: a rootfs of %d layers needs host layers (overlay %q): %w", 1+len(spec.Lowers), d.cfg.Overlay, errdefs.ErrInvalid)
		}
		return spec, nil
	}
	if err := os.MkdirAll(spec.StateDir, 0o700); err != nil {
		return spec, fmt.Errorf("gvisor: state dir: %w", err)
	}
	if err := d.checkStack(spec, imageDir); err != nil {
		return spec, err
	}
	if err := os.WriteFile(filepath.Join(spec.StateDir, stackName), []byte(strings.Join(d.stackIDs(spec.Stack()), "\n")), 0o600); err != nil {
		return spec, fmt.Errorf("gvisor: state dir: %w", err)
	}
	if imageDir != "" && imageHasLayer(imageDir) {
		dst := filepath.Join(spec.StateDir, layerDirName)
		if spec.ConsumeImage {
			// Remember where the layer came from: until the caller removes that image (its
			// resume is recorded), a failed or crashed resume gives the layer back to it instead
			// of deleting the sandbox's files (releaseLayer).
			if err := os.WriteFile(filepath.Join(spec.StateDir, layerFromName), []byte(imageDir), 0o600); err != nil {
				return spec, fmt.Errorf("gvisor: take layer of %s: %w", imageDir, err)
			}
			if err := os.Rename(filepath.Join(imageDir, layerDirName), dst); err != nil {
				return spec, fmt.Errorf("gvisor: take layer of %s: %w", imageDir, err)
			}
		} else if _, err := CloneUpper(imageDir, spec.StateDir); err != nil {
			return spec, err
		}
	}
	if err := d.applyDiskLimit(spec); err != nil {
		return spec, err
	}
	merged, _, err := PrepareRootFS(spec.Stack(), spec.StateDir)
	if err != nil {
		return spec, err
	}
	spec.RootFS, spec.Lowers = merged, nil
	return spec, nil
}

// stackName, in an instance's state dir and in its checkpoint images, lists the read-only
// layers (top first) its root filesystem stacks its writable layer on, by their identities
// (Config.LayerIdentity; host paths in images of older drivers).
const stackName = "rootfs-stack"

// stackIDs names the layers of a stack by their identities.
func (d *Driver) stackIDs(stack []string) []string {
	if d.cfg.LayerIdentity == nil {
		return stack
	}
	out := make([]string, len(stack))
	for i, p := range stack {
		out[i] = d.cfg.LayerIdentity(p)
	}
	return out
}

// checkStack refuses to restore a memory image onto another stack of layers than the one it
// was checkpointed on: its files would not be the ones its memory knows (an image of an older
// driver, which records none, is not checked). Both stacks are compared by identity: one
// recorded as host paths (an older driver) matches the same layers here.
func (d *Driver) checkStack(spec runtime.Spec, imageDir string) error {
	if imageDir == "" {
		return nil
	}
	if _, err := os.Stat(filepath.Join(imageDir, "checkpoint.img")); err != nil {
		return nil // a filesystem-only image: a new boot on its files
	}
	b, err := os.ReadFile(filepath.Join(imageDir, stackName))
	if err != nil {
		return nil
	}
	got, want := d.stackIDs(strings.Split(string(b), "\n")), d.stackIDs(spec.Stack())
	if !slices.Equal(got, want) {
		return fmt.Errorf("gvisor: restore: image %s was checkpointed on the rootfs layers %q, not %q: %w",
			imageDir, got, want, errdefs.ErrInvalid)
	}
	return nil
}

// recordStack copies an instance's stack list into its checkpoint image.
func recordStack(stateDir, imageDir string) error {
	b, err := os.ReadFile(filepath.Join(stateDir, stackName))
	if errors.Is(err, os.ErrNotExist) {
		return nil // started by an older driver
	}
	if err == nil {
		err = os.WriteFile(filepath.Join(imageDir, stackName), b, 0o600)
	}
	if err != nil {
		return fmt.Errorf("gvisor: checkpoint: rootfs stack: %w", err)
	}
	return nil
}

// layerFromName, in an instance's state dir, names the image its layer was moved out of.
const layerFromName = "layer-from"

// releaseLayer unmounts an instance's overlay and removes its layer, unless the layer was
// taken from an image that still exists without it (a resume that failed, or was cut by a
// crash, before the caller removed the image): then the layer goes back into that image, so
// the paused sandbox keeps its files.
func releaseLayer(stateDir string) error {
	if stateDir == "" {
		return nil
	}
	if b, err := os.ReadFile(filepath.Join(stateDir, layerFromName)); err == nil {
		image := string(b)
		layer := filepath.Join(stateDir, layerDirName)
		if dirExists(image) && !imageHasLayer(image) && dirExists(layer) {
			if err := unmountStrict(filepath.Join(stateDir, mergedDirName), 15*time.Second); err != nil {
				return err
			}
			if overlayfs.IsMountPoint(layer) {
				if err := syncFS(layer); err != nil {
					return err
				}
				if err := unmountStrict(layer, 15*time.Second); err != nil {
					return err
				}
			}
			if err := os.Rename(layer, filepath.Join(image, layerDirName)); err != nil {
				return fmt.Errorf("gvisor: give the layer back to %s: %w", image, err)
			}
		}
		os.Remove(filepath.Join(stateDir, layerFromName))
	}
	var errs []error
	if err := unmount(filepath.Join(stateDir, mergedDirName)); err != nil {
		errs = append(errs, err)
	}
	if err := RemoveLayer(stateDir); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// unmount detaches a mount point; a path that is not mounted (or absent) is not an error.
func unmount(p string) error {
	for i := 0; ; i++ {
		err := unix.Unmount(p, 0)
		switch {
		case err == nil:
			continue // stacked mounts: repeat until none is left
		case errors.Is(err, unix.EINVAL), errors.Is(err, unix.ENOENT):
			return nil
		case errors.Is(err, unix.EBUSY) && i < 50:
			time.Sleep(20 * time.Millisecond) // the gofer may still be exiting
		case errors.Is(err, unix.EBUSY):
			return unix.Unmount(p, unix.MNT_DETACH)
		default:
			return fmt.Errorf("gvisor: unmount %s: %w", p, err)
		}
	}
}

// syncFS writes back every dirty page of the filesystem holding p.
func syncFS(p string) error {
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("gvisor: sync %s: %w", p, err)
	}
	defer unix.Close(fd)
	if err := unix.Syncfs(fd); err != nil {
		return fmt.Errorf("gvisor: sync %s: %w", p, err)
	}
	return nil
}

func dirExists(p string) bool {
	fi, err := os.Lstat(p)
	return err == nil && fi.IsDir()
}

// unmountStrict unmounts p, waiting up to timeout while it is busy (an exiting gofer), and never
// detaches lazily: it returns an error instead.
func unmountStrict(p string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		err := unix.Unmount(p, 0)
		switch {
		case err == nil:
			continue // stacked mounts: repeat until none is left
		case errors.Is(err, unix.EINVAL), errors.Is(err, unix.ENOENT):
			return nil
		case errors.Is(err, unix.EBUSY) && time.Now().Before(deadline):
			time.Sleep(20 * time.Millisecond)
		default:
			return fmt.Errorf("gvisor: unmount %s: %w", p, err)
		}
	}
}

// instanceDir finds the state directory of an instance (the parent of its bundle).
func (d *Driver) instanceDir(ctx context.Context, id string) string {
	if l := d.logDir(id); l != "" {
		return filepath.Dir(l)
	}
	out, err := d.run(ctx, "", "state", id)
	if err != nil {
		return ""
	}
	var s ociState
	if json.Unmarshal(out, &s) != nil || s.Bundle == "" {
		return ""
	}
	return filepath.Dir(s.Bundle)
}

// checkpointLayer completes a checkpoint of a host-layer instance: with leaveRunning the
// (paused) instance's layer is cloned into the image, and resume is called once the instance
// may run again; otherwise the stopped instance's layer is moved there.
func (d *Driver) checkpointLayer(stateDir, imageDir string, leaveRunning bool, resume func()) error {
	if err := recordStack(stateDir, imageDir); err != nil {
		return err
	}
	if leaveRunning {
		_, err := cloneUpper(stateDir, imageDir, resume)
		return err
	}
	layer := filepath.Join(stateDir, layerDirName)
	if overlayfs.IsMountPoint(layer) {
		// A disk-limited layer is an ext4 filesystem: its data must be on its image before the
		// image moves, or a later mount of it would see stale data (and the filesystem may
		// live on a moment in a namespace of the exiting gofer's, beyond our unmount): flush
		// it, then unmount for real. No lazy detach, neither of it nor of the overlay above.
		if err := syncFS(layer); err != nil {
			return err
		}
		if err := unmountStrict(filepath.Join(stateDir, mergedDirName), 15*time.Second); err != nil {
			return err
		}
		if err := unmountStrict(layer, 15*time.Second); err != nil {
			return err
		}
	} else if err := unmount(filepath.Join(stateDir, mergedDirName)); err != nil {
		return err
	}
	if err := os.Rename(layer, filepath.Join(imageDir, layerDirName)); err != nil {
		return fmt.Errorf("gvisor: move layer into image: %w", err)
	}
	return nil
}
