package gvisor

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/overlayfs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

var _ runtime.UpperDirer = (*Driver)(nil)

// UpperDir implements runtime.UpperDirer: the upper directory of the layer a checkpoint moved
// into imageDir. A disk-limited layer (an ext4 image, quota.go) is made a plain one first: its
// files copied out of the image (mounted read-only), the image removed, so the result is a
// host directory like any layer's, and an image restored from it starts unlimited as before.
func (d *Driver) UpperDir(imageDir string) (string, error) {
	layer := filepath.Join(imageDir, layerDirName)
	if hasDiskImage(layer) && !overlayfs.IsMountPoint(layer) {
		if err := plainLayer(imageDir); err != nil {
			return "", err
		}
	}
	upper := filepath.Join(layer, upperDirName)
	if err := checkLayerDir(layer); err != nil {
		return "", fmt.Errorf("gvisor: %s holds no layer directory: %v: %w", imageDir, err, errdefs.ErrNotFound)
	}
	if err := checkLayerDir(upper); err != nil {
		return "", fmt.Errorf("gvisor: %s holds no upper directory: %v: %w", imageDir, err, errdefs.ErrNotFound)
	}
	return upper, nil
}

// plainLayer replaces the disk-limited layer in imageDir by a plain directory of its files.
func plainLayer(imageDir string) error {
	layer := filepath.Join(imageDir, layerDirName)
	plain := filepath.Join(imageDir, ".plain-"+layerDirName)
	_ = overlayfs.RemoveTree(plain, overlayfs.DetachMounts) // a conversion a crash cut
	if err := os.Mkdir(plain, 0o700); err != nil {
		return fmt.Errorf("gvisor: plain layer: %w", err)
	}
	err := DiskLayerFiles(imageDir, imageDir, func(upper string) error {
		out, err := exec.Command("cp", "-a", "--", upper, filepath.Join(plain, upperDirName)).CombinedOutput()
		if err != nil {
			return fmt.Errorf("gvisor: plain layer: copy out: %v: %s", err, strings.TrimSpace(string(out)))
		}
		return nil
	})
	if err == nil {
		old := layer + ".disk"
		if err = os.Rename(layer, old); err == nil {
			if err = os.Rename(plain, layer); err != nil {
				_ = os.Rename(old, layer)
			} else {
				_ = overlayfs.RemoveTree(old, overlayfs.DetachMounts)
			}
		}
	}
	if err != nil {
		_ = overlayfs.RemoveTree(plain, overlayfs.DetachMounts)
	}
	return err
}
