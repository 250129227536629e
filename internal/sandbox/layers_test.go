package sandbox_test

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// A template record (ember.db, or etcd in a cluster) whose stack names the data directory
// itself — "." as a layer identity — or any directory that is not a layer ember made: nothing
// boots on it (a create, a warm-up) and no step build composes from it.
func TestTemplateStackNamingTheDataDirIsRefused(t *testing.T) {
	n := newNode(t, nil)
	tpl := n.build("base")
	ctx := context.Background()
	for _, bad := range []string{n.cfg.DataDir, filepath.Join(n.cfg.DataDir, "templates")} {
		tampered := *tpl
		tampered.Lowers = append([]string{bad}, tpl.Lowers...)
		if err := n.store.PutTemplate(ctx, &tampered); err != nil {
			t.Fatal(err)
		}
		if sb, err := n.m.Create(ctx, sandbox.CreateRequest{TemplateID: "base"}); !errors.Is(err, errdefs.ErrInvalid) {
			t.Fatalf("create on a stack naming %s: %+v, %v; want ErrInvalid", bad, sb, err)
		}
		b, err := n.m.RequestBuild(ctx, sandbox.BuildSpec{Name: "child"})
		if err != nil {
			t.Fatal(err)
		}
		if err := n.m.StartBuild(ctx, "child", b.ID, sandbox.StepBuildRequest{FromTemplate: "base", Steps: []sandbox.Step{{Type: "ENV", Args: []string{"A", "1"}}}}); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(10 * time.Second)
		for {
			got, err := n.m.GetBuild(ctx, "child", b.ID)
			if err != nil {
				t.Fatal(err)
			}
			if got.Status == sandbox.BuildError {
				if !strings.Contains(got.Reason.Message, "not a layer ember made") {
					t.Fatalf("build failed for another reason: %s", got.Reason.Message)
				}
				break
			}
			if got.Status == sandbox.BuildReady {
				t.Fatalf("a step build composed from a stack naming %s", bad)
			}
			if time.Now().After(deadline) {
				t.Fatal("build never ended")
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
}
