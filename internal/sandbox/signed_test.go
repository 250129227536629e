package sandbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/sandbox"
)

// Finding the sandbox a signed URL belongs to does not wait for any sandbox's lock: with one
// sandbox's checkpoint (which holds its lock) stuck, another's signature is still found at once
// (the lookup through List waited for the checkpoint).
func TestSignedByTakesNoSandboxLock(t *testing.T) {
	n := newNode(t, nil)
	n.build("base")
	a := n.create(sandbox.CreateRequest{})
	b := n.create(sandbox.CreateRequest{})
	release := make(chan struct{})
	stuck := make(chan struct{}, 1)
	n.rig.Driver.Fail = func(op, id string) error {
		if op == "Checkpoint" {
			stuck <- struct{}{}
			<-release
		}
		return nil
	}
	snapDone := make(chan struct{})
	go func() {
		defer close(snapDone)
		_, _ = n.m.Snapshot(context.Background(), a.ID, "")
	}()
	defer func() { close(release); <-snapDone }()
	<-stuck
	found := make(chan string, 1)
	go func() { found <- n.m.SignedBy(func(tok string) bool { return tok == b.AccessToken }) }()
	select {
	case id := <-found:
		if id != b.ID {
			t.Fatalf("found %q, want %s", id, b.ID)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the lookup waited for another sandbox's checkpoint")
	}
	if id := n.m.SignedBy(func(tok string) bool { return tok == a.AccessToken }); id != a.ID {
		t.Fatalf("found %q, want %s (its lock is held, its token is known)", id, a.ID)
	}
	if id := n.m.SignedBy(func(string) bool { return false }); id != "" {
		t.Fatalf("found %q for no signature", id)
	}
}
