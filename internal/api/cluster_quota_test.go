package api

import (
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/cluster/clustertest"
	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// A team's sandbox quota holds across the cluster (real etcd, two nodes, each with room for
// the whole quota): of 2N creates at once through both edges exactly N run, the rest answer
// E2B's 429; the block of a node that dies comes back to the team with its lease.
func TestClusterQuotaAcrossNodes(t *testing.T) {
	const n = 3
	e := clustertest.Start(t, 1)
	// Each node has room for the 2n creates: counted per node, the team would run up to 2n.
	slots := func(c *cluster.Config) { c.Capacity.Slots = 2 * n }
	nodes := twoNodes(t, e, slots)
	admin := nodes[0].env
	testutil.Eventually(t, 5*time.Second, "both nodes see both", func() bool {
		return len(nodes[0].cl.Live()) == 2 && len(nodes[1].cl.Live()) == 2
	})
	var tj teamJSON
	r := admin.ctl("POST", "/ember/teams", `{"name":"b"}`)
	if r.status != http.StatusCreated {
		t.Fatalf("create team: %d %s", r.status, r.body)
	}
	r.json(t, &tj)
	b, bt := tj.Key.Key, tj.ID
	admin.setQuota(bt, `{"sandboxes":3}`)

	var mu sync.Mutex
	var ok []string
	var refused []resp
	var wg sync.WaitGroup
	for i := 0; i < 2*n; i++ {
		wg.Add(1)
		go func(nd *clusterNode) {
			defer wg.Done()
			r := nd.env.as(b, "POST", "/sandboxes", `{"templateID":"base"}`)
			mu.Lock()
			defer mu.Unlock()
			if r.status == http.StatusCreated {
				var sj sandboxJSON
				r.json(t, &sj)
				ok = append(ok, sj.SandboxID)
			} else {
				refused = append(refused, r)
			}
		}(nodes[i%2])
	}
	wg.Wait()
	if len(ok) != n {
		var on [2]int
		for _, id := range ok {
			if nodes[1].holds(id) {
				on[1]++
			} else {
				on[0]++
			}
		}
		t.Fatalf("%d of %d creates ran (a %d, b %d) with a quota of %d", len(ok), 2*n, on[0], on[1], n)
	}
	for _, r := range refused {
		want429(t, r, "sandboxes")
		if !strings.Contains(string(r.body), "maximum number of concurrent E2B sandboxes (3)") {
			t.Fatalf("not E2B's words: %s", r.body)
		}
	}
	// Both nodes refuse now, whichever the create is placed on.
	for _, nd := range nodes {
		want429(t, nd.env.as(b, "POST", "/sandboxes", `{"templateID":"base"}`), "sandboxes")
	}
	// b must hold some of the quota when it dies: while it holds none, a sandbox on a is
	// killed and another created (placed anywhere), which also shows a kill's share of a
	// block coming back.
	for i := 0; teamRunning(t, nodes[1], bt) == 0; i++ {
		if i == 10 {
			t.Fatal("no create of the team's placed on b")
		}
		var sbxs []sandboxJSON
		admin.as(b, "GET", "/v2/sandboxes", "").json(t, &sbxs)
		for _, sj := range sbxs {
			if nodes[0].holds(sj.SandboxID) {
				if r := admin.as(b, "DELETE", "/sandboxes/"+sj.SandboxID, ""); r.status != http.StatusNoContent {
					t.Fatalf("kill: %d %s", r.status, r.body)
				}
				break
			}
		}
		testutil.Eventually(t, 5*time.Second, "the kill's share of a's block back", func() bool {
			return nodes[1].env.as(b, "POST", "/sandboxes", `{"templateID":"base"}`).status == http.StatusCreated
		})
	}
	// b dies: its block goes with its lease, and a can run the whole quota.
	nodes[1].stop()
	var last resp
	testutil.Eventually(t, clusterTTL+5*time.Second, "b's block back with its lease", func() bool {
		if teamRunning(t, nodes[0], bt) < n {
			last = admin.as(b, "POST", "/sandboxes", `{"templateID":"base"}`)
		}
		return teamRunning(t, nodes[0], bt) == n
	})
	if teamRunning(t, nodes[0], bt) != n {
		t.Fatalf("last create: %d %s", last.status, last.body)
	}
	want429(t, admin.as(b, "POST", "/sandboxes", `{"templateID":"base"}`), "sandboxes")
}

// teamRunning counts team's running sandboxes on nd.
func teamRunning(t *testing.T, nd *clusterNode, team string) int {
	sbxs, err := nd.svc.Manager.List(t.Context(), sandbox.ListFilter{States: []sandbox.State{sandbox.StateRunning}})
	if err != nil {
		t.Fatal(err)
	}
	k := 0
	for _, sb := range sbxs {
		if sb.Team == team {
			k++
		}
	}
	return k
}

// twoNodes starts nodes a and b on e, with cmod's cluster config and amods' API config, and
// one API key (the first team's admin key) for both.
func twoNodes(t *testing.T, e *clustertest.Etcd, cmod func(*cluster.Config), amods ...func(*Config, *cluster.Cluster, *service)) []*clusterNode {
	t.Helper()
	nodes := []*clusterNode{
		newClusterNodeWith(t, e, "a", nil, cmod, nil, amods...),
		newClusterNodeWith(t, e, "b", nil, cmod, nil, amods...),
	}
	key, _, err := nodes[0].env.keys.Create(t.Context(), "test")
	if err != nil {
		t.Fatal(err)
	}
	for _, nd := range nodes {
		nd.env.key = key
	}
	return nodes
}

// A team's quotas of builds at once and of paused sandboxes' disk hold across the cluster
// (real etcd, two nodes): counted per node, each node would let the team use its whole quota.
func TestClusterQuotaBuildsAndPausedDiskAcrossNodes(t *testing.T) {
	e := clustertest.Start(t, 1)
	nodes := twoNodes(t, e, nil, func(c *Config, _ *cluster.Cluster, svc *service) { c.Builds = svc.builds() })
	admin := nodes[0].env
	testutil.Eventually(t, 5*time.Second, "both nodes see both", func() bool {
		return len(nodes[0].cl.Live()) == 2 && len(nodes[1].cl.Live()) == 2
	})
	b, bt := admin.addTeam()
	_, _, disk := baseResources(t, admin)
	admin.setQuota(bt, `{"builds":1,"pausedDiskMB":`+itoa(int64(disk))+`}`)

	// Builds: the first one, on a, takes the quota; b refuses the second.
	if r := nodes[0].env.as(b, "POST", "/v3/templates", `{"name":"one"}`); r.status != http.StatusAccepted {
		t.Fatalf("first build: %d %s", r.status, r.body)
	}
	want429(t, nodes[1].env.as(b, "POST", "/v3/templates", `{"name":"two"}`), "builds")

	// Paused disk: a sandbox of the team on each node; pausing the first takes the quota, the
	// pause of the other (on the other node) is refused.
	var on [2]string
	for i := 0; on[0] == "" || on[1] == ""; i++ {
		if i == 12 {
			t.Fatal("no sandbox of the team placed on each node")
		}
		id := nodes[i%2].env.createAs(b)
		for k, nd := range nodes {
			if nd.holds(id) && on[k] == "" {
				on[k] = id
			}
		}
	}
	if r := nodes[0].env.as(b, "POST", "/sandboxes/"+on[0]+"/pause", ""); r.status != http.StatusNoContent {
		t.Fatalf("pause on a: %d %s", r.status, r.body)
	}
	want429(t, nodes[0].env.as(b, "POST", "/sandboxes/"+on[1]+"/pause", ""), "pausedDiskMB")
}

// A quota set on a team that already runs sandboxes on several nodes holds across them: each
// node raises its block to what it holds of the team, so no edge admits past the quota (real
// etcd, two nodes; before, the nodes that held the team's sandboxes had no block, and any
// node let the team start a whole quota more).
func TestClusterQuotaSetOnRunningTeam(t *testing.T) {
	e := clustertest.Start(t, 1)
	nodes := twoNodes(t, e, nil)
	admin := nodes[0].env
	testutil.Eventually(t, 5*time.Second, "both nodes see both", func() bool {
		return len(nodes[0].cl.Live()) == 2 && len(nodes[1].cl.Live()) == 2
	})
	b, bt := admin.addTeam()
	// Sandboxes of the team on both nodes, with no quota yet.
	for i := 0; teamRunning(t, nodes[0], bt) == 0 || teamRunning(t, nodes[1], bt) == 0; i++ {
		if i == 12 {
			t.Fatal("no sandbox of the team placed on each node")
		}
		nodes[i%2].env.createAs(b)
	}
	n := teamRunning(t, nodes[0], bt) + teamRunning(t, nodes[1], bt)
	admin.setQuota(bt, `{"sandboxes":`+itoa(int64(n))+`}`)
	c := e.Client(t)
	testutil.Eventually(t, 10*time.Second, "the blocks raised to what the nodes run", func() bool {
		sum, ok := clustertest.QuotaBlocks(t.Context(), c, bt)
		return ok && sum.Sandboxes == n
	})
	for _, nd := range nodes {
		want429(t, nd.env.as(b, "POST", "/sandboxes", `{"templateID":"base"}`), "sandboxes")
	}
}
