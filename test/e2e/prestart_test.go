package e2e

import (
	"fmt"
	"regexp"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/testutil"
)

// waitPrestarted waits (bounded) until runsc holds at least n pre-started instances (state
// "created") under the daemon's root and the daemon's pools hold them ready (GET /ember/pools:
// an instance is ready once its pre-start is done, a little after runsc says "created").
func (d *daemon) waitPrestarted(t *testing.T, n int, bound time.Duration) []instance {
	t.Helper()
	var pre []instance
	ready := 0
	testutil.EventuallyOr(t, bound, func() bool {
		pre = nil
		for _, i := range d.instances() {
			if i.Status == "created" {
				pre = append(pre, i)
			}
		}
		ready = 0
		var pools []struct {
			Kind  string `json:"kind"`
			Ready int    `json:"ready"`
		}
		if code, _, err := d.call(10*time.Second, "GET", "/ember/pools", nil, &pools); err == nil && code == 200 {
			for _, p := range pools {
				if p.Kind == "prestarted" || p.Kind == "resume" {
					ready += p.Ready
				}
			}
		}
		return len(pre) >= n && ready >= n
	}, func() string {
		return fmt.Sprintf("node %s: %d pre-started instances, %d ready in the pools, want %d\n%s", d.nodeID, len(pre), ready, n, d.logs())
	})
	return pre
}

// waitResumeInstance waits (bounded) until GET /ember/pools shows an instance pre-started for
// the resume of paused sandbox id.
func (d *daemon) waitResumeInstance(t *testing.T, id string) {
	t.Helper()
	testutil.EventuallyOr(t, 30*time.Second, func() bool {
		var pools []struct {
			Kind       string   `json:"kind"`
			SandboxIDs []string `json:"sandboxIDs"`
		}
		if code, _, err := d.call(10*time.Second, "GET", "/ember/pools", nil, &pools); err != nil || code != 200 {
			return false
		}
		for _, p := range pools {
			if p.Kind == "resume" && slices.Contains(p.SandboxIDs, id) {
				return true
			}
		}
		return false
	}, func() string { return fmt.Sprintf("no instance pre-started for the resume of %s\n%s", id, d.logs()) })
}

