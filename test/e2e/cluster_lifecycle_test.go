package e2e

import (
	"context"
	"github.com/ember-sandbox/ember/internal/testutil"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/cluster/clustertest"
)

// etcdHas reports whether etcd holds key (under the cluster's /ember/ prefix).
func etcdHas(t *testing.T, e *clustertest.Etcd, key string) bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := e.Client(t).Get(ctx, "/ember/"+key)
	if err != nil {
		t.Fatalf("etcd get %s: %v", key, err)
	}
	return len(resp.Kvs) > 0
}

// killInstanceOf kills (SIGKILL) the runsc processes of sandbox s's instance on d.
func killInstanceOf(t *testing.T, d *daemon, s sbx) {
	t.Helper()
	n := 0
	for _, p := range d.runscProcs() {
		if strings.Contains(p.args, s.SandboxID) {
			_ = syscall.Kill(p.pid, syscall.SIGKILL)
			n++
		}
	}
	if n == 0 {
		t.Fatalf("no runsc process of %s on %s", s.SandboxID, d.nodeID)
	}
}

// Every transition the Manager makes on its own reaches the cluster's routing (issue 17): a
// paused autoResume sandbox woken by traffic, and one the reaper auto-paused on its timeout
// and traffic woke, are running again as far as the cluster knows, so when their node dies
// (kill -9, and its runsc processes) they are reported lost, or come back with what they did
// after the wake — never from their pause image of before the wake. A sandbox whose instance
// dies leaves routing (and its stored pause image) at once, everywhere.
func TestClusterTransitionsReachRouting(t *testing.T) {
	etcd, nodes := storedCluster(t, 1, []string{"t1", "t2", "t3"}, 56)
	a, b, c := nodes[0], nodes[1], nodes[2]

	// Everything on A.
	drain(t, c, b, true)
	drain(t, c, c, true)
	wake := map[string]any{"timeout": 900, "autoPause": true, "autoResume": map[string]any{"enabled": true}}
	woken := c.create(t, wake)
	dying := c.create(t, wake)
	timedOut := c.create(t, map[string]any{"timeout": 5, "autoPause": true, "autoResume": map[string]any{"enabled": true}})
	for _, s := range []sbx{woken, dying, timedOut} {
		if n := nodeOf(t, c, s.SandboxID); n != a.nodeID {
			t.Fatalf("create with %s and %s drained landed on %q", b.nodeID, c.nodeID, n)
		}
		c.run(t, s, "echo before > /home/user/f")
	}
	drain(t, c, b, false)
	drain(t, c, c, false)

	// Paused into the image store: two by the API, one by the reaper on its timeout.
	for _, s := range []sbx{woken, dying} {
		if code, body := c.apiBody(t, "POST", "/sandboxes/"+s.SandboxID+"/pause", nil, nil); code != 204 {
			t.Fatalf("pause through %s: %d %s", c.nodeID, code, body)
		}
	}
	testutil.Eventually(t, 30*time.Second, "the reaper paused the timed-out sandbox into the store", func() bool {
		var s sbx
		if c.api(t, "GET", "/sandboxes/"+timedOut.SandboxID, nil, &s) != 200 || s.State != "paused" {
			return false
		}
		_, stored := routeOf(t, etcd, timedOut.SandboxID)
		return stored
	})
	for _, s := range []sbx{woken, dying, timedOut} {
		if _, stored := routeOf(t, etcd, s.SandboxID); !stored {
			t.Fatalf("%s paused but its route is not stored", s.SandboxID)
		}
	}

	// Traffic through C wakes each (on A), and each writes after the wake.
	for _, s := range []sbx{woken, dying, timedOut} {
		if r := c.run(t, s, "echo after > /home/user/f"); r.exitCode != 0 {
			t.Fatalf("write after the wake of %s: %+v", s.SandboxID, r)
		}
		if s == timedOut {
			// Woken with its 5 s timeout: long enough now that the reaper leaves it running.
			if code, body := c.apiBody(t, "POST", "/sandboxes/"+s.SandboxID+"/timeout", map[string]any{"timeout": 600}, nil); code != 204 {
				t.Fatalf("timeout of %s: %d %s", s.SandboxID, code, body)
			}
		}
		if r := c.run(t, s, "cat /home/user/f"); r.stdout != "after\n" {
			t.Fatalf("%s after the wake: %+v", s.SandboxID, r)
		}
	}

	// One dies by itself (its instance killed): it leaves routing and the store at once.
	killInstanceOf(t, a, dying)
	testutil.Eventually(t, 10*time.Second, "A noticed the dead instance", func() bool {
		code, _ := a.apiBody(t, "GET", "/sandboxes/"+dying.SandboxID, nil, nil)
		return code == 404
	})
	// (Errorf: the cases after this one still run.)
	for deadline := time.Now().Add(time.Second); ; time.Sleep(100 * time.Millisecond) {
		route, stored := etcdHas(t, etcd, "sandboxes/"+dying.SandboxID), etcdHas(t, etcd, "stored/"+dying.SandboxID)
		if !route && !stored {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("1 s after its instance died, the dead sandbox still has a route (%v) or a stored record (%v)", route, stored)
			break
		}
	}
	for _, edge := range []*daemon{b, c} {
		if code, body := edge.apiBody(t, "GET", "/sandboxes/"+dying.SandboxID, nil, nil); code != 404 {
			t.Errorf("the dead sandbox through %s: %d %s", edge.nodeID, code, body)
		}
	}

	// A dies.
	a.crash()
	for _, i := range a.instances() {
		_, _ = a.runscCmd("kill", "--all", i.ID, "KILL")
	}
	for _, p := range a.runscProcs() {
		_ = syscall.Kill(p.pid, syscall.SIGKILL)
	}
	testutil.Eventually(t, 20*time.Second, "A is lost", func() bool { return nodeStateOf(t, b, a.nodeID) == "lost" })

	// Through B: lost, or back with the file written after the wake.
	for _, s := range []sbx{woken, timedOut} {
		var got sbx
		code, body := b.apiBody(t, "GET", "/sandboxes/"+s.SandboxID, nil, &got)
		switch {
		case code == 404 && strings.Contains(body, "lost with node "+a.nodeID):
			t.Logf("%s reported lost: %s", s.SandboxID, body)
			continue
		case code != 200:
			t.Fatalf("%s through %s after A died: %d %s", s.SandboxID, b.nodeID, code, body)
		}
		if code, body := b.apiBody(t, "POST", "/v2/sandboxes/"+s.SandboxID+"/connect", map[string]any{"timeout": 300}, nil); code != 200 && code != 201 {
			t.Fatalf("connect to %s through %s: %d %s", s.SandboxID, b.nodeID, code, body)
		}
		if r := b.run(t, s, "cat /home/user/f"); r.stdout != "after\n" {
			t.Errorf("%s came back in its state from before the wake (data loss): %+v", s.SandboxID, r)
		}
	}
	if code, body := b.apiBody(t, "GET", "/sandboxes/"+dying.SandboxID, nil, nil); code != 404 {
		t.Errorf("the dead sandbox through %s after A died: %d %s", b.nodeID, code, body)
	}
}
