package sandbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/sandbox"
)

var errInjected = errors.New("injected")

// Every lifecycle stage reaches the Config's Observer once per run, with failures marked.
func TestManagerReportsStages(t *testing.T) {
	obs := &stages{}
	fail := false
	n := newNode(t, func(c *sandbox.Config) {
		c.Observer = obs
		c.Fail = func(point string) error {
			if fail {
				return errInjected
			}
			return nil
		}
	})
	ctx := context.Background()
	n.build("base")
	sb := n.create(sandbox.CreateRequest{})
	n.create(sandbox.CreateRequest{Cold: true})
	if err := n.m.Pause(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	if _, _, err := n.m.Connect(ctx, sb.ID, time.Minute); err != nil {
		t.Fatal(err)
	}
	if _, err := n.m.Fork(ctx, sb.ID, 2, time.Minute); err != nil {
		t.Fatal(err)
	}
	if _, err := n.m.Snapshot(ctx, sb.ID, ""); err != nil {
		t.Fatal(err)
	}
	fail = true
	if _, err := n.m.Create(ctx, sandbox.CreateRequest{}); err == nil {
		t.Fatal("create with an injected launch failure succeeded")
	}
	for _, c := range []struct {
		stage      sandbox.Stage
		runs, errs int
	}{
		{sandbox.StageTemplateBuild, 1, 0},
		{sandbox.StageCreateRestore, 2, 1},
		{sandbox.StageCreateBoot, 1, 0},
		{sandbox.StagePause, 1, 0},
		{sandbox.StageResume, 1, 0},
		{sandbox.StageFork, 1, 0},
		{sandbox.StageSnapshot, 1, 0},
	} {
		if runs, errs := obs.count(c.stage); runs != c.runs || errs != c.errs {
			t.Errorf("stage %s: %d runs, %d failed; want %d, %d", c.stage, runs, errs, c.runs, c.errs)
		}
	}
}
