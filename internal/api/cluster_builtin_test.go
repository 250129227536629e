package api

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/cluster/clustertest"
	"github.com/ember-sandbox/ember/internal/template/build"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// TestClusterCreateBuildsABuiltinTemplate: in a cluster, a create that names a built-in
// template no node has yet (E2B's code-interpreter-v1 is one) is placed on a node that builds
// it, and the creates that arrive through other edges meanwhile join that one build (before,
// each edge built it itself); the sandboxes are created as on a single node, and the next
// creates, through any edge, go to the node that has it and build nothing again.
func TestClusterCreateBuildsABuiltinTemplate(t *testing.T) {
	// "block": the RUN step runs until the test releases the guest (templatebuild_test.go).
	def := interpDef(t, "install-packages block")
	e := clustertest.Start(t, 1)
	bmod := func(c *build.Config) { c.Builtins = map[string]build.BuiltinTemplate{"interp-v1": def} }
	cmod := func(c *cluster.Config) { c.Builtins = map[string]cluster.TemplateSize{"interp-v1": {}} }
	var nodes []*clusterNode
	for _, id := range []string{"a", "b"} {
		nodes = append(nodes, newClusterNodeBuilds(t, e, id, nil, bmod, cmod, nil))
	}
	shareKey(t, nodes)
	builds := func() int {
		n := 0
		for _, nd := range nodes {
			for _, l := range nd.env.guest.procs.lines() {
				if strings.Contains(l, "install-packages") {
					n++
				}
			}
		}
		return n
	}
	// One create through each edge while the template builds.
	var wg sync.WaitGroup
	results := make([]resp, 2)
	for i, nd := range nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i] = nd.env.ctl(http.MethodPost, "/sandboxes", `{"templateID":"interp-v1"}`)
		}()
	}
	testutil.Eventually(t, 10*time.Second, "the build runs", func() bool { return builds() > 0 })
	time.Sleep(time.Second) // the other create meanwhile: placed, it would have built too
	for _, nd := range nodes {
		close(nd.env.guest.procs.release)
	}
	wg.Wait()
	for i, r := range results {
		if r.status != http.StatusCreated {
			t.Fatalf("create %d of a built-in template no node had: %d %s", i, r.status, r.body)
		}
	}
	if n := builds(); n != 1 {
		t.Fatalf("the template was built %d times", n)
	}
	var holder *clusterNode
	for _, nd := range nodes {
		if _, err := nd.svc.Manager.GetTemplate(context.Background(), "interp-v1"); err == nil {
			holder = nd
		}
	}
	testutil.Eventually(t, 5*time.Second, "every edge sees the built template", func() bool {
		for _, nd := range nodes {
			for _, l := range nd.cl.Live() {
				if _, ok := l.Templates["interp-v1"]; l.ID == holder.id && !ok {
					return false
				}
			}
		}
		return true
	})
	for i := 0; i < 4; i++ {
		r := nodes[i%2].env.ctl(http.MethodPost, "/sandboxes", `{"templateID":"interp-v1"}`)
		if r.status != http.StatusCreated {
			t.Fatalf("create %d: %d %s", i, r.status, r.body)
		}
		var sb struct {
			SandboxID string `json:"sandboxID"`
		}
		if err := json.Unmarshal([]byte(r.body), &sb); err != nil || !holder.holds(sb.SandboxID) {
			t.Fatalf("create %d went to a node without the template (%v)", i, err)
		}
	}
	if n := builds(); n != 1 {
		t.Fatalf("the template was built %d times", n)
	}
}
