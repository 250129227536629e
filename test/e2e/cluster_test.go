package e2e

import (
	"fmt"
	"github.com/ember-sandbox/ember/internal/testutil"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/cluster/clustertest"
)

type nodeJSON struct {
	NodeID    string   `json:"nodeID"`
	State     string   `json:"state"`
	Sandboxes []string `json:"sandboxes"`
}

// nodeOf returns which node holds sandbox id, as GET /nodes through d says (d's cache may be
// a moment behind the edge that created it).
func nodeOf(t *testing.T, d *daemon, id string) string {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		var nodes []nodeJSON
		if code := d.api(t, "GET", "/nodes", nil, &nodes); code != 200 {
			t.Fatalf("GET /nodes: %d", code)
		}
		for _, n := range nodes {
			for _, s := range n.Sandboxes {
				if s == id {
					return n.NodeID
				}
			}
		}
	}
	return ""
}

// Three real ember nodes on a real 3-member etcd: creates through all three edges land on
// more than one node; commands and files work through any edge for a sandbox on any node; a
// node killed with kill -9 has its sandboxes reported lost and takes no creates; one etcd
// member killed changes nothing; the node restarted comes back empty and takes new work.
func TestClusterThreeNodes(t *testing.T) {
	e := clustertest.Start(t, 3)
	flags := append(e.ServeFlags(), "--cluster-ttl", "5s", "--pool-size", "1")
	ids := []string{"k1", "k2", "k3"}
	var nodes []*daemon
	for i, id := range ids {
		o := daemonOpts{NodeID: id, CIDR: nodeCIDR(40 + i), Flags: flags}
		if i > 0 {
			// The cluster's API key is the first node's: the harness reads it from the data dir
			// (<buildDir>/<node id as isolated>).
			iso, _ := isolate(id, "")
			dir := filepath.Join(buildDir, iso)
			if err := os.MkdirAll(dir, 0o700); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dir, "api-key"), []byte(nodes[0].key+"\n"), 0o600); err != nil {
				t.Fatal(err)
			}
		}
		nodes = append(nodes, newDaemonWith(t, o))
	}
	a, c := nodes[0], nodes[2]
	testutil.Eventually(t, 30*time.Second, "every node sees three nodes", func() bool {
		var ns []nodeJSON
		return a.api(t, "GET", "/nodes", nil, &ns) == 200 && len(ns) == 3
	})

	// Creates through all three edges.
	var sbxs []sbx
	where := map[string]string{}
	for i := 0; i < 6; i++ {
		s := nodes[i%3].create(t, map[string]any{"timeout": 600})
		sbxs = append(sbxs, s)
		where[s.SandboxID] = nodeOf(t, a, s.SandboxID)
	}
	spread := map[string]int{}
	for _, n := range where {
		spread[n]++
	}
	t.Logf("placement: %v", spread)
	if len(spread) < 2 || spread[""] > 0 {
		t.Fatalf("6 creates through 3 edges: %v", spread)
	}
	// Commands and files through every edge, for sandboxes on every node.
	for i, s := range sbxs {
		w := nodes[(i+1)%3]
		if r := w.run(t, s, fmt.Sprintf("echo hi-%d > /home/user/f && cat /home/user/f", i)); r.exitCode != 0 || r.stdout != fmt.Sprintf("hi-%d\n", i) {
			t.Fatalf("run in %s (on %s) through %s: %+v", s.SandboxID, where[s.SandboxID], w.nodeID, r)
		}
		r := nodes[(i+2)%3].run(t, s, "cat /home/user/f")
		if r.stdout != fmt.Sprintf("hi-%d\n", i) {
			t.Fatalf("file through a third edge: %+v", r)
		}
	}

	// One etcd member killed changes nothing.
	e.Kill(0)
	s := c.create(t, nil)
	if r := a.run(t, s, "echo ok"); r.stdout != "ok\n" {
		t.Fatalf("with an etcd member down: %+v", r)
	}
	e.Restart(0)

	// kill -9 one node that holds sandboxes: they are reported lost, naming it.
	victim := a
	for _, n := range nodes {
		if spread[n.nodeID] > 0 {
			victim = n
			break
		}
	}
	var lost []string
	for id, n := range where {
		if n == victim.nodeID {
			lost = append(lost, id)
		}
	}
	var others []*daemon
	for _, n := range nodes {
		if n != victim {
			others = append(others, n)
		}
	}
	killed := time.Now()
	victim.crash()
	testutil.Eventually(t, 5*time.Second+10*time.Second, "the dead node's sandboxes reported lost", func() bool {
		code, body := others[0].apiBody(t, "GET", "/sandboxes/"+lost[0], nil, nil)
		return code == 404 && strings.Contains(body, "lost with node "+victim.nodeID)
	})
	t.Logf("lost reported %v after kill -9 (TTL 5s)", time.Since(killed).Round(time.Millisecond))
	for i := 0; i < 4; i++ {
		s := others[i%2].create(t, nil)
		if n := nodeOf(t, others[0], s.SandboxID); n == victim.nodeID || n == "" {
			t.Fatalf("create landed on %q with %s dead", n, victim.nodeID)
		}
	}
	// Back: under a new epoch, without the sandboxes the cluster marked lost, and taking work.
	if err := victim.start(); err != nil {
		t.Fatalf("restart %s: %v\n%s", victim.nodeID, err, victim.logs())
	}
	testutil.Eventually(t, 30*time.Second, "the restarted node holds none of its lost sandboxes", func() bool {
		var n nodeJSON
		if victim.api(t, "GET", "/nodes/"+victim.nodeID, nil, &n) != 200 || n.State != "active" {
			return false
		}
		for _, id := range lost {
			if code, _ := victim.apiBody(t, "GET", "/sandboxes/"+id, nil, nil); code != 404 {
				return false
			}
		}
		return len(n.Sandboxes) == 0
	})
	took := false
	for i := 0; i < 12 && !took; i++ {
		s := nodes[i%3].create(t, nil)
		took = nodeOf(t, victim, s.SandboxID) == victim.nodeID
		if took {
			if r := others[0].run(t, s, "echo back"); r.stdout != "back\n" {
				t.Fatalf("on the restarted node: %+v", r)
			}
		}
	}
	if !took {
		t.Fatal("the restarted node took no create in 12")
	}
}