// TestPoolMissRestoresIntoPrestarted: with the restored pool off, a create restores the
// template's checkpoint into a pre-started instance (how=prestarted), which then works, pauses
// and resumes (into the instance pre-started for it) like any sandbox, and the pool of
// pre-started instances refills. Then the daemon is killed (kill -9) with pre-started instances
// present (the pool's, and a paused sandbox's holding its layer), and restarted: the running
// sandbox is adopted, the paused one resumes with its files, no runsc instance, process, netns,
// mount or directory is left but the new pools', and a clean stop after killing every sandbox
// leaves nothing. Node c1. Bound: ~1 min.
func TestPoolMissRestoresIntoPrestarted(t *testing.T) {
	// A checkpoint pause: its resume is the restore this test is about (a hot pause thaws).
	d := lostNode(t, "--pool-size", "0", "--pause-mode", "checkpoint")
	pre := d.waitPrestarted(t, 1, 90*time.Second)
	s := d.createNoCleanup(t, nil) // killAll below; the daemon is stopped at the end
	// The log line may not be read yet ("", as elsewhere); the pool's hits are checked below.
	if how := d.createdHow(s.SandboxID); how != "" && how != "prestarted" {
		t.Fatalf("restored pool off, %d pre-started: sandbox created by %q, want prestarted\n%s", len(pre), how, d.logs())
	}
	if r := d.run(t, s, "hostname; echo kept > /home/user/k.txt && cat /home/user/k.txt"); r.exitCode != 0 || r.stdout != "sandbox\nkept\n" {
		t.Fatalf("a sandbox restored into a pre-started instance: %+v", r)
	}
	d.waitPrestarted(t, 1, 30*time.Second) // refilled
	other := d.createNoCleanup(t, nil)
	if r := d.run(t, other, "cat /home/user/k.txt 2>&1 || echo absent"); r.stdout == "kept\n" {
		t.Fatalf("a second sandbox sees the first one's file: %+v", r)
	}
	if code := d.api(t, "POST", "/sandboxes/"+s.SandboxID+"/pause", map[string]any{}, nil); code != 204 {
		t.Fatalf("pause: %d", code)
	}
	d.waitResumeInstance(t, s.SandboxID)
	var again sbx
	if code := d.api(t, "POST", "/v2/sandboxes/"+s.SandboxID+"/connect", map[string]any{"timeout": 120}, &again); code != 201 {
		t.Fatalf("resume: %d", code)
	}
	if r := d.run(t, again, "cat /home/user/k.txt"); r.stdout != "kept\n" {
		t.Fatalf("after resume: %+v", r)
	}
	if m := regexp.MustCompile(`msg="sandbox resumed"[^\n]*sandbox_id=` + s.SandboxID + `[^\n]*prestarted=(\w+)`).FindStringSubmatch(d.allLogs()); m != nil && m[1] != "true" {
		t.Fatalf("the resume did not restore into the instance pre-started for it: prestarted=%s", m[1])
	}
	var pools []struct {
		TemplateID string `json:"templateID"`
		Kind       string `json:"kind"`
		Ready      int    `json:"ready"`
		Hits       int    `json:"hits"`
	}
	if code, _, err := d.call(10*time.Second, "GET", "/ember/pools", nil, &pools); err != nil || code != 200 {
		t.Fatalf("GET /ember/pools: %d %v", code, err)
	}
	hits := 0
	for _, p := range pools {
		if p.Kind == "prestarted" {
			hits += p.Hits
		}
	}
	if hits < 2 {
		t.Fatalf("GET /ember/pools: %+v, want pre-started hits for the two creates", pools)
	}

	// kill -9 with pre-started instances present: one for the pool, one for the resume of a
	// paused sandbox (its layer moved into it).
	if r := d.run(t, other, "echo mine > /home/user/o.txt"); r.exitCode != 0 {
		t.Fatalf("write: %+v", r)
	}
	if code := d.api(t, "POST", "/sandboxes/"+other.SandboxID+"/pause", map[string]any{}, nil); code != 204 {
		t.Fatalf("pause: %d", code)
	}
	d.waitResumeInstance(t, other.SandboxID)
	d.waitPrestarted(t, 2, 30*time.Second)
	d.restart(t, syscall.SIGKILL)
	if r := d.run(t, again, "cat /home/user/k.txt"); r.stdout != "kept\n" {
		t.Fatalf("after kill -9 and restart: %+v", r)
	}
	var back sbx
	if code := d.api(t, "POST", "/v2/sandboxes/"+other.SandboxID+"/connect", map[string]any{"timeout": 120}, &back); code != 201 {
		t.Fatalf("resume after kill -9 of a daemon whose resume instance held the layer: %d", code)
	}
	if r := d.run(t, back, "cat /home/user/o.txt"); r.stdout != "mine\n" {
		t.Fatalf("files after that resume: %+v", r)
	}
	d.killAll(t)
	var h hostState
	stable := 0
	for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline) && stable < 5; {
		time.Sleep(300 * time.Millisecond)
		cur := d.host()
		if cur.String() == h.String() {
			stable++
		} else {
			stable = 0
		}
		h = cur
	}
	t.Logf("after kill -9, restart and killing every sandbox: %s", h)
	checkOnlyPool(t, d, h, 0, crashSlotPool)
	if !d.stop() {
		t.Errorf("the daemon did not stop within 60 s of SIGTERM")
	}
	time.Sleep(500 * time.Millisecond)
	if after := d.host(); !after.empty() {
		t.Errorf("after a clean stop ember left: %s", after)
	}
}
