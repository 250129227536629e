package e2e

import (
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/cluster/clustertest"
	"github.com/ember-sandbox/ember/internal/snapshot/s3/s3test"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// Volumes in a 3-node cluster (issue 22): the volume is a directory of the cluster's S3 bucket,
// mounted with s3fs on every node, its record in etcd. Every edge answers /volumes and the
// content API; sandboxes on two nodes see each other's writes; a write past the volume's disk
// limit (held by C, the node on the S3 server's host) fails in a sandbox on A; a fork's child
// mounts the volume, and so does a paused sandbox resumed on another node; destroy is refused
// while they mount it; the volume outlives its sandboxes and a node restart.
func TestClusterVolumes(t *testing.T) {
	s3cfg, bucket := s3test.StartVolumeLimits(t)
	flags := append(storedFlags(clustertest.Start(t, 1), s3cfg), "--volume-size-mb", "8")
	nodes := addNodes(t, flags, nil, []string{"w1", "w2"}, 60)
	nodes = addNodes(t, append(slices.Clone(flags), "--volume-limit-dir", filepath.Join(bucket, "volumes")), nodes, []string{"w3"}, 62)
	a, b, c := nodes[0], nodes[1], nodes[2]
	t.Cleanup(func() {
		if t.Failed() {
			for _, n := range nodes {
				t.Logf("node %s:\n%s", n.nodeID, n.logs())
			}
		}
	})

	// Made through A: its create answers once C has mounted the volume's image.
	var v volumeInfo
	if code, body := a.apiBody(t, "POST", "/volumes", map[string]any{"name": "shared-x"}, &v); code != 201 {
		t.Fatalf("create volume through %s: %d %s", a.nodeID, code, body)
	}
	t.Cleanup(func() { c.api(t, "DELETE", "/volumes/"+v.VolumeID, nil, nil) })
	for _, n := range nodes {
		var got volumeInfo
		if code := n.api(t, "GET", "/volumes/shared-x", nil, &got); code != 200 || got != v {
			t.Fatalf("GET the volume through %s: %d %+v, want %+v", n.nodeID, code, got, v)
		}
		var list []volumeInfo
		if code := n.api(t, "GET", "/volumes", nil, &list); code != 200 || len(list) != 1 || list[0].VolumeID != v.VolumeID {
			t.Fatalf("list through %s: %d %+v", n.nodeID, code, list)
		}
	}

	// One sandbox on A, one on B: C drained (it holds nothing; a drain pauses what a node runs),
	// creates until both nodes have one.
	mounted := map[string]any{"volumeMounts": []map[string]string{{"name": "shared-x", "path": "/mnt/vol"}}, "timeout": 300}
	onAB := func() map[string]sbx {
		drain(t, c, c, true)
		defer drain(t, c, c, false)
		got := map[string]sbx{}
		for i := 0; i < 6 && len(got) < 2; i++ {
			s := c.create(t, mounted)
			n := nodeOf(t, c, s.SandboxID)
			if _, dup := got[n]; dup || (n != a.nodeID && n != b.nodeID) {
				c.api(t, "DELETE", "/sandboxes/"+s.SandboxID, nil, nil)
				continue
			}
			got[n] = s
		}
		if len(got) != 2 {
			t.Fatalf("6 creates with %s drained did not land on both %s and %s: %v", c.nodeID, a.nodeID, b.nodeID, got)
		}
		return got
	}
	placed := onAB()
	sa, sb := placed[a.nodeID], placed[b.nodeID]

	// Writes on one node are read on the other, both ways, and through the content API of the
	// third node.
	a.wantRun(t, sa, "echo from-a > /mnt/vol/a.txt && cat /mnt/vol/a.txt", "from-a\n")
	b.wantRun(t, sb, "cat /mnt/vol/a.txt", "from-a\n")
	b.run(t, sb, "mkdir -p /mnt/vol/dir && echo from-b > /mnt/vol/dir/b.txt")
	a.wantRun(t, sa, "cat /mnt/vol/dir/b.txt", "from-b\n")
	b.run(t, sb, "echo changed-on-b > /mnt/vol/a.txt")
	a.wantRun(t, sa, "cat /mnt/vol/a.txt", "changed-on-b\n")
	if code, body := c.volumeFile(t, v, "/dir/b.txt"); code != 200 || body != "from-b\n" {
		t.Fatalf("content API through %s: %d %q", c.nodeID, code, body)
	}

	// The disk limit (8 MiB): a 12 MiB file written on A fails at its fsync and close with
	// EIO (s3fs uploads it then; the S3 server's copy into the volume's image runs out of
	// space; what it copied stays, cut at the limit). Once it is deleted, B writes 4 MiB.
	t0 := time.Now()
	r := a.run(t, sa, "dd if=/dev/zero of=/mnt/vol/big bs=1M count=12 conv=fsync 2>&1; echo rc=$?; stat -c %s /mnt/vol/big")
	if !strings.Contains(r.stdout, "rc=1") || !strings.Contains(r.stdout, "Input/output error") {
		t.Fatalf("a write past the volume's limit on %s: %q, want dd to fail with EIO", a.nodeID, r.stdout)
	}
	t.Logf("12 MiB into an 8 MiB volume on %s (%v): %q", a.nodeID, time.Since(t0).Round(time.Millisecond), r.stdout)
	b.wantRun(t, sb, "rm -f /mnt/vol/big && dd if=/dev/zero of=/mnt/vol/f4 bs=1M count=4 conv=fsync 2>/dev/null && stat -c %s /mnt/vol/f4 && rm /mnt/vol/f4", "4194304\n")

	// With B and C drained (B's drain pauses sb into the store), a fork of sa has its child on
	// A, which mounts the volume; sb then resumes on another node than B with the volume
	// mounted.
	t0 = time.Now()
	drain(t, c, c, true)
	drain(t, c, b, true)
	var items []forkItem
	if code, body := a.apiBody(t, "POST", "/sandboxes/"+sa.SandboxID+"/fork", map[string]any{"count": 1, "timeout": 300}, &items); code != 201 || len(items) != 1 || items[0].Sandbox == nil {
		t.Fatalf("fork of %s: %d %s", sa.SandboxID, code, body)
	}
	kid := *items[0].Sandbox
	if n := nodeOf(t, c, kid.SandboxID); n != a.nodeID {
		t.Fatalf("fork child on %q with %s and %s drained", n, b.nodeID, c.nodeID)
	}
	a.wantRun(t, kid, "cat /mnt/vol/a.txt && echo from-kid > /mnt/vol/kid.txt", "changed-on-b\n")
	a.wantRun(t, sa, "cat /mnt/vol/kid.txt", "from-kid\n")
	drain(t, c, c, false)
	testutil.Eventually(t, 60*time.Second, "B's drain paused "+sb.SandboxID, func() bool {
		var got sbx
		return c.api(t, "GET", "/sandboxes/"+sb.SandboxID, nil, &got) == 200 && got.State == "paused"
	})
	if code, body := c.apiBody(t, "POST", "/v2/sandboxes/"+sb.SandboxID+"/connect", map[string]any{"timeout": 300}, nil); code != 200 && code != 201 {
		t.Fatalf("resume %s through %s: %d %s", sb.SandboxID, c.nodeID, code, body)
	}
	var there *daemon
	for _, n := range nodes {
		if n.nodeID == nodeOf(t, c, sb.SandboxID) {
			there = n
		}
	}
	if there == nil || there == b {
		t.Fatalf("%s resumed on %q, want a node other than %s", sb.SandboxID, nodeOf(t, c, sb.SandboxID), b.nodeID)
	}
	there.wantRun(t, sb, "cat /mnt/vol/kid.txt && echo moved > /mnt/vol/moved.txt", "from-kid\n")
	a.wantRun(t, kid, "cat /mnt/vol/moved.txt", "moved\n")
	drain(t, c, b, false)
	// B drops its copy once its sync sees the route moved. (Killed before that, the sandbox
	// would be B's again when B restarts below: its route is gone, B's copy looks like B's
	// own. A race of the cluster's sync, left to it.)
	testutil.Eventually(t, 30*time.Second, b.nodeID+" drops its copy of "+sb.SandboxID, func() bool {
		for _, i := range b.instances() {
			if strings.HasPrefix(i.ID, sb.SandboxID) {
				return false
			}
		}
		return true
	})
	t.Logf("fork on %s and move of a paused sandbox to %s with the volume: %v", a.nodeID, there.nodeID, time.Since(t0).Round(time.Millisecond))

	// Destroy is refused through B (it holds none of the sandboxes now).
	if code, body := b.apiBody(t, "DELETE", "/volumes/"+v.VolumeID, nil, nil); code != 409 || !strings.Contains(body, "is in use") {
		t.Fatalf("destroy through %s while mounted on %s and %s: %d %s", b.nodeID, a.nodeID, there.nodeID, code, body)
	}

	// The sandboxes go, B restarts: the volume and its files are there through B, and a new
	// sandbox on B reads them.
	for _, s := range []sbx{sa, sb, kid} {
		if code := c.api(t, "DELETE", "/sandboxes/"+s.SandboxID, nil, nil); code != 204 {
			t.Fatalf("kill %s: %d", s.SandboxID, code)
		}
	}
	b.restart(t, syscall.SIGTERM)
	var got volumeInfo
	if code := b.api(t, "GET", "/volumes/"+v.VolumeID, nil, &got); code != 200 || got != v {
		t.Fatalf("volume through %s after its restart: %d %+v", b.nodeID, code, got)
	}
	if code, body := b.volumeFile(t, v, "/a.txt"); code != 200 || body != "changed-on-b\n" {
		t.Fatalf("content API through %s after its restart: %d %q", b.nodeID, code, body)
	}
	drain(t, c, a, true) // A and C hold nothing now
	drain(t, c, c, true)
	sb2 := c.create(t, mounted)
	drain(t, c, a, false)
	drain(t, c, c, false)
	if n := nodeOf(t, c, sb2.SandboxID); n != b.nodeID {
		t.Fatalf("create with %s and %s drained landed on %q", a.nodeID, c.nodeID, n)
	}
	b.wantRun(t, sb2, "cat /mnt/vol/a.txt /mnt/vol/dir/b.txt", "changed-on-b\nfrom-b\n")
	if code := a.api(t, "DELETE", "/sandboxes/"+sb2.SandboxID, nil, nil); code != 204 {
		t.Fatalf("kill %s: %d", sb2.SandboxID, code)
	}

	// Unmounted everywhere: destroyed through A, gone through every edge.
	if code, body := a.apiBody(t, "DELETE", "/volumes/"+v.VolumeID, nil, nil); code != 204 {
		t.Fatalf("destroy through %s: %d %s", a.nodeID, code, body)
	}
	for _, n := range nodes {
		if code := n.api(t, "GET", "/volumes/"+v.VolumeID, nil, nil); code != 404 {
			t.Fatalf("GET the destroyed volume through %s: %d, want 404", n.nodeID, code)
		}
	}
}
