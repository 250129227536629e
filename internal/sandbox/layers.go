package sandbox

import (
	"context"
	"os"
	"path/filepath"
	"strings"

	"github.com/ember-sandbox/ember/internal/datadir"
	"github.com/ember-sandbox/ember/internal/overlayfs"
)

// Layer garbage collection. A template's rootfs is its own top layer (<data-dir>/templates/
// <name>/rootfs-<build>) over shared image layers; layers nothing uses any more are removed at
// start, when a template is deleted and when a rebuild replaced a template. In use: every
// directory a template's or a live (running or paused) sandbox's stack names, and every lower
// layer of an overlay mounted on the host. Builds are not accounted: a collection waits until
// none is in flight.

// buildStarted counts a template build in flight (waiting for a collection in progress to
// end); the function it returns ends it, and runs a collection that was asked for meanwhile
// once no build is left.
func (m *Manager) buildStarted() (ended func()) {
	m.gcMu.Lock()
	m.gcBuilds++
	m.gcMu.Unlock()
	return func() {
		m.gcMu.Lock()
		m.gcBuilds--
		run := m.gcBuilds == 0 && m.gcPending
		m.gcMu.Unlock()
		if run {
			m.collectLayers(context.WithoutCancel(m.bg), "after builds")
		}
	}
}

// collectLayers removes the layers nothing uses (see above). With a build in flight it only
// notes that a collection is due. Errors are logged: a layer left behind costs only disk.
func (m *Manager) collectLayers(ctx context.Context, why string) {
	m.gcMu.Lock()
	defer m.gcMu.Unlock()
	if m.gcBuilds > 0 {
		m.gcPending = true
		return
	}
	m.gcPending = false
	keep, err := m.layersInUse(ctx)
	if err != nil {
		m.log.Warn("layer gc: skipped", "why", why, "err", err)
		return
	}
	if lc, ok := m.cfg.Builder.(LayerCollector); ok {
		removed, err := lc.CollectLayers(ctx, keep)
		for _, d := range removed {
			m.log.Info("layer gc: removed unused layer", "layer", d, "why", why)
		}
		if err != nil {
			m.log.Warn("layer gc", "why", why, "err", err)
		}
	}
	m.sweepForkLayersLocked(ctx, keep, why)
	// Templates' own layers of earlier builds and of deleted templates, and what an
	// interrupted build left (rootfs-<id>.tmp, its edit mount's scratch directory).
	used := map[string]bool{}
	for _, d := range keep {
		used[d] = true
	}
	tops, _ := filepath.Glob(filepath.Join(datadir.Templates(m.cfg.DataDir), "*", "rootfs-*"))
	scratch, _ := filepath.Glob(filepath.Join(datadir.Templates(m.cfg.DataDir), "*", ".rootfs-*"))
	for _, d := range append(tops, scratch...) {
		if used[d] {
			continue
		}
		m.log.Info("layer gc: removed unused template layer", "dir", d, "why", why)
		overlayfs.RemoveTree(d, overlayfs.DetachMounts)
	}
}

// layersInUse lists the directories that templates, live sandboxes and mounted overlays stack.
func (m *Manager) layersInUse(ctx context.Context) ([]string, error) {
	tpls, err := m.cfg.Store.ListTemplates(ctx)
	if err != nil {
		return nil, err
	}
	sbs, err := m.cfg.Store.ListSandboxes(ctx)
	if err != nil {
		return nil, err
	}
	var keep []string
	for _, t := range tpls {
		keep = append(append(keep, t.RootFS), t.Lowers...)
	}
	for _, sb := range sbs {
		if sb.State != StateKilled {
			keep = append(append(keep, sb.RootFS), sb.Lowers...)
		}
	}
	// Step checkpoints' stacks (checkpoints.go).
	cks, err := m.cfg.Store.ListCheckpoints(ctx, "")
	if err != nil {
		return nil, err
	}
	for _, c := range cks {
		keep = append(append(keep, c.RootFS), c.Lowers...)
	}
	mounted, err := overlayfs.MountedLayers()
	if err != nil {
		return nil, err
	}
	for _, d := range mounted {
		if strings.HasPrefix(d, m.cfg.DataDir+string(os.PathSeparator)) {
			keep = append(keep, d)
		}
	}
	return keep, nil
}
