package e2e

import (
	"encoding/json"
	"fmt"
	"github.com/ember-sandbox/ember/internal/testutil"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/cluster/clustertest"
)

// Two real ember nodes on a real 3-member etcd, 2 members stopped for several TTLs: control
// calls through either edge answer 503 naming the cause, commands and files in sandboxes on
// either node keep working through either edge, and once the members are back nothing was
// killed and creates work again.
func TestClusterQuorumLoss(t *testing.T) {
	e := clustertest.Start(t, 3)
	flags := append(e.ServeFlags(), "--cluster-ttl", "5s", "--pool-size", "1")
	var nodes []*daemon
	for i, id := range []string{"q1", "q2"} {
		if i > 0 {
			iso, _ := isolate(id, "")
			dir := filepath.Join(buildDir, iso)
			if err := os.MkdirAll(dir, 0o700); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dir, "api-key"), []byte(nodes[0].key+"\n"), 0o600); err != nil {
				t.Fatal(err)
			}
		}
		nodes = append(nodes, newDaemonWith(t, daemonOpts{NodeID: id, CIDR: nodeCIDR(44 + i), Flags: flags}))
	}
	a, b := nodes[0], nodes[1]
	testutil.Eventually(t, 30*time.Second, "both nodes see both", func() bool {
		var ns []nodeJSON
		return a.api(t, "GET", "/nodes", nil, &ns) == 200 && len(ns) == 2
	})
	var sbxs []sbx
	where := map[string]string{}
	for i := 0; i < 4; i++ {
		s := nodes[i%2].create(t, map[string]any{"timeout": 600})
		sbxs = append(sbxs, s)
		where[s.SandboxID] = nodeOf(t, a, s.SandboxID)
		if r := nodes[(i+1)%2].run(t, s, fmt.Sprintf("echo before-%d > /home/user/q", i)); r.exitCode != 0 {
			t.Fatalf("write in %s: %+v", s.SandboxID, r)
		}
	}
	t.Logf("placement: %v", where)

	stopped := time.Now()
	e.Kill(1)
	e.Kill(2)
	testutil.Eventually(t, 10*time.Second, "creates refused", func() bool {
		code, _, _ := a.call(8*time.Second, "POST", "/sandboxes", map[string]any{"templateID": "base"}, nil)
		return code == 503
	})
	t.Logf("creates refused %v after 2 of 3 etcd members stopped", time.Since(stopped).Round(time.Millisecond))
	for time.Since(stopped) < 15*time.Second { // three TTLs
		for _, n := range nodes {
			for _, c := range []struct{ method, path string }{{"POST", "/sandboxes"}, {"GET", "/sandboxes"}, {"GET", "/sandboxes/" + sbxs[0].SandboxID}, {"POST", "/sandboxes/" + sbxs[1].SandboxID + "/pause"}} {
				start := time.Now()
				code, body, err := n.call(10*time.Second, c.method, c.path, map[string]any{"templateID": "base"}, nil)
				var eb struct {
					Code    int    `json:"code"`
					Message string `json:"message"`
				}
				_ = json.Unmarshal([]byte(body), &eb)
				if err != nil || code != 503 || eb.Code != 503 || !strings.Contains(eb.Message, "cluster store (etcd)") {
					t.Fatalf("%s %s through %s without quorum: %d %s %v", c.method, c.path, n.nodeID, code, body, err)
				}
				if d := time.Since(start); d > 5*time.Second {
					t.Fatalf("%s %s through %s took %v to refuse", c.method, c.path, n.nodeID, d)
				}
			}
			for i, s := range sbxs {
				if r := n.run(t, s, "cat /home/user/q"); r.stdout != fmt.Sprintf("before-%d\n", i) {
					t.Fatalf("sandbox %s (on %s) through %s without quorum: %+v", s.SandboxID, where[s.SandboxID], n.nodeID, r)
				}
			}
		}
		time.Sleep(time.Second)
	}
	e.Restart(1)
	e.Restart(2)
	testutil.Eventually(t, 30*time.Second, "control calls served again", func() bool {
		code, _, _ := a.call(5*time.Second, "GET", "/sandboxes", nil, nil)
		code2, _, _ := b.call(5*time.Second, "GET", "/sandboxes", nil, nil)
		return code == 200 && code2 == 200
	})
	t.Logf("served again %v after the stop", time.Since(stopped).Round(time.Millisecond))
	time.Sleep(6 * time.Second) // a TTL more: a node that fenced would have killed by now
	for i, s := range sbxs {
		if code := b.api(t, "GET", "/sandboxes/"+s.SandboxID, nil, nil); code != 200 {
			t.Fatalf("sandbox %s after the quorum loss: %d", s.SandboxID, code)
		}
		if r := a.run(t, s, "cat /home/user/q"); r.stdout != fmt.Sprintf("before-%d\n", i) {
			t.Fatalf("sandbox %s after the quorum loss: %+v", s.SandboxID, r)
		}
	}
	for _, n := range nodes {
		if strings.Contains(n.allLogs(), "FENCED") {
			t.Fatalf("%s fenced during the quorum loss:\n%s", n.nodeID, n.logLines("FENCED", 10))
		}
	}
	s := b.create(t, nil)
	if r := a.run(t, s, "echo after"); r.stdout != "after\n" {
		t.Fatalf("a sandbox created after the quorum came back: %+v", r)
	}
}
