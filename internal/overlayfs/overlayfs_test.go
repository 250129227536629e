package overlayfs

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/ember-sandbox/ember/internal/testutil"
)

// TestMountManyLayers: a stack of more layers than one mount(2) option string can name mounts
// (one lowerdir+ per layer), merges top first, and is listed by MountedLayers.
func TestMountManyLayers(t *testing.T) {
	testutil.RequireRoot(t)
	base := t.TempDir()
	var lowers []string
	for i := range 80 {
		d := filepath.Join(base, strings.Repeat("l", 60)+"-"+string(rune('a'+i/26))+string(rune('a'+i%26)))
		os.MkdirAll(d, 0o755)
		os.WriteFile(filepath.Join(d, "which"), []byte(filepath.Base(d)), 0o644)
		os.WriteFile(filepath.Join(d, "only-"+filepath.Base(d)), nil, 0o644)
		lowers = append(lowers, d)
	}
	if n := len(strings.Join(lowers, ":")); n < os.Getpagesize() {
		t.Fatalf("test stack too short: %d bytes", n)
	}
	m, u, w := filepath.Join(base, "m"), filepath.Join(base, "u"), filepath.Join(base, "w")
	for _, d := range []string{m, u, w} {
		os.Mkdir(d, 0o755)
	}
	if err := Mount(m, lowers, u, w); err != nil {
		t.Fatal(err)
	}
	defer Unmount(m)
	if b, _ := os.ReadFile(filepath.Join(m, "which")); string(b) != filepath.Base(lowers[0]) {
		t.Errorf("top layer's file = %q, want %q", b, filepath.Base(lowers[0]))
	}
	if e, _ := os.ReadDir(m); len(e) != 81 {
		t.Errorf("merged entries: %d, want 81", len(e))
	}
	got, err := MountedLayers()
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range lowers {
		if !slices.Contains(got, l) {
			t.Fatalf("MountedLayers lacks %s", l)
		}
	}
}
