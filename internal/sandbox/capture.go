package sandbox

import (
	"context"
	"time"

	"github.com/ember-sandbox/ember/internal/runtime"
)

// captureRunningLocked is the one way a running sandbox is captured while it keeps running:
// snapshots, forks and step checkpoints all go through it (issue 17). It checkpoints e's
// instance into image (existing, empty). With layerDir (and a driver that captures layers:
// forklayers.go) the instance's writable layer goes to layerDir as a read-only layer, and top
// is its root (the image restores onto top over the sandbox's stack); with layerDir "" or a
// driver that cannot, the image holds a copy of the layer and top is "". stopped is how long
// the sandbox's processes were stopped for it (0 when the driver does not say). e.mu is held
// and the sandbox runs.
func (m *Manager) captureRunningLocked(ctx context.Context, e *entry, image, layerDir string) (top string, stopped time.Duration, err error) {
	sw := &runtime.StopWatch{}
	ctx = runtime.WithStopWatch(ctx, sw)
	inst := e.sb.Runtime.InstanceID
	if lc := m.layerCapturer(); lc != nil && layerDir != "" {
		top, err = lc.CheckpointToLayer(ctx, inst, image, layerDir)
	} else {
		err = m.cfg.Driver.Checkpoint(ctx, inst, image, runtime.CheckpointOptions{LeaveRunning: true})
	}
	return top, sw.Stopped(), err
}
