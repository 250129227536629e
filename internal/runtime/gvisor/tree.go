package gvisor

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

// Read-only layers of a rootfs (a template's top layer, an image's layers) travel between
// nodes in the layer archive format of exported images (image.go): ExportTree writes one,
// ImportTree unpacks one as untrusted input, with the same rules.

// ExportTree writes the layer directory dir (overlayfs layer format: whiteouts, opaque
// directories) as a layer archive into the new file dst.
func (d *Driver) ExportTree(ctx context.Context, dir, dst string) error {
	return exportLayer(ctx, dir, dst)
}

// ImportTree unpacks the layer archive src (untrusted) into the new directory dir and returns
// where the layer's files are (beneath dir). On error nothing is left at dir.
func (d *Driver) ImportTree(ctx context.Context, src, dir string, opts runtime.ImportOptions) (_ string, err error) {
	if !filepath.IsAbs(dir) {
		return "", fmt.Errorf("gvisor: import tree: %q must be absolute: %w", dir, errdefs.ErrInvalid)
	}
	if err := os.Mkdir(dir, 0o700); err != nil {
		return "", fmt.Errorf("gvisor: import tree: %w", err)
	}
	defer func() {
		if err != nil {
			_ = RemoveLayer(dir)
			_ = os.RemoveAll(dir)
		}
	}()
	limit := int64(-1)
	if opts.MaxBytes > 0 {
		limit = opts.MaxBytes
	}
	if err := importLayer(ctx, src, dir, &limit); err != nil {
		return "", err
	}
	return TreeDir(dir), nil
}

// TreeDir is where ImportTree into dir puts the layer's files.
func TreeDir(dir string) string { return filepath.Join(dir, layerDirName, upperDirName) }
