package sandbox_test

import (
	"context"
	"testing"

	"github.com/ember-sandbox/ember/internal/sandbox"
)

// A snapshot does not carry the live sandbox's envd token: its image's envd holds a token of
// the snapshot's own (its InitToken), the source sandbox keeps its own token afterwards, and
// sandboxes from the snapshot start (their /init authenticates with the snapshot's token).
func TestSnapshotHasItsOwnToken(t *testing.T) {
	n := newNode(t, nil)
	n.build("base")
	src := n.create(sandbox.CreateRequest{})
	n.write(src.ID, "/x", "before")
	var imageToken string
	n.rig.Driver.Fail = func(op, id string) error {
		if op == "Checkpoint" {
			imageToken = n.rig.Driver.Token(id)
		}
		return nil
	}
	snap, err := n.m.Snapshot(context.Background(), src.ID, "own-token")
	if err != nil {
		t.Fatal(err)
	}
	n.rig.Driver.Fail = nil
	if snap.InitToken == "" || snap.InitToken == src.AccessToken {
		t.Fatalf("snapshot init token %q, source's %q: want a token of its own", snap.InitToken, src.AccessToken)
	}
	if imageToken != snap.InitToken {
		t.Fatalf("envd held %q at the checkpoint, want the snapshot's %q", imageToken, snap.InitToken)
	}
	// The source answers with its own token again.
	if v, err := n.read(src.ID, "/x"); err != nil || v != "before" {
		t.Fatalf("source after the snapshot: %q %v", v, err)
	}
	got, err := n.m.Get(context.Background(), src.ID)
	if err != nil || got.AccessToken != src.AccessToken {
		t.Fatalf("source token changed: %v", err)
	}
	from := n.create(sandbox.CreateRequest{TemplateID: snap.ID})
	if v, err := n.read(from.ID, "/x"); err != nil || v != "before" {
		t.Fatalf("sandbox from the snapshot reads %q %v", v, err)
	}
	if from.AccessToken == snap.InitToken || from.AccessToken == src.AccessToken {
		t.Fatal("the sandbox from the snapshot shares a token")
	}
}
