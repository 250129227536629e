package gvisor

import (
	"context"
	"fmt"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

// Wait implements runtime.Driver. (Placeholder: replaced by the exit watcher.)
func (d *Driver) Wait(ctx context.Context, id string) (runtime.Exit, error) {
	<-ctx.Done()
	return runtime.Exit{}, ctx.Err()
}

// ExportImage implements runtime.Driver. (Placeholder.)
func (d *Driver) ExportImage(ctx context.Context, imageDir, dstDir string) error {
	return fmt.Errorf("gvisor: export image: %w", errdefs.ErrUnavailable)
}

// ImportImage implements runtime.Driver. (Placeholder.)
func (d *Driver) ImportImage(ctx context.Context, srcDir, imageDir string, opts runtime.ImportOptions) error {
	return fmt.Errorf("gvisor: import image: %w", errdefs.ErrUnavailable)
}
