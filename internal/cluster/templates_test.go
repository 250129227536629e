package cluster_test

import (
	"context"
	"github.com/ember-sandbox/ember/internal/testutil"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/cluster/clustertest"
)

// A template registered by one node is every node's: listed everywhere, found by alias, and
// placeable on a node that does not have it (it loads it from the image store). The first
// registration of a name wins unless replaced.
func TestSharedTemplatesArePlaceableEverywhere(t *testing.T) {
	e := clustertest.Start(t, 1)
	a := join(t, e.Endpoints(), "a", 4, newLocal("base"))
	b := join(t, e.Endpoints(), "b", 4, newLocal("base"))
	ctx := context.Background()
	testutil.Eventually(t, 5*time.Second, "a sees b", func() bool { return nodeState(a, "b") == cluster.StateActive })
	if _, err := a.Place(ctx, cluster.PlaceRequest{TemplateID: "py"}); err == nil {
		t.Fatal("placed a template no node has")
	}
	st := cluster.SharedTemplate{ID: "py", Aliases: []string{"python"}, BuildID: "b1", Node: "b", Size: cluster.TemplateSize{CPU: 1, MemoryMB: 256}}
	if won, err := b.PublishTemplate(ctx, st, false); err != nil || won.BuildID != "b1" {
		t.Fatalf("publish: %+v %v", won, err)
	}
	other := st
	other.BuildID, other.Node = "b2", "a"
	if won, err := a.PublishTemplate(ctx, other, false); err != nil || won.BuildID != "b1" {
		t.Fatalf("a second registration if absent: %+v %v, want b's b1 kept", won, err)
	}
	testutil.Eventually(t, 5*time.Second, "a lists py", func() bool { return len(a.SharedTemplates()) == 1 })
	if got, err := a.SharedTemplate(ctx, "python"); err != nil || got == nil || got.ID != "py" {
		t.Fatalf("by alias: %+v %v", got, err)
	}
	seen := map[string]bool{}
	for i := 0; i < 20 && len(seen) < 2; i++ {
		r, err := a.Place(ctx, cluster.PlaceRequest{TemplateID: "py"})
		if err != nil {
			t.Fatal(err)
		}
		seen[r.Node] = true
		a.Cancel(ctx, r)
	}
	if !seen["a"] || !seen["b"] {
		t.Fatalf("placements of a shared template: %v, want both nodes", seen)
	}
	if won, err := a.PublishTemplate(ctx, other, true); err != nil || won.BuildID != "b2" {
		t.Fatalf("replace: %+v %v", won, err)
	}
	testutil.Eventually(t, 5*time.Second, "b sees the rebuild", func() bool {
		got, _ := b.SharedTemplate(ctx, "py")
		return got != nil && got.BuildID == "b2"
	})
	if err := b.UnpublishTemplate(ctx, "py"); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 5*time.Second, "a forgets py", func() bool { return len(a.SharedTemplates()) == 0 })
}
