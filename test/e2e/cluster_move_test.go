package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"github.com/ember-sandbox/ember/internal/testutil"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/cluster/clustertest"
	"github.com/ember-sandbox/ember/internal/snapshot/s3"
	"github.com/ember-sandbox/ember/internal/snapshot/s3/s3test"
)

// storedCluster starts n ember nodes on a real etcd (members) and a real S3 server, sharing
// the cluster's API key and the key that signs stored images. Nodes start one after another:
// the first builds `base`, the others load it from the store.
func storedCluster(t *testing.T, members int, ids []string, cidrBase int) (*clustertest.Etcd, []*daemon) {
	t.Helper()
	e, flags := storedClusterFlags(t, members)
	return e, addNodes(t, flags, nil, ids, cidrBase)
}

// storedClusterFlags starts a real etcd (members) and a real S3 server and returns the flags
// of the ember nodes that use them.
func storedClusterFlags(t *testing.T, members int) (*clustertest.Etcd, []string) {
	t.Helper()
	e := clustertest.Start(t, members)
	return e, storedFlags(e, s3test.Start(t))
}

// storedFlags are the flags of the nodes of a cluster with etcd e and S3 server s3.
func storedFlags(e *clustertest.Etcd, s s3.Config) []string {
	// No --snapshot-key: the cluster shares its own through etcd (as the README's example).
	return append(e.ServeFlags(), "--cluster-ttl", "5s", "--pool-size", "1",
		"--s3-endpoint", s.Endpoint, "--s3-bucket", s.Bucket, "--s3-access-key", s.AccessKey, "--s3-secret-key", s.SecretKey)
}

// addNodes starts ember nodes ids (CIDRs from cidrBase) after nodes, with the API key of the
// first node, and waits until every node sees every other.
func addNodes(t *testing.T, flags []string, nodes []*daemon, ids []string, cidrBase int) []*daemon {
	t.Helper()
	for i, id := range ids {
		o := daemonOpts{NodeID: id, CIDR: nodeCIDR(cidrBase + i), Flags: flags}
		if len(nodes) > 0 {
			iso, _ := isolate(id, "")
			dir := filepath.Join(buildDir, iso)
			if err := os.MkdirAll(dir, 0o700); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dir, "api-key"), []byte(nodes[0].key+"\n"), 0o600); err != nil {
				t.Fatal(err)
			}
		}
		t0 := time.Now()
		d := newDaemonWith(t, o)
		nodes = append(nodes, d)
		t.Logf("node %s up in %v", d.nodeID, time.Since(t0).Round(time.Millisecond))
	}
	testutil.Eventually(t, 30*time.Second, "every node sees every node", func() bool {
		var ns []nodeJSON
		return nodes[0].api(t, "GET", "/nodes", nil, &ns) == 200 && len(ns) == len(nodes)
	})
	return nodes
}

type templateListed struct {
	TemplateID string `json:"templateID"`
	BuildID    string `json:"buildID"`
}

// templatesOf lists GET /templates through d as "id@build" lines.
func templatesOf(t *testing.T, d *daemon) []string {
	t.Helper()
	var ts []templateListed
	if code := d.api(t, "GET", "/templates", nil, &ts); code != 200 {
		t.Fatalf("GET /templates through %s: %d", d.nodeID, code)
	}
	var out []string
	for _, x := range ts {
		out = append(out, x.TemplateID+"@"+x.BuildID)
	}
	sort.Strings(out)
	return out
}

func drain(t *testing.T, through, node *daemon, on bool) {
	t.Helper()
	method := "POST"
	if !on {
		method = "DELETE"
	}
	if code := through.api(t, method, "/nodes/"+node.nodeID+"/drain", nil, nil); code != 200 {
		t.Fatalf("drain %s (%v): %d", node.nodeID, on, code)
	}
}

