package sandbox_test

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/datadir"
	"github.com/ember-sandbox/ember/internal/overlayfs"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// TestKillTeardownRemovesDirAndMountsAndRunsTwice: a kill's teardown removes the sandbox's
// directory itself, with what is still mounted in it (as root: a mount left in the instance's
// directory, as a crashed launch leaves its rootfs); run again on the same placement it finds
// nothing to do, and the node stays usable.
func TestKillTeardownRemovesDirAndMountsAndRunsTwice(t *testing.T) {
	n := newNode(t, nil)
	n.build("base")
	sb := n.create(sandbox.CreateRequest{})
	dir := datadir.Sandbox(n.cfg.DataDir, sb.ID)
	if !slices.Contains(n.sandboxDirs(), sb.ID) {
		t.Fatalf("no directory for the running sandbox: %v", n.sandboxDirs())
	}
	if os.Geteuid() == 0 {
		mnt := filepath.Join(dir, "left-mount")
		os.MkdirAll(mnt, 0o700)
		if err := unix.Mount("tmpfs", mnt, "tmpfs", 0, "size=1m"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { unix.Unmount(mnt, unix.MNT_DETACH) })
	}
	if err := n.m.Kill(context.Background(), sb.ID); err != nil {
		t.Fatal(err)
	}
	check := func(when string) {
		t.Helper()
		n.assertHolds(0)
		if dirs := n.sandboxDirs(); len(dirs) != 0 {
			t.Fatalf("%s: sandbox dirs left: %v", when, dirs)
		}
		if ms := overlayfs.MountsUnder(dir); len(ms) != 0 {
			t.Fatalf("%s: mounts left in the sandbox's directory: %v", when, ms)
		}
	}
	check("after kill")
	n.m.TeardownSandbox(context.Background(), sb.ID, sb.Runtime)
	check("after a second teardown")
	other := n.create(sandbox.CreateRequest{})
	n.write(other.ID, "/a", "1")
	n.assertHolds(1)
}
