package sandbox_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/template/build"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// stepBuild runs a step build of name to its end.
func (n *node) stepBuild(name string, req build.StepBuildRequest) *build.TemplateBuild {
	n.t.Helper()
	ctx := context.Background()
	b, err := n.b.RequestBuild(ctx, build.BuildSpec{Name: name})
	if err != nil {
		n.t.Fatal(err)
	}
	if err := n.b.StartBuild(ctx, name, b.ID, req); err != nil {
		n.t.Fatal(err)
	}
	var got *build.TemplateBuild
	testutil.Eventually(n.t, 10*time.Second, "the build ended", func() bool {
		got, err = n.b.GetBuild(ctx, name, b.ID)
		return err == nil && (got.Status == build.BuildReady || got.Status == build.BuildError)
	})
	return got
}

// Both build paths end the same way (build.Manager.publish, BuildHost.TemplateBuilt): after a
// template is rebuilt from its rootfs source or by steps, no pre-started instance of its old
// build (which holds the old image's layer) stays for a create to restore into. (The pool also
// notices an old build on its own, later: this does not fail without TemplateBuilt's refresh,
// it only waits longer.)
func TestRebuildsRefreshBothPools(t *testing.T) {
	n := newNode(t, func(c *sandbox.Config) { c.PrestartSize = 1; c.PrestartMax = 1 })
	n.build("base")
	steps := func(v string) build.StepBuildRequest {
		return build.StepBuildRequest{FromTemplate: "base", Steps: []build.Step{{Type: "ENV", Args: []string{"V", v}}}}
	}
	for i, rebuild := range []func(){
		func() { n.build("base") },
		func() {
			if b := n.stepBuild("child", steps("2")); b.Status != build.BuildReady {
				t.Fatalf("step build: %+v", b.Reason)
			}
		},
	} {
		tpl := "base"
		if i == 1 {
			tpl = "child"
			if b := n.stepBuild("child", steps("1")); b.Status != build.BuildReady {
				t.Fatalf("step build: %+v", b.Reason)
			}
		}
		var old []string
		testutil.Eventually(t, 5*time.Second, "a pre-started instance of "+tpl, func() bool {
			old = prestartedOf(n, tpl)
			return len(old) == 1
		})
		rebuild()
		testutil.Eventually(t, 5*time.Second, "the pre-started instance of the old build of "+tpl+" replaced", func() bool {
			now := prestartedOf(n, tpl)
			return len(now) == 1 && !slices.Contains(now, old[0])
		})
	}
}

// prestartedOf lists the pre-started instances of template tpl.
func prestartedOf(n *node, tpl string) []string {
	var out []string
	for _, ps := range prestartPools(n.m) {
		if ps.TemplateID == tpl {
			out = append(out, ps.SandboxIDs...)
		}
	}
	return out
}
