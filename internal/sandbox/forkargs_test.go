package sandbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// Every fork path checks its timeout the same way: a negative one, or one over MaxTimeout, is
// refused (ErrInvalid, a 400) before anything is restored. ForkFrom (the children of a fork
// placed on another node) used to replace it with the default timeout instead.
func TestEveryForkPathRefusesABadTimeout(t *testing.T) {
	n := newNode(t, nil)
	n.build("base")
	sb := n.create(sandbox.CreateRequest{})
	ctx := context.Background()
	n.m.CheckpointStandby(false) // no standby instance: the node holds sb alone
	ck, err := n.m.Checkpoint(ctx, sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	pf := &sandbox.PortableFork{Parent: *sb, ImageID: "fork-x"}
	for _, bad := range []time.Duration{-time.Second, sandbox.MaxTimeout + time.Second} {
		paths := map[string]func() error{
			"Fork": func() error { _, err := n.m.Fork(ctx, sb.ID, 1, bad); return err },
			"ForkCheckpoint": func() error {
				_, err := n.m.ForkCheckpoint(ctx, sb.ID, ck.ID, 1, bad)
				return err
			},
			"ForkFrom": func() error { _, err := n.m.ForkFrom(ctx, pf, 1, bad, nil); return err },
		}
		for name, fork := range paths {
			if err := fork(); !errors.Is(err, errdefs.ErrInvalid) {
				t.Errorf("%s with timeout %s: %v, want ErrInvalid", name, bad, err)
			}
		}
	}
	n.assertHolds(1) // only sb: no child was started
}
