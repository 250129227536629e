package gvisor

import (
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// Deferred checkpoint layers (runtime.CheckpointOptions.DeferLayer, issue 11 lever 3). A pause's
// memory image is complete when `runsc checkpoint` returns, but moving the instance's writable
// layer into the image has to wait until the sandbox and its gofer have exited and the layer's
// mounts are gone — about half of what a pause used to take after runsc. With DeferLayer the
// checkpoint instead records, in the instance's state dir, that the layer belongs to the image
// (the same layer-from record a resume leaves when it takes a layer out of an image), kills
// the sandbox and returns. The layer reaches the image in releaseLayer, which Delete calls once
// the instance's processes are gone, and which reconcile's Release calls for a state dir whose
// instance a crash left behind: either way the image gets its layer back before anything can
// restore it, and a crash in between loses nothing.

// oweLayer completes a deferred checkpoint of the instance held by pidfd: the image names the
// rootfs stack, the state dir says its layer belongs to imageDir (written durably before the
// caller may say the pause is done), and the sandbox process is killed without waiting.
func (d *Driver) oweLayer(pidfd int, stateDir, imageDir string) error {
	if err := recordStack(stateDir, imageDir); err != nil {
		return err
	}
	if err := writeDurable(filepath.Join(stateDir, layerFromName), imageDir); err != nil {
		return fmt.Errorf("gvisor: checkpoint: owe the layer to %s: %w", imageDir, err)
	}
	// Without the kill the sandbox would linger about a second.
	_ = unix.PidfdSendSignal(pidfd, unix.SIGKILL, nil, 0)
	return nil
}

// layerOwed reports whether stateDir's layer belongs to an image that still lacks it (a
// deferred checkpoint, or a resume that took the layer and has not finished).
func layerOwed(stateDir string) bool {
	if stateDir == "" {
		return false
	}
	b, err := os.ReadFile(filepath.Join(stateDir, layerFromName))
	if err != nil {
		return false
	}
	image := string(b)
	return dirExists(image) && !imageHasLayer(image) && dirExists(filepath.Join(stateDir, layerDirName))
}

// writeDurable writes content to path and syncs it.
func writeDurable(path, content string) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	_, err = f.WriteString(content)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// imageMiB is the size of imageDir's memory image file, in MiB (for the debug log).
func imageMiB(imageDir string) float64 {
	fi, err := os.Stat(filepath.Join(imageDir, "checkpoint.img"))
	if err != nil {
		return 0
	}
	return float64(fi.Size()) / (1 << 20)
}
