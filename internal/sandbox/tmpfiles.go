package sandbox

import (
	"github.com/ember-sandbox/ember/internal/datadir"
	"github.com/ember-sandbox/ember/internal/overlayfs"
	"path/filepath"
)

// sweepTemporaries removes, at start, what interrupted builds, exports and fetches left in the
// data directory (nothing of this process is in flight yet): uploads and normalised COPY
// archives being written (build-files/.tmp-*), layer and image exports being staged
// (remote/.export-*, .<image>.export-* beside an image) and store fetches being unpacked
// (.<dest>.fetching-* beside their destination).
func (m *Manager) sweepTemporaries() {
	d := m.cfg.DataDir
	var found []string
	add := func(parts ...string) {
		ms, _ := filepath.Glob(filepath.Join(parts...))
		found = append(found, ms...)
	}
	add(datadir.BuildFiles(d), ".tmp-*")
	for _, parent := range []string{datadir.Remote(d), datadir.RemoteImages(d), datadir.Images(d),
		filepath.Join(datadir.Sandboxes(d), "*"), filepath.Join(datadir.Templates(d), "*")} {
		add(parent, ".export-*")
		add(parent, ".*.export-*")
		add(parent, ".*.fetching-*")
	}
	for _, p := range found {
		m.log.Info("removed a temporary file an interrupted operation left", "path", p)
		overlayfs.RemoveTree(p, overlayfs.DetachMounts)
	}
}