// Templates built on one node are the cluster's: the nodes started later load `base` from the
// store instead of building their own, GET /templates is the same on every node, and a create
// placed on a node that does not have a template (a named snapshot taken on another node)
// loads it from the store and restores it there, with the snapshot's files.
func TestClusterTemplatesMove(t *testing.T) {
	_, nodes := storedCluster(t, 1, []string{"m1", "m2"}, 50)
	a, b := nodes[0], nodes[1]
	if !strings.Contains(b.allLogs(), `Template "base": the cluster's build`) || strings.Contains(b.allLogs(), `Building template "base"`) {
		t.Fatalf("node %s built its own base instead of loading the cluster's:\n%s", b.nodeID, b.logs())
	}
	if ta, tb := templatesOf(t, a), templatesOf(t, b); strings.Join(ta, ",") != strings.Join(tb, ",") {
		t.Fatalf("GET /templates: %v through %s, %v through %s", ta, a.nodeID, tb, b.nodeID)
	}

	// base from the store restores on b (a drained: the create through a lands on b).
	drain(t, a, a, true)
	s := a.create(t, map[string]any{"timeout": 600})
	if n := nodeOf(t, a, s.SandboxID); n != b.nodeID {
		t.Fatalf("create with %s drained landed on %q", a.nodeID, n)
	}
	if r := a.run(t, s, "echo made-on-b > /home/user/f && cat /home/user/f"); r.stdout != "made-on-b\n" {
		t.Fatalf("run on %s through %s: %+v", b.nodeID, a.nodeID, r)
	}
	drain(t, a, a, false)

	// A named snapshot taken on a; b (which never had it) restores it once it is shared.
	drain(t, a, b, true)
	src := b.create(t, map[string]any{"timeout": 600})
	if n := nodeOf(t, a, src.SandboxID); n != a.nodeID {
		t.Fatalf("create with %s drained landed on %q", b.nodeID, n)
	}
	b.run(t, src, "echo in-snapshot > /home/user/s.txt")
	var snap struct {
		SnapshotID string `json:"snapshotID"`
	}
	if code, body := b.apiBody(t, "POST", "/sandboxes/"+src.SandboxID+"/snapshots", map[string]any{"name": "move-snap"}, &snap); code != 201 {
		t.Fatalf("snapshot through %s: %d %s", b.nodeID, code, body)
	}
	t.Cleanup(func() { a.api(t, "DELETE", "/templates/"+snap.SnapshotID, nil, nil) })
	testutil.Eventually(t, 2*time.Minute, "the snapshot is the cluster's (listed through "+b.nodeID+")", func() bool {
		for _, x := range templatesOf(t, b) {
			if strings.HasPrefix(x, snap.SnapshotID+"@") {
				return true
			}
		}
		return false
	})
	if code, body := b.apiBody(t, "GET", "/templates/"+snap.SnapshotID, nil, nil); code != 200 {
		t.Fatalf("GET /templates/%s through %s (not loaded there yet): %d %s", snap.SnapshotID, b.nodeID, code, body)
	}
	drain(t, a, b, false)
	drain(t, a, a, true)
	child := a.create(t, map[string]any{"templateID": snap.SnapshotID})
	if n := nodeOf(t, a, child.SandboxID); n != b.nodeID {
		t.Fatalf("create from the snapshot with %s drained landed on %q", a.nodeID, n)
	}
	if r := b.run(t, child, "cat /home/user/s.txt"); r.stdout != "in-snapshot\n" {
		t.Fatalf("sandbox from the snapshot on %s sees %+v\n%s", b.nodeID, r, b.logs())
	}
	drain(t, a, a, false)

	// Deleted through one node, the snapshot is gone from every node's list.
	if code := a.api(t, "DELETE", "/templates/"+snap.SnapshotID, nil, nil); code != 204 {
		t.Fatalf("delete the snapshot through %s: %d", a.nodeID, code)
	}
	for _, d := range nodes {
		if code, _ := d.apiBody(t, "GET", "/templates/"+snap.SnapshotID, nil, nil); code != 404 {
			t.Fatalf("GET /templates/%s through %s after the delete: %d", snap.SnapshotID, d.nodeID, code)
		}
		for _, x := range templatesOf(t, d) {
			if strings.HasPrefix(x, snap.SnapshotID+"@") {
				t.Fatalf("deleted snapshot still listed through %s: %v", d.nodeID, templatesOf(t, d))
			}
		}
	}
}

