package drivertest

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

// layeredStack makes a rootfs of three read-only layers on top of the suite's rootfs (top
// first): the middle one adds files, the top one adds its own and hides some of the middle's
// with an overlay whiteout and an opaque directory. It returns the stack's directories.
func layeredStack(t *testing.T, base string) (top string, lowers []string) {
	t.Helper()
	dir := t.TempDir()
	mid := filepath.Join(dir, "mid")
	top = filepath.Join(dir, "top")
	write := func(root, rel, content string) {
		p := filepath.Join(root, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(mid, "etc/mid", "mid\n")
	write(mid, "data/gone", "hidden by a whiteout\n")
	write(mid, "data/kept", "kept\n")
	write(mid, "data/opq/old", "hidden by an opaque directory\n")
	write(top, "etc/top", "top\n")
	write(top, "data/opq/new", "new\n")
	if err := unix.Mknod(filepath.Join(top, "data/gone"), unix.S_IFCHR|0o600, 0); err != nil {
		t.Fatalf("whiteout: %v", err)
	}
	if err := unix.Setxattr(filepath.Join(top, "data/opq"), "trusted.overlay.opaque", []byte("y"), 0); err != nil {
		t.Fatalf("opaque: %v", err)
	}
	for _, d := range []string{mid, top} {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return top, []string{mid, base}
}

// testLayeredRootFS: a rootfs given as a stack of layers (Spec.Lowers) is seen merged, with the
// top layers' whiteouts and opaque directories applied; it stays merged across a pause and
// resume and in a fork's child; no layer is ever written.
func (s *suite) testLayeredRootFS(t *testing.T) {
	e := s.env(t)
	top, lowers := layeredStack(t, e.rootfs)
	digests := map[string]string{}
	for _, l := range []string{top, lowers[0]} {
		digests[l] = treeDigest(t, l)
	}
	t.Cleanup(func() {
		for l, d := range digests {
			if treeDigest(t, l) != d {
				t.Errorf("layer %s was modified by the driver", l)
			}
		}
	})
	sp := e.spec()
	sp.RootFS, sp.Lowers = top, lowers
	if err := e.d.Start(ctx(t), sp); err != nil {
		t.Fatalf("Start on a stack of %d layers: %v", 1+len(lowers), err)
	}
	e.track(sp.ID)
	const check = "cat /etc/top /etc/mid /data/kept /data/opq/new; echo $(ls /data) $(ls /data/opq); test -e /data/gone && echo GONE-VISIBLE; test -e /data/opq/old && echo OLD-VISIBLE; true"
	const want = "top\nmid\nkept\nnew\nkept opq new\n"
	if got := e.sh(sp.ID, 0, check); got != want {
		t.Fatalf("merged stack: got %q, want %q", got, want)
	}
	e.sh(sp.ID, 0, "echo mine > /data/opq/mine && rm /etc/mid")

	// Pause and resume on the same stack.
	img := t.TempDir()
	if err := e.d.Checkpoint(ctx(t), sp.ID, img, runtime.CheckpointOptions{}); err != nil {
		t.Fatalf("Checkpoint: %v", err)
	}
	resumed := sp
	resumed.StateDir = filepath.Join(t.TempDir(), "resumed")
	e.restore(resumed, img)
	if got := e.sh(sp.ID, 0, "cat /data/opq/mine /etc/top; test -e /etc/mid || echo removed"); got != "mine\ntop\nremoved\n" {
		t.Errorf("after resume: %q", got)
	}

	// A fork's child on the same stack.
	img2 := t.TempDir()
	if err := e.d.Checkpoint(ctx(t), sp.ID, img2, runtime.CheckpointOptions{LeaveRunning: true}); err != nil {
		t.Fatalf("Checkpoint (leave running): %v", err)
	}
	child := e.spec()
	child.RootFS, child.Lowers = top, lowers
	e.restore(child, img2)
	got := e.sh(child.ID, 0, "cat /data/opq/mine; ls /data | tr '\\n' ' '")
	if !strings.HasPrefix(got, "mine\n") || strings.Contains(got, "gone") {
		t.Errorf("fork child: %q", got)
	}

	// The image restores only onto the stack it was checkpointed on.
	other := e.spec()
	other.RootFS, other.Lowers = lowers[0], lowers[1:]
	if err := e.d.Restore(ctx(t), other, img2); !errors.Is(err, errdefs.ErrInvalid) {
		e.track(other.ID)
		t.Errorf("Restore onto another stack: %v, want ErrInvalid", err)
	}
}
