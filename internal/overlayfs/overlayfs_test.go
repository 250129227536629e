package overlayfs

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/ember-sandbox/ember/internal/errdefs"
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

// TestLegacyMount: without lowerdir+ (kernels before 6.8) a stack that fits one mount(2) option
// mounts; a longer one fails clearly instead of being cut.
func TestLegacyMount(t *testing.T) {
	testutil.RequireRoot(t)
	base := t.TempDir()
	var lowers []string
	for i := range 80 {
		d := filepath.Join(base, strings.Repeat("l", 60)+string(rune('a'+i/26))+string(rune('a'+i%26)))
		os.MkdirAll(d, 0o755)
		lowers = append(lowers, d)
	}
	os.WriteFile(filepath.Join(lowers[1], "f"), []byte("below"), 0o644)
	m := filepath.Join(base, "m")
	os.Mkdir(m, 0o755)
	if err := mountLegacy(m, lowers[:2], "", ""); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(m, "f")); string(b) != "below" {
		t.Errorf("merged f = %q", b)
	}
	Unmount(m)
	err := mountLegacy(m, lowers, "", "")
	if !errors.Is(err, errdefs.ErrInvalid) || !strings.Contains(err.Error(), "lowerdir+") {
		t.Fatalf("a stack too long for mount(2): %v", err)
	}
}

func TestUnescapeMount(t *testing.T) {
	for in, want := range map[string]string{
		`/plain`:             `/plain`,
		`/a\040b`:            `/a b`,
		`/tab\011x\134y`:     "/tab\tx\\y",
		`/end\040`:           `/end `,
		`/short\04`:          `/short\04`,
		`/not\08x`:           `/not\08x`,
		`\`:                  `\`,
		`/two\040\040spaces`: `/two  spaces`,
	} {
		if got := UnescapeMount(in); got != want {
			t.Errorf("UnescapeMount(%q) = %q, want %q", in, got, want)
		}
	}
}
