package sandbox

import (
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
	add := func(pattern string) {
		ms, _ := filepath.Glob(filepath.Join(d, pattern))
		found = append(found, ms...)
	}
	add("build-files/.tmp-*")
	for _, parent := range []string{"remote", "remote/images", "images", "sandboxes/*", "templates/*"} {
		add(parent + "/.export-*")
		add(parent + "/.*.export-*")
		add(parent + "/.*.fetching-*")
	}
	for _, p := range found {
		m.log.Info("removed a temporary file an interrupted operation left", "path", p)
		overlayfs.RemoveTree(p)
	}
}
