package gvisor

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

// relativeTo names layers by their path beneath root (as the daemon does with its data dir).
func relativeTo(root string) func(string) string {
	return func(p string) string {
		if rel, err := filepath.Rel(root, p); err == nil && !strings.HasPrefix(rel, "..") && filepath.IsAbs(p) {
			return rel
		}
		return p
	}
}

// A checkpoint taken on one node restores on another whose copy of the same layers lives
// under another data directory; never onto other layers.
func TestCheckStackComparesLayerIdentities(t *testing.T) {
	a, b := t.TempDir(), t.TempDir()
	image := t.TempDir()
	if err := os.WriteFile(filepath.Join(image, "checkpoint.img"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	onA := &Driver{cfg: Config{LayerIdentity: relativeTo(a)}}
	state := t.TempDir()
	stack := []string{filepath.Join(a, "templates/base/rootfs-1"), filepath.Join(a, "layers/sha256-aa/root")}
	if err := os.WriteFile(filepath.Join(state, stackName), []byte(strings.Join(onA.stackIDs(stack), "\n")), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := recordStack(state, image); err != nil {
		t.Fatal(err)
	}
	onB := &Driver{cfg: Config{LayerIdentity: relativeTo(b)}}
	same := runtime.Spec{RootFS: filepath.Join(b, "templates/base/rootfs-1"), Lowers: []string{filepath.Join(b, "layers/sha256-aa/root")}}
	if err := onB.checkStack(same, image); err != nil {
		t.Fatalf("the same layers under another data dir: %v", err)
	}
	other := runtime.Spec{RootFS: filepath.Join(b, "templates/base/rootfs-2"), Lowers: same.Lowers}
	if err := onB.checkStack(other, image); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("another build's layer: %v, want ErrInvalid", err)
	}
	// An image of an older driver recorded host paths: the same layers still match.
	if err := os.WriteFile(filepath.Join(image, stackName), []byte(strings.Join(stack, "\n")), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := onA.checkStack(runtime.Spec{RootFS: stack[0], Lowers: stack[1:]}, image); err != nil {
		t.Fatalf("host paths recorded by an older driver: %v", err)
	}
}

// A layer goes through ExportTree and ImportTree with its files, links and whiteouts.
func TestTreeRoundTrip(t *testing.T) {
	src := t.TempDir()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(src, "etc"), 0o755))
	must(os.WriteFile(filepath.Join(src, "etc", "hostname"), []byte("ember\n"), 0o644))
	must(os.Symlink("hostname", filepath.Join(src, "etc", "name")))
	must(os.Link(filepath.Join(src, "etc", "hostname"), filepath.Join(src, "etc", "hard")))
	must(unix.Mknod(filepath.Join(src, "gone"), unix.S_IFCHR, 0))
	d := &Driver{}
	archive := filepath.Join(t.TempDir(), "tree.tar")
	must(d.ExportTree(context.Background(), src, archive))
	dst := filepath.Join(t.TempDir(), "imported")
	tree, err := d.ImportTree(context.Background(), archive, dst, runtime.ImportOptions{MaxBytes: 1 << 20})
	must(err)
	if b, err := os.ReadFile(filepath.Join(tree, "etc", "name")); err != nil || string(b) != "ember\n" {
		t.Fatalf("through the symlink: %q %v", b, err)
	}
	var st unix.Stat_t
	must(unix.Lstat(filepath.Join(tree, "etc", "hard"), &st))
	if st.Nlink != 2 {
		t.Fatalf("hard link: nlink %d", st.Nlink)
	}
	must(unix.Lstat(filepath.Join(tree, "gone"), &st))
	if st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != 0 {
		t.Fatalf("whiteout: mode %o rdev %d", st.Mode, st.Rdev)
	}
	if _, err := d.ImportTree(context.Background(), archive, dst+"2", runtime.ImportOptions{MaxBytes: 3}); err == nil {
		t.Fatal("an archive over MaxBytes imported")
	}
	if _, err := os.Lstat(dst + "2"); !os.IsNotExist(err) {
		t.Fatalf("a failed import left %s: %v", dst+"2", err)
	}
}

// A pause image carries the caller's completeness markers (dot files) beside runsc's files:
// exporting it (to move it to another node) leaves them out instead of failing.
func TestExportImageLeavesMarkersOut(t *testing.T) {
	img := t.TempDir()
	for _, n := range []string{"checkpoint.img", ".ember-complete", ".snapshot-complete"} {
		if err := os.WriteFile(filepath.Join(img, n), []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	exp := t.TempDir()
	if err := (&Driver{}).ExportImage(context.Background(), img, exp); err != nil {
		t.Fatalf("ExportImage: %v", err)
	}
	ents, err := os.ReadDir(exp)
	if err != nil || len(ents) != 1 || ents[0].Name() != "checkpoint.img" {
		t.Fatalf("exported %v (%v), want checkpoint.img alone", ents, err)
	}
}
