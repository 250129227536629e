package sandbox_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/datadir"
	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// forkLayerDirs lists the fork layers in n's data dir.
func (n *node) forkLayerDirs() []string {
	dirs, _ := filepath.Glob(filepath.Join(datadir.ForkLayers(n.cfg.DataDir), "*"))
	return dirs
}

// waitForkLayers waits (bounded) until n's data dir holds want fork layers.
func (n *node) waitForkLayers(want int) {
	n.t.Helper()
	testutil.Eventually(n.t, 5*time.Second, fmt.Sprintf("%d fork layers", want), func() bool { return len(n.forkLayerDirs()) == want })
}

// A fork over a captured layer: the children stack it over the source's stack, and it lives
// exactly as long as something stacks it (a child, a snapshot of one), across a restart.
func TestForkLayerLivesWhileStacked(t *testing.T) {
	n := newNode(t, nil)
	n.rig.Driver.SetCapturesLayers(true)
	tpl := n.build("base")
	ctx := context.Background()
	parent := n.create(sandbox.CreateRequest{})
	n.write(parent.ID, "/x", "parent")
	kids, err := n.m.Fork(ctx, parent.ID, 3, 0)
	if err != nil {
		t.Fatal(err)
	}
	layers := n.forkLayerDirs()
	if len(layers) != 1 {
		t.Fatalf("fork layers after a fork: %v", layers)
	}
	for _, k := range kids {
		if k.Err != nil {
			t.Fatal(k.Err)
		}
		sb := k.Sandbox
		if !strings.HasPrefix(sb.RootFS, layers[0]+"/") || len(sb.Lowers) != 1+len(tpl.Lowers) || sb.Lowers[0] != tpl.RootFS {
			t.Fatalf("child stack %s %v, want the fork layer over %s %v", sb.RootFS, sb.Lowers, tpl.RootFS, tpl.Lowers)
		}
		if v, _ := n.read(sb.ID, "/x"); v != "parent" {
			t.Fatalf("child reads %q", v)
		}
	}
	// The parent and two children end: the third child still stacks the layer.
	for _, id := range []string{parent.ID, kids[0].Sandbox.ID, kids[1].Sandbox.ID} {
		if err := n.m.Kill(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(100 * time.Millisecond)
	n.waitForkLayers(1)
	// A snapshot of the last child stacks it too; the child pauses; the node restarts (a host
	// restart would have unmounted the layer: it is opened again).
	last := kids[2].Sandbox.ID
	snap, err := n.m.Snapshot(ctx, last, "of-a-child")
	if err != nil {
		t.Fatal(err)
	}
	if err := n.m.Pause(ctx, last); err != nil {
		t.Fatal(err)
	}
	n.m.Close()
	if open := n.rig.Driver.OpenLayers(); len(open) != 0 {
		t.Fatalf("fork layers still open after shutdown with no instance on them: %v", open)
	}
	n.start()
	n.waitForkLayers(1)
	if open := n.rig.Driver.OpenLayers(); len(open) != 1 {
		t.Fatalf("open fork layers after the restart: %v, want the one in use", open)
	}
	if _, _, err := n.m.Connect(ctx, last, time.Minute); err != nil {
		t.Fatal(err)
	}
	if err := n.m.Kill(ctx, last); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	n.waitForkLayers(1) // the snapshot still stacks it
	if err := n.m.DeleteTemplate(ctx, snap.ID); err != nil {
		t.Fatal(err)
	}
	n.waitForkLayers(0)
}

// A fork whose every child fails leaves no fork layer; one a crash cut (the layer captured, no
// child recorded) is removed at the next start.
func TestForkLayerOfNoChildIsRemoved(t *testing.T) {
	n := newNode(t, nil)
	n.rig.Driver.SetCapturesLayers(true)
	n.build("base")
	ctx := context.Background()
	parent := n.create(sandbox.CreateRequest{})
	n.rig.Driver.Fail = func(op, id string) error {
		if op == "Restore" || op == "RestoreInto" {
			return errors.New("injected")
		}
		return nil
	}
	if _, err := n.m.Fork(ctx, parent.ID, 2, 0); err == nil {
		t.Fatal("fork with every restore failing succeeded")
	}
	n.rig.Driver.Fail = nil
	n.waitForkLayers(0)
	// What a kill -9 between the capture and the children's records leaves.
	cut := filepath.Join(datadir.ForkLayers(n.cfg.DataDir), "fork-cut")
	if err := os.MkdirAll(filepath.Join(cut, "layer", "upper"), 0o700); err != nil {
		t.Fatal(err)
	}
	n.restart()
	n.waitForkLayers(0)
}
