package sandbox

import (
	"context"
	"os"
	"path/filepath"
	"strings"

	"github.com/ember-sandbox/ember/internal/datadir"
	"github.com/ember-sandbox/ember/internal/overlayfs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

// Fork layers. With a driver that captures layers (runtime.LayerCapturer), a fork does not copy
// the source's writable layer into every child: it captures it once, read-only, under
// <data-dir>/forks/<id>, and each child stacks a fresh empty writable layer over it (the child's
// stack: the captured layer, then the source's stack). The source keeps running on its own
// layer, so what it writes afterwards reaches no child; a child's writes and deletes (overlay
// whiteouts over the captured layer) are its own.
//
// A fork layer lives while anything stacks it: a live (running or paused) child, a snapshot
// of one, a grandchild's stack. Layer collection (layers.go) counts it like any other layer:
// it runs at start (after reconcile: what a crash cut leaves unused is removed then), with
// every other collection, and when a sandbox that stacks a fork layer ends. A fork in flight
// counts as a build, so no collection removes its layer before its children are recorded.

// layerCapturer returns the driver's LayerCapturer when it can capture layers, else nil.
func (m *Manager) layerCapturer() runtime.LayerCapturer {
	lc, ok := m.cfg.Driver.(runtime.LayerCapturer)
	if !ok || !lc.CapturesLayers() {
		return nil
	}
	return lc
}

// ForkCopiesLayers, on, makes later forks give each child a copy of the source's layer instead
// of a layer over the captured one, as forks did before fork layers: the baseline benchmarks
// measure fork layers against. Fork layers that exist are handled either way.
func (m *Manager) ForkCopiesLayers(on bool) { m.forkCopies.Store(on) }

// stacksForkLayer reports whether sb's stack holds a fork layer of this node.
func (m *Manager) stacksForkLayer(sb *Sandbox) bool {
	prefix := datadir.ForkLayers(m.cfg.DataDir) + string(os.PathSeparator)
	for _, d := range append([]string{sb.RootFS}, sb.Lowers...) {
		if strings.HasPrefix(d, prefix) {
			return true
		}
	}
	return false
}

// forkLayerUserEnded runs a collection of fork layers in the background when sb, which just
// ended, stacked one (it may have been the last user).
func (m *Manager) forkLayerUserEnded(sb *Sandbox) {
	if !m.stacksForkLayer(sb) {
		return
	}
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		m.collectForkLayers(context.WithoutCancel(m.bg), "a sandbox stacking a fork layer ended")
	}()
}

// collectForkLayers is collectLayers for fork layers only.
func (m *Manager) collectForkLayers(ctx context.Context, why string) {
	m.gcMu.Lock()
	defer m.gcMu.Unlock()
	if m.gcBuilds > 0 {
		m.gcPending = true
		return
	}
	keep, err := m.layersInUse(ctx)
	if err != nil {
		m.log.Warn("layer gc: skipped", "why", why, "err", err)
		return
	}
	m.sweepForkLayersLocked(ctx, keep, why)
}

// sweepForkLayersLocked removes the fork layers no directory of keep is inside, and opens the
// others (a host restart unmounted them). gcMu is held.
func (m *Manager) sweepForkLayersLocked(ctx context.Context, keep []string, why string) {
	dirs, _ := filepath.Glob(filepath.Join(datadir.ForkLayers(m.cfg.DataDir), "*"))
	if len(dirs) == 0 {
		return
	}
	lc := m.layerCapturer()
	for _, d := range dirs {
		used := inside(keep, d)
		switch {
		case lc == nil:
			m.log.Warn("layer gc: fork layer kept, the driver cannot handle it", "dir", d)
		case used:
			if _, err := lc.OpenCapturedLayer(ctx, d); err != nil {
				m.log.Warn("layer gc: open fork layer", "dir", d, "err", err)
			}
		default:
			if err := lc.RemoveCapturedLayer(ctx, d); err != nil {
				m.log.Warn("layer gc: remove fork layer", "dir", d, "why", why, "err", err)
				continue
			}
			m.log.Info("layer gc: removed unused fork layer", "dir", d, "why", why)
		}
	}
}

// closeForkLayers, at shutdown, releases what the fork layers no mounted overlay stacks hold
// on the host (their mounts); the next start opens those still in use.
func (m *Manager) closeForkLayers() {
	lc := m.layerCapturer()
	dirs, _ := filepath.Glob(filepath.Join(datadir.ForkLayers(m.cfg.DataDir), "*"))
	if lc == nil || len(dirs) == 0 {
		return
	}
	mounted, err := overlayfs.MountedLayers()
	if err != nil {
		m.log.Warn("shutdown: fork layers left open", "err", err)
		return
	}
	ctx := context.Background()
	for _, d := range dirs {
		if inside(mounted, d) {
			continue
		}
		if err := lc.CloseCapturedLayer(ctx, d); err != nil {
			m.log.Warn("shutdown: close fork layer", "dir", d, "err", err)
		}
	}
}

// inside reports whether one of dirs is inside dir.
func inside(dirs []string, dir string) bool {
	for _, k := range dirs {
		if strings.HasPrefix(k, dir+string(os.PathSeparator)) {
			return true
		}
	}
	return false
}