// counter reads the background counter of a sandbox.
func counter(t *testing.T, d *daemon, s sbx) int {
	t.Helper()
	r := d.run(t, s, "cat /home/user/count")
	n, err := strconv.Atoi(strings.TrimSpace(r.stdout))
	if err != nil {
		t.Fatalf("counter in %s through %s: %+v", s.SandboxID, d.nodeID, r)
	}
	return n
}

// listedTimes counts the items of sandbox id in state state that list path through d.
func listedTimes(t *testing.T, d *daemon, path, id, state string) int {
	t.Helper()
	var l []sbx
	if code, body := d.apiBody(t, "GET", path, nil, &l); code != 200 {
		t.Fatalf("GET %s through %s: %d %s", path, d.nodeID, code, body)
	}
	n := 0
	for _, s := range l {
		if s.SandboxID == id && s.State == state {
			n++
		}
	}
	return n
}

// routeOf reads sandbox id's route from etcd: its node, and whether it is stored.
func routeOf(t *testing.T, e *clustertest.Etcd, id string) (string, bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := e.Client(t).Get(ctx, "/ember/sandboxes/"+id)
	if err != nil {
		t.Fatalf("route of %s: %v", id, err)
	}
	if len(resp.Kvs) == 0 {
		t.Fatalf("%s has no route", id)
	}
	var r struct {
		Node   string `json:"node"`
		Stored bool   `json:"stored"`
	}
	if err := json.Unmarshal(resp.Kvs[0].Value, &r); err != nil {
		t.Fatal(err)
	}
	return r.Node, r.Stored
}

func nodeStateOf(t *testing.T, through *daemon, id string) string {
	t.Helper()
	var n nodeJSON
	if through.api(t, "GET", "/nodes/"+id, nil, &n) != 200 {
		return "absent"
	}
	return n.State
}

