package api

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/cluster/clustertest"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// A template made public through one node is public on every node: the flag travels with the
// cluster's record of the template (real etcd, two nodes sharing templates).
func TestClusterPublicTemplateTravels(t *testing.T) {
	e := clustertest.Start(t, 1)
	share := func(c *Config, cl *cluster.Cluster, svc *service) {
		c.Templates = cluster.NewTemplates(cl, svc.Manager)
		c.Builds = svc.builds()
	}
	nodes := twoNodes(t, e, nil, share)
	admin := nodes[0].env
	b, _ := admin.addTeam()
	// Team b's template, built on a and in the cluster's templates (as a build's Share does).
	r := admin.as(b, "POST", "/ember/templates/py/build", `{"from":"archive:`+admin.importAs(b)+`"}`)
	if lines := ndjson(t, r.body); len(lines) == 0 || lines[len(lines)-1].Template == nil {
		t.Fatalf("build: %d %s", r.status, r.body)
	}
	tpl, err := nodes[0].svc.Manager.GetTemplate(t.Context(), "py")
	if err != nil {
		t.Fatal(err)
	}
	st := cluster.SharedTemplate{ID: tpl.ID, Aliases: tpl.Aliases, BuildID: tpl.BuildID, Node: "a",
		Size: cluster.TemplateSize{CPU: tpl.CPUCount, MemoryMB: tpl.MemoryMB}}
	st.Portable.Template = *tpl
	if _, err := nodes[0].cl.PublishTemplate(t.Context(), st, true); err != nil {
		t.Fatal(err)
	}
	visible := func(nd *clusterNode) bool {
		r := nd.env.ctl("GET", "/templates", "")
		return r.status == http.StatusOK && strings.Contains(string(r.body), `"templateID":"py"`)
	}
	testutil.Eventually(t, 5*time.Second, "b has the cluster's template", func() bool {
		return len(nodes[1].cl.SharedTemplates()) == 1
	})
	if visible(nodes[1]) || visible(nodes[0]) {
		t.Fatal("team b's private template is visible to another team")
	}
	if r := admin.as(b, "PATCH", "/templates/py", `{"public":true}`); r.status != http.StatusNoContent {
		t.Fatalf("make public: %d %s", r.status, r.body)
	}
	for _, nd := range nodes {
		testutil.Eventually(t, 5*time.Second, "public on node "+nd.id, func() bool { return visible(nd) })
		if r := nd.env.ctl("GET", "/templates/aliases/py", ""); r.status != http.StatusOK {
			t.Fatalf("node %s: alias of a public template: %d %s", nd.id, r.status, r.body)
		}
	}
	if r := admin.as(b, "PATCH", "/templates/py", `{"public":false}`); r.status != http.StatusNoContent {
		t.Fatalf("make private: %d %s", r.status, r.body)
	}
	for _, nd := range nodes {
		testutil.Eventually(t, 5*time.Second, "private again on node "+nd.id, func() bool { return !visible(nd) })
	}
}
