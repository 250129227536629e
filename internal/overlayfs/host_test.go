package overlayfs

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// mountedTree makes dir/a/b with a file, a read-only directory, and a tmpfs mounted at dir/a/m
// holding a file of its own.
func mountedTree(t *testing.T) (dir, onMount string) {
	t.Helper()
	dir = filepath.Join(t.TempDir(), "tree")
	for _, d := range []string{"a/b", "a/m", "ro"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	os.WriteFile(filepath.Join(dir, "a/b/f"), []byte("x"), 0o644)
	os.WriteFile(filepath.Join(dir, "ro/f"), []byte("x"), 0o644)
	os.Chmod(filepath.Join(dir, "ro"), 0o500)
	if err := unix.Mount("tmpfs", filepath.Join(dir, "a/m"), "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		unix.Unmount(filepath.Join(dir, "a/m"), unix.MNT_DETACH)
		os.Chmod(filepath.Join(dir, "ro"), 0o700)
	})
	onMount = filepath.Join(dir, "a/m/kept")
	if err := os.WriteFile(onMount, []byte("theirs"), 0o644); err != nil {
		t.Fatal(err)
	}
	return dir, onMount
}

// TestRemoveTreeMountPolicies: DetachMounts unmounts what is mounted in the tree and removes
// it all (read-only directories included); RefuseMounts removes nothing and says why, the
// mount's files untouched. Both are fine on a tree already gone.
func TestRemoveTreeMountPolicies(t *testing.T) {
	testutil.RequireRoot(t)
	dir, onMount := mountedTree(t)
	if err := RemoveTree(dir, RefuseMounts); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("RefuseMounts over a mount: %v, want ErrConflict", err)
	}
	if b, err := os.ReadFile(onMount); err != nil || string(b) != "theirs" {
		t.Fatalf("file on the mount after RefuseMounts: %q, %v", b, err)
	}
	if _, err := os.Stat(filepath.Join(dir, "a/b/f")); err != nil {
		t.Fatalf("RefuseMounts removed files: %v", err)
	}
	if err := RemoveTree(dir, DetachMounts); err != nil {
		t.Fatalf("DetachMounts: %v", err)
	}
	if _, err := os.Lstat(dir); !os.IsNotExist(err) {
		t.Fatalf("tree remains after DetachMounts: %v", err)
	}
	if len(MountsUnder(filepath.Dir(dir))) != 0 || MountedOn(dir) {
		t.Fatalf("mounts remain: %v", MountsUnder(filepath.Dir(dir)))
	}
	for _, p := range []MountPolicy{DetachMounts, RefuseMounts} {
		if err := RemoveTree(dir, p); err != nil {
			t.Errorf("policy %d on a missing tree: %v", p, err)
		}
	}
}

// TestRemoveTreeRefuseMountsRemovesPlainTrees: with no mount inside, RefuseMounts removes the
// tree, directories of restrictive modes included, and follows no symlink out of it.
func TestRemoveTreeRefuseMountsRemovesPlainTrees(t *testing.T) {
	base := t.TempDir()
	outside := filepath.Join(base, "outside")
	os.MkdirAll(outside, 0o755)
	os.WriteFile(filepath.Join(outside, "f"), []byte("x"), 0o644)
	dir := filepath.Join(base, "tree")
	os.MkdirAll(filepath.Join(dir, "locked/inner"), 0o755)
	os.WriteFile(filepath.Join(dir, "locked/inner/f"), []byte("x"), 0o644)
	os.Symlink(outside, filepath.Join(dir, "link"))
	os.Chmod(filepath.Join(dir, "locked/inner"), 0o500)
	os.Chmod(filepath.Join(dir, "locked"), 0o500)
	if err := RemoveTree(dir, RefuseMounts); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(dir); !os.IsNotExist(err) {
		t.Fatalf("tree remains: %v", err)
	}
	if _, err := os.Stat(filepath.Join(outside, "f")); err != nil {
		t.Fatalf("a file behind a symlink was removed: %v", err)
	}
}