// Pause anywhere, resume anywhere: a sandbox paused on node A is in the image store before the
// pause answers; with A killed (kill -9), a resume through C runs it on B or C with its files
// and its background process's state, A's running sandboxes are reported lost and no create
// lands on A; A restarted comes back empty and takes new work. A drained node pauses its
// running sandboxes into the store, and they resume on other nodes.
func TestClusterPausedSandboxesMove(t *testing.T) {
	etcd, nodes := storedCluster(t, 3, []string{"p1", "p2", "p3"}, 53)
	a, b, c := nodes[0], nodes[1], nodes[2]

	// Two sandboxes on A: one to pause, one left running.
	drain(t, c, b, true)
	drain(t, c, c, true)
	paused := c.create(t, map[string]any{"timeout": 900})
	running := c.create(t, map[string]any{"timeout": 900})
	for _, s := range []sbx{paused, running} {
		if n := nodeOf(t, c, s.SandboxID); n != a.nodeID {
			t.Fatalf("create with %s and %s drained landed on %q", b.nodeID, c.nodeID, n)
		}
	}
	drain(t, c, b, false)
	drain(t, c, c, false)
	c.run(t, paused, "echo kept > /home/user/f")
	c.background(t, paused, "i=0; while true; do i=$((i+1)); echo $i > /home/user/count; sleep 0.1; done")
	testutil.Eventually(t, 10*time.Second, "the counter runs", func() bool { return counter(t, c, paused) > 5 })
	before := counter(t, c, paused)
	t0 := time.Now()
	if code, body := c.apiBody(t, "POST", "/sandboxes/"+paused.SandboxID+"/pause", nil, nil); code != 204 {
		t.Fatalf("pause through %s: %d %s", c.nodeID, code, body)
	}
	t.Logf("pause (image stored) took %v", time.Since(t0).Round(time.Millisecond))

	// A dies.
	killed := time.Now()
	a.crash()
	for _, i := range a.instances() { // and its sandboxes
		_, _ = a.runscCmd("kill", "--all", i.ID, "KILL")
	}
	testutil.Eventually(t, 5*time.Second+15*time.Second, "A is lost", func() bool { return nodeStateOf(t, b, a.nodeID) == "lost" })
	t.Logf("A seen lost %v after kill -9 (TTL 5s)", time.Since(killed).Round(time.Millisecond))

	// Held by no node, it is listed paused through B and C (from its stored record), and a GET
	// through C answers from that record, leaving it stored, A's.
	for _, edge := range []*daemon{b, c} {
		if n := listedTimes(t, edge, "/v2/sandboxes?state=paused", paused.SandboxID, "paused"); n != 1 {
			t.Fatalf("the stored sandbox listed %d times as paused through %s", n, edge.nodeID)
		}
	}
	var got sbx
	if code, body := c.apiBody(t, "GET", "/sandboxes/"+paused.SandboxID, nil, &got); code != 200 || got.State != "paused" {
		t.Fatalf("GET of the stored sandbox through %s: %d %s", c.nodeID, code, body)
	}
	if node, stored := routeOf(t, etcd, paused.SandboxID); node != a.nodeID || !stored {
		t.Fatalf("after a GET the route is %q (stored %v), want still %s's, stored", node, stored, a.nodeID)
	}

	// Resume through C: on B or C, with its files and its process's state.
	t0 = time.Now()
	var resumed sbx
	if code, body := c.apiBody(t, "POST", "/v2/sandboxes/"+paused.SandboxID+"/connect", map[string]any{"timeout": 600}, &resumed); code != 201 && code != 200 {
		t.Fatalf("resume through %s: %d %s\n%s", c.nodeID, code, body, c.logs())
	}
	t.Logf("resume elsewhere (adopt from the store + restore) took %v", time.Since(t0).Round(time.Millisecond))
	where := nodeOf(t, c, paused.SandboxID)
	if where != b.nodeID && where != c.nodeID {
		t.Fatalf("resumed on %q", where)
	}
	if r := b.run(t, paused, "cat /home/user/f"); r.stdout != "kept\n" {
		t.Fatalf("file after the move: %+v", r)
	}
	after := counter(t, b, paused)
	if after < before {
		t.Fatalf("counter went back from %d to %d: the process restarted", before, after)
	}
	testutil.Eventually(t, 10*time.Second, "the counter goes on", func() bool { return counter(t, b, paused) > after })
	if n := listedTimes(t, b, "/v2/sandboxes", paused.SandboxID, "running"); n != 1 {
		t.Fatalf("the moved sandbox listed %d times as running", n)
	}

	// A's running sandbox is lost; creates avoid A.
	testutil.Eventually(t, 15*time.Second, "A's running sandbox reported lost", func() bool {
		code, body := b.apiBody(t, "GET", "/sandboxes/"+running.SandboxID, nil, nil)
		return code == 404 && strings.Contains(body, "lost with node "+a.nodeID)
	})
	for i := 0; i < 4; i++ {
		s := nodes[1+i%2].create(t, nil)
		if n := nodeOf(t, b, s.SandboxID); n == a.nodeID || n == "" {
			t.Fatalf("create landed on %q with %s dead", n, a.nodeID)
		}
	}

	// A back: empty, and taking work.
	if err := a.start(); err != nil {
		t.Fatalf("restart %s: %v\n%s", a.nodeID, err, a.logs())
	}
	testutil.Eventually(t, 30*time.Second, "the restarted node holds nothing", func() bool {
		var n nodeJSON
		return a.api(t, "GET", "/nodes/"+a.nodeID, nil, &n) == 200 && n.State == "active" && len(n.Sandboxes) == 0
	})
	if r := a.run(t, paused, "cat /home/user/f"); r.stdout != "kept\n" {
		t.Fatalf("the moved sandbox through the restarted node: %+v", r)
	}
	took := false
	for i := 0; i < 12 && !took; i++ {
		s := nodes[i%3].create(t, nil)
		took = nodeOf(t, a, s.SandboxID) == a.nodeID
	}
	if !took {
		t.Fatal("the restarted node took no create in 12")
	}

	// Drain: the node holding the moved sandbox pauses it into the store; it resumes elsewhere.
	holder := b
	if where == c.nodeID {
		holder = c
	}
	drain(t, a, holder, true)
	testutil.Eventually(t, 30*time.Second, "the drained node paused its sandbox into the store", func() bool {
		var s sbx
		return strings.Contains(holder.logLines(paused.SandboxID, 50), "drain: paused into the image store") &&
			a.api(t, "GET", "/sandboxes/"+paused.SandboxID, nil, &s) == 200 && s.State == "paused"
	})
	if code, body := a.apiBody(t, "POST", "/v2/sandboxes/"+paused.SandboxID+"/connect", map[string]any{"timeout": 600}, nil); code != 201 && code != 200 {
		var lines []string
		for _, n := range nodes {
			lines = append(lines, "--- "+n.nodeID+":\n"+n.logLines(paused.SandboxID, 25))
		}
		t.Fatalf("resume of a drained node's sandbox: %d %s\n%s", code, body, strings.Join(lines, "\n"))
	}
	if n := nodeOf(t, a, paused.SandboxID); n == holder.nodeID || n == "" {
		t.Fatalf("resumed on %q, the drained node", n)
	}
	if r := a.run(t, paused, "cat /home/user/f"); r.stdout != "kept\n" {
		t.Fatalf("file after the drain: %+v", r)
	}
	drain(t, a, holder, false)

	// Fork: children placed over the nodes restore from one stored fork image, and diverge.
	var forked []struct {
		Sandbox *sbx `json:"sandbox"`
		Error   *struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	t0 = time.Now()
	if code, body := c.apiBody(t, "POST", "/sandboxes/"+paused.SandboxID+"/fork", map[string]any{"count": 4, "timeout": 300}, &forked); code != 201 {
		t.Fatalf("fork through %s: %d %s", c.nodeID, code, body)
	}
	t.Logf("fork of 4 across nodes took %v", time.Since(t0).Round(time.Millisecond))
	spread := map[string]int{}
	for i, f := range forked {
		if f.Sandbox == nil {
			t.Fatalf("fork child %d failed: %+v", i, f.Error)
		}
		ch := *f.Sandbox
		t.Cleanup(func() { a.api(t, "DELETE", "/sandboxes/"+ch.SandboxID, nil, nil) })
		spread[nodeOf(t, a, ch.SandboxID)]++
		if r := nodes[i%3].run(t, ch, "cat /home/user/f"); r.stdout != "kept\n" {
			t.Fatalf("child %d's file: %+v", i, r)
		}
		nodes[i%3].run(t, ch, fmt.Sprintf("echo child-%d > /home/user/d", i))
	}
	t.Logf("fork children: %v", spread)
	if len(spread) < 2 || spread[""] > 0 {
		t.Fatalf("4 fork children on %v: want at least two nodes", spread)
	}
	for i, f := range forked {
		if r := nodes[(i+1)%3].run(t, *f.Sandbox, "cat /home/user/d"); r.stdout != fmt.Sprintf("child-%d\n", i) {
			t.Fatalf("child %d did not diverge: %+v", i, r)
		}
	}
	if r := a.run(t, paused, "cat /home/user/d 2>/dev/null || echo none"); r.stdout != "none\n" {
		t.Fatalf("the parent sees a child's write: %+v", r)
	}
}
