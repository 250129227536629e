package sandboxtest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

var _ runtime.LayerCapturer = (*Driver)(nil)

// captureState is the fake's record of captured layers: which ones are open ("mounted").
type captureState struct {
	mu sync.Mutex
	// on: CapturesLayers answers true (SetCapturesLayers).
	on   bool
	open map[string]bool
}

func (d *Driver) capture() *captureState {
	c := &d.layers
	c.mu.Lock()
	if c.open == nil {
		c.open = map[string]bool{}
	}
	c.mu.Unlock()
	return c
}

// SetCapturesLayers makes the driver a LayerCapturer (off by default: forks copy layers).
func (d *Driver) SetCapturesLayers(on bool) {
	c := d.capture()
	c.mu.Lock()
	c.on = on
	c.mu.Unlock()
}

// CapturesLayers implements runtime.LayerCapturer.
func (d *Driver) CapturesLayers() bool {
	c := d.capture()
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.on
}

// OpenLayers lists the captured layers that are open.
func (d *Driver) OpenLayers() []string {
	c := d.capture()
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []string
	for l, ok := range c.open {
		if ok {
			out = append(out, l)
		}
	}
	return out
}

// CheckpointToLayer implements runtime.LayerCapturer: a Checkpoint with LeaveRunning (the
// fake's image carries the files itself) and layerDir/top, open.
func (d *Driver) CheckpointToLayer(ctx context.Context, id, imageDir, layerDir string) (string, error) {
	if err := d.fail("CheckpointToLayer", id); err != nil {
		return "", err
	}
	if err := d.Checkpoint(ctx, id, imageDir, runtime.CheckpointOptions{LeaveRunning: true}); err != nil {
		return "", err
	}
	if err := os.Mkdir(layerDir, 0o700); err != nil {
		return "", fmt.Errorf("fake: capture: %w", err)
	}
	top := filepath.Join(layerDir, "layer", "upper") // as the gvisor driver places it
	if err := os.MkdirAll(top, 0o700); err != nil {
		return "", err
	}
	c := d.capture()
	c.mu.Lock()
	c.open[layerDir] = true
	c.mu.Unlock()
	return top, nil
}

// OpenCapturedLayer implements runtime.LayerCapturer.
func (d *Driver) OpenCapturedLayer(ctx context.Context, layerDir string) (string, error) {
	if err := d.fail("OpenCapturedLayer", layerDir); err != nil {
		return "", err
	}
	top := filepath.Join(layerDir, "layer", "upper") // as the gvisor driver places it
	if _, err := os.Stat(top); err != nil {
		return "", fmt.Errorf("fake: open %s: %v: %w", layerDir, err, errdefs.ErrNotFound)
	}
	c := d.capture()
	c.mu.Lock()
	c.open[layerDir] = true
	c.mu.Unlock()
	return top, nil
}

// CloseCapturedLayer implements runtime.LayerCapturer.
func (d *Driver) CloseCapturedLayer(ctx context.Context, layerDir string) error {
	c := d.capture()
	c.mu.Lock()
	delete(c.open, layerDir)
	c.mu.Unlock()
	return nil
}

// RemoveCapturedLayer implements runtime.LayerCapturer.
func (d *Driver) RemoveCapturedLayer(ctx context.Context, layerDir string) error {
	if err := d.fail("RemoveCapturedLayer", layerDir); err != nil {
		return err
	}
	c := d.capture()
	c.mu.Lock()
	delete(c.open, layerDir)
	c.mu.Unlock()
	if err := os.RemoveAll(layerDir); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}
