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
//
// The record is written, not synced: what it guards against is a crash of the daemon (kill -9),
// which keeps the page cache. Against a power loss a sync of it alone would guarantee nothing:
// neither runsc's memory image nor the layer's files are synced either.
func (d *Driver) oweLayer(pidfd int, stateDir, imageDir string) error {
	if err := recordStack(stateDir, imageDir); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(stateDir, layerFromName), []byte(imageDir), 0o600); err != nil {
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

// imageMiB is the size of imageDir's memory image file, in MiB (for the debug log).
func imageMiB(imageDir string) float64 {
	fi, err := os.Stat(filepath.Join(imageDir, "checkpoint.img"))
	if err != nil {
		return 0
	}
	return float64(fi.Size()) / (1 << 20)
}
