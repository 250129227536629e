package api

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/cluster/clustertest"
	"github.com/ember-sandbox/ember/internal/cluster/edge"
	"github.com/ember-sandbox/ember/internal/quota"
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
	publishPy(t, nodes[0], b)
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

// A team's templates' disk holds across the cluster: a template built on one node counts on
// every node (real etcd, two nodes sharing templates; before, b counted only its own store).
func TestClusterTemplateDiskQuota(t *testing.T) {
	e := clustertest.Start(t, 1)
	// The daemon's quotas: over the cluster's templates, a template's default disk 1 GiB.
	share := func(c *Config, cl *cluster.Cluster, svc *service) {
		tpls := cluster.NewTemplates(cl, svc.Manager)
		c.Templates, c.Builds = tpls, svc.builds()
		c.Quotas = quota.New(edge.ShareTemplates(svc.Manager, tpls), svc.builds(), auth.NewKeys(cl.Keys()), 1024)
	}
	nodes := twoNodes(t, e, nil, share)
	admin := nodes[0].env
	b, bt := admin.addTeam()
	publishPy(t, nodes[0], b)
	testutil.Eventually(t, 5*time.Second, "b has the cluster's template", func() bool {
		return len(nodes[1].cl.SharedTemplates()) == 1
	})
	var u struct {
		Usage struct {
			TemplateDiskMB int `json:"templateDiskMB"`
		} `json:"usage"`
	}
	nodes[1].env.as(b, "GET", "/ember/teams/"+bt+"/usage", "").json(t, &u)
	if u.Usage.TemplateDiskMB == 0 {
		t.Fatalf("b counts none of the team's templates' disk")
	}
	admin.setQuota(bt, `{"templateDiskMB":`+itoa(int64(u.Usage.TemplateDiskMB))+`}`)
	want429(t, nodes[1].env.as(b, "POST", "/v3/templates", `{"name":"two"}`), "templateDiskMB")
}

// publishPy builds template py as key's team on nd and puts it in the cluster's templates (as
// a build's Share does).
func publishPy(t *testing.T, nd *clusterNode, key string) {
	t.Helper()
	r := nd.env.as(key, "POST", "/ember/templates/py/build", `{"from":"archive:`+nd.env.importAs(key)+`"}`)
	if lines := ndjson(t, r.body); len(lines) == 0 || lines[len(lines)-1].Template == nil {
		t.Fatalf("build: %d %s", r.status, r.body)
	}
	tpl, err := nd.svc.Manager.GetTemplate(t.Context(), "py")
	if err != nil {
		t.Fatal(err)
	}
	st := cluster.SharedTemplate{ID: tpl.ID, Aliases: tpl.Aliases, BuildID: tpl.BuildID, Node: nd.id,
		Size: cluster.TemplateSize{CPU: tpl.CPUCount, MemoryMB: tpl.MemoryMB}}
	st.Portable.Template = *tpl
	if _, err := nd.cl.PublishTemplate(t.Context(), st, true); err != nil {
		t.Fatal(err)
	}
}
