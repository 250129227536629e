package gvisor

import (
	"fmt"
	"path/filepath"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

var _ runtime.UpperDirer = (*Driver)(nil)

// UpperDir implements runtime.UpperDirer: the upper directory of the layer a filesystem-only
// checkpoint moved into imageDir (an instance started without a disk limit).
func (d *Driver) UpperDir(imageDir string) (string, error) {
	upper := filepath.Join(imageDir, layerDirName, upperDirName)
	if err := checkLayerDir(filepath.Join(imageDir, layerDirName)); err != nil {
		return "", fmt.Errorf("gvisor: %s holds no layer directory: %v: %w", imageDir, err, errdefs.ErrNotFound)
	}
	if err := checkLayerDir(upper); err != nil {
		return "", fmt.Errorf("gvisor: %s holds no upper directory: %v: %w", imageDir, err, errdefs.ErrNotFound)
	}
	return upper, nil
}
