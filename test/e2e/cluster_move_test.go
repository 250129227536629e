package e2e

import (
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/cluster/clustertest"
	"github.com/ember-sandbox/ember/internal/snapshot/s3/s3test"
)

// storedCluster starts n ember nodes on a real etcd (members) and a real S3 server, sharing
// the cluster's API key and the key that signs stored images. Nodes start one after another:
// the first builds `base`, the others load it from the store.
func storedCluster(t *testing.T, members int, ids []string, cidrBase int) (*clustertest.Etcd, []*daemon) {
	t.Helper()
	e := clustertest.Start(t, members)
	s3 := s3test.Start(t)
	signKey := filepath.Join(t.TempDir(), "snapshot-key")
	flags := []string{"--etcd-endpoints", strings.Join(e.Endpoints(), ","), "--cluster-ttl", "5s", "--pool-size", "1",
		"--s3-endpoint", s3.Endpoint, "--s3-bucket", s3.Bucket, "--s3-access-key", s3.AccessKey, "--s3-secret-key", s3.SecretKey,
		"--snapshot-key-file", signKey}
	var nodes []*daemon
	for i, id := range ids {
		o := daemonOpts{NodeID: id, CIDR: nodeCIDR(cidrBase + i), Flags: flags}
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
		t0 := time.Now()
		nodes = append(nodes, newDaemonWith(t, o))
		t.Logf("node %s up in %v", nodes[i].nodeID, time.Since(t0).Round(time.Millisecond))
	}
	waitUntil(t, 30*time.Second, "every node sees every node", func() bool {
		var ns []nodeJSON
		return nodes[0].api(t, "GET", "/nodes", nil, &ns) == 200 && len(ns) == len(nodes)
	})
	return e, nodes
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
	waitUntil(t, 2*time.Minute, "the snapshot is the cluster's (listed through "+b.nodeID+")", func() bool {
		for _, x := range templatesOf(t, b) {
			if strings.HasPrefix(x, snap.SnapshotID+"@") {
				return true
			}
		}
		return false
	})
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
}
