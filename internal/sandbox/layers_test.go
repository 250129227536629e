package sandbox_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/datadir"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/template/build"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// A template record (ember.db, or etcd in a cluster) whose stack names the data directory
// itself — "." as a layer identity — or any directory that is not a layer ember made: nothing
// boots on it (a create, a warm-up) and no step build composes from it.
func TestTemplateStackNamingTheDataDirIsRefused(t *testing.T) {
	n := newNode(t, nil)
	tpl := n.build("base")
	ctx := context.Background()
	for _, bad := range []string{n.cfg.DataDir, datadir.Templates(n.cfg.DataDir)} {
		tampered := *tpl
		tampered.Lowers = append([]string{bad}, tpl.Lowers...)
		if err := n.store.PutTemplate(ctx, &tampered); err != nil {
			t.Fatal(err)
		}
		if sb, err := n.m.Create(ctx, sandbox.CreateRequest{TemplateID: "base"}); !errors.Is(err, errdefs.ErrInvalid) {
			t.Fatalf("create on a stack naming %s: %+v, %v; want ErrInvalid", bad, sb, err)
		}
		b, err := n.b.RequestBuild(ctx, build.BuildSpec{Name: "child"})
		if err != nil {
			t.Fatal(err)
		}
		if err := n.b.StartBuild(ctx, "child", b.ID, build.StepBuildRequest{FromTemplate: "base", Steps: []build.Step{{Type: "ENV", Args: []string{"A", "1"}}}}); err != nil {
			t.Fatal(err)
		}
		testutil.Eventually(t, 10*time.Second, "build never ended", func() bool {
			got, err := n.b.GetBuild(ctx, "child", b.ID)
			if err != nil {
				t.Fatal(err)
			}
			if got.Status == build.BuildError {
				if !strings.Contains(got.Reason.Message, "not a layer ember made") {
					t.Fatalf("build failed for another reason: %s", got.Reason.Message)
				}
				return true
			}
			if got.Status == build.BuildReady {
				t.Fatalf("a step build composed from a stack naming %s", bad)
			}
			return false
		})
	}
}

// What an interrupted build, export or fetch left (a crash, a kill -9) is collected at start:
// build-files/.tmp*, remote/.export-*, the .<name>.export-* and .<name>.fetching-* staging
// directories beside images; what is not a temporary file stays.
func TestTemporaryFilesAreCollectedAtStart(t *testing.T) {
	n := newNode(t, nil)
	n.build("base")
	d := n.cfg.DataDir
	left := []string{
		"build-files/.tmp-123", "build-files/.tmp-copy-456",
		"remote/.export-789/tree.tar", "remote/.cmVtb3Rl.fetching-1/snapshot/x",
		"remote/images/.tplimage-ab.fetching-2/x", "images/.in-abc.fetching-3/x", "images/.fork-abc.export-4/x",
		"sandboxes/abc/.image-1.fetching-5/x", "templates/base/.image-aa.export-6/x",
	}
	kept := []string{"build-files/" + strings.Repeat("a", 64) + ".tar", "remote/images/keep/x"}
	for _, p := range append(append([]string{}, left...), kept...) {
		f := filepath.Join(d, p)
		if err := os.MkdirAll(filepath.Dir(f), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(f, []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	n.restart()
	for _, p := range left {
		top := strings.SplitN(p, "/", 3)
		dir := filepath.Join(d, top[0], top[1])
		if top[0] == "remote" && top[1] == "images" || top[0] == "sandboxes" || top[0] == "templates" {
			dir = filepath.Join(d, top[0], top[1], strings.SplitN(top[2], "/", 2)[0])
		}
		if _, err := os.Lstat(dir); err == nil {
			t.Errorf("%s left after a restart", dir)
		}
	}
	for _, p := range kept {
		if _, err := os.Stat(filepath.Join(d, p)); err != nil {
			t.Errorf("%s removed: %v", p, err)
		}
	}
}
