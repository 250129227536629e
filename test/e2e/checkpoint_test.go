package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/testutil"
)

type checkpointItem struct {
	CheckpointID string  `json:"checkpointID"`
	ParentID     *string `json:"parentID"`
	CreatedAt    string  `json:"createdAt"`
	Current      bool    `json:"current"`
	Standby      bool    `json:"standby"`
	StoppedMs    float64 `json:"stoppedMs"`
}

// counterCmd runs, in the background, a shell whose in-memory counter n goes up by one per
// line written to /dev/shm/poke and is written to /dev/shm/count each time: the counter lives
// in the shell's memory only (the file is its output).
const counterCmd = `rm -f /dev/shm/poke; mkfifo /dev/shm/poke; n=0; while :; do read -r _ < /dev/shm/poke; n=$((n+1)); echo $n > /dev/shm/count.tmp; mv /dev/shm/count.tmp /dev/shm/count; done`

// poke advances the counter once and returns its new value.
func poke(t *testing.T, d *daemon, s sbx) string {
	t.Helper()
	r := d.run(t, s, `before=$(cat /dev/shm/count 2>/dev/null); echo x > /dev/shm/poke; for i in $(seq 200); do c=$(cat /dev/shm/count 2>/dev/null); [ "$c" != "$before" ] && break; sleep 0.01; done; echo $c`)
	return strings.TrimSpace(r.stdout)
}

// Step checkpoints and rollback against real runsc: files, memory (a shell's counter, a tmpfs
// file) and processes return after a rollback; parents follow the head (A, B, rollback to A,
// C has parent A); fork from a checkpoint; hostile ids are 4xx; the checkpoints survive
// kill -9 of the daemon; a paused sandbox rolls back into running; kill removes every
// checkpoint file. The CLI takes, lists and rolls back too.
func TestCheckpointRollback(t *testing.T) {
	d := newDaemonWith(t, daemonOpts{})
	s := d.create(t, nil)
	other := d.create(t, nil)
	base := "/sandboxes/" + s.SandboxID

	take := func(s sbx) checkpointItem {
		t.Helper()
		var c checkpointItem
		if code, body := d.apiBody(t, "POST", "/sandboxes/"+s.SandboxID+"/checkpoints", nil, &c); code != 201 {
			t.Fatalf("checkpoint: %d %s\n%s", code, body, d.logs())
		}
		t.Logf("checkpoint %s parent %v stopped %.1f ms", c.CheckpointID, c.ParentID, c.StoppedMs)
		return c
	}
	rollback := func(cid string) sbx {
		t.Helper()
		var out sbx
		start := time.Now()
		if code, body := d.apiBody(t, "POST", base+"/rollback", map[string]any{"checkpointID": cid}, &out); code != 200 {
			t.Fatalf("rollback to %s: %d %s\n%s", cid, code, body, d.logs())
		}
		t.Logf("rollback to %s: %s", cid, time.Since(start).Round(time.Millisecond))
		if out.SandboxID != s.SandboxID || out.EnvdAccessToken != s.EnvdAccessToken {
			t.Fatalf("rollback changed identity: %+v vs %+v", out, s)
		}
		return out
	}
	state := func(want, count string, wantPids map[uint32]bool) {
		t.Helper()
		if r := d.run(t, s, "cat /home/user/f /dev/shm/m"); r.stdout != want+"\n"+want+"\n" {
			t.Fatalf("files after rollback: %q, want %s twice", r.stdout, want)
		}
		if got := poke(t, d, s); got != count {
			t.Fatalf("the shell's in-memory counter after rollback: %s, want %s", got, count)
		}
		pids := d.listPids(t, s)
		for pid, alive := range wantPids {
			if _, ok := pids[pid]; ok != alive {
				t.Fatalf("pid %d present %v, want %v (processes %v)", pid, ok, alive, pids)
			}
		}
	}

	counter := d.background(t, s, counterCmd)
	time.Sleep(200 * time.Millisecond)
	for i := 0; i < 3; i++ {
		poke(t, d, s)
	}
	d.run(t, s, "echo A > /home/user/f; echo A > /dev/shm/m")
	a := take(s)
	if a.ParentID != nil || !a.Current {
		t.Fatalf("first checkpoint %+v", a)
	}
	d.run(t, s, "echo B > /home/user/f; echo B > /dev/shm/m")
	poke(t, d, s)
	if got := poke(t, d, s); got != "5" {
		t.Fatalf("counter %s, want 5", got)
	}
	sleeper := d.background(t, s, "exec sleep 600")
	b := take(s)
	if b.ParentID == nil || *b.ParentID != a.CheckpointID {
		t.Fatalf("B's parent %v, want A %s", b.ParentID, a.CheckpointID)
	}

	rollback(a.CheckpointID)
	state("A", "4", map[uint32]bool{counter: true, sleeper: false})

	// Branch through the CLI: C's parent is A.
	d.run(t, s, "echo C > /home/user/f; echo C > /dev/shm/m")
	cli := func(args ...string) []byte {
		t.Helper()
		cmd := exec.Command(d.bin, append([]string{"--url", "http://" + d.addr, "--api-key", d.key, "--json", "sandbox"}, args...)...)
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("ember sandbox %v: %v\n%s", args, err, out)
		}
		return out
	}
	var c checkpointItem
	if err := json.Unmarshal(cli("checkpoint", s.SandboxID), &c); err != nil {
		t.Fatal(err)
	}
	if c.ParentID == nil || *c.ParentID != a.CheckpointID {
		t.Fatalf("C after a rollback to A: parent %v, want %s", c.ParentID, a.CheckpointID)
	}
	var list []checkpointItem
	if err := json.Unmarshal(cli("checkpoints", s.SandboxID), &list); err != nil {
		t.Fatal(err)
	}
	if len(list) != 3 || !list[2].Current || list[2].CheckpointID != c.CheckpointID {
		t.Fatalf("checkpoints: %+v", list)
	}

	// A rollback to the head (C) swaps in its standby, restored ahead and frozen: the same
	// files, memory and processes.
	d.run(t, s, "echo X > /home/user/f; echo X > /dev/shm/m")
	poke(t, d, s)
	testutil.EventuallyOr(t, 30*time.Second, func() bool {
		d.api(t, "GET", base+"/checkpoints", nil, &list)
		return len(list) == 3 && list[2].Standby
	}, func() string { return fmt.Sprintf("no standby of the head: %+v\n%s", list, d.logs()) })
	rollback(c.CheckpointID)
	swapped := func() bool {
		for _, l := range strings.Split(d.allLogs(), "\n") {
			if strings.Contains(l, "sandbox rolled back") && strings.Contains(l, "checkpoint="+c.CheckpointID) && strings.Contains(l, "standby=true") {
				return true
			}
		}
		return false
	}
	for i := 0; i < 50 && !swapped(); i++ {
		time.Sleep(50 * time.Millisecond) // the daemon's log reaches the test through a pipe
	}
	if !swapped() {
		t.Fatalf("the rollback to the head restored instead of swapping in its standby:\n%s", d.logs())
	}
	state("C", "5", map[uint32]bool{counter: true, sleeper: false})

	// Fork from B (not the head): the child has B's files and B's processes.
	var items []forkItem
	if code, body := d.apiBody(t, "POST", base+"/fork", map[string]any{"count": 1, "timeout": 120, "checkpointID": b.CheckpointID}, &items); code != 201 || len(items) != 1 || items[0].Sandbox == nil {
		t.Fatalf("fork from a checkpoint: %d %s", code, body)
	}
	child := *items[0].Sandbox
	if r := d.run(t, child, "cat /home/user/f /dev/shm/m"); r.stdout != "B\nB\n" {
		t.Fatalf("fork of B reads %q", r.stdout)
	}
	if pids := d.listPids(t, child); !strings.Contains(pids[sleeper], "sleep 600") {
		t.Fatalf("fork of B lacks B's sleep: %v", pids)
	}

	// Hostile input: another sandbox's checkpoint, unknown and malformed ids, a deleted one.
	oc := take(other)
	for _, tc := range []struct {
		method, path string
		body         any
		want         int
	}{
		{"POST", base + "/rollback", map[string]any{"checkpointID": oc.CheckpointID}, 404},
		{"POST", base + "/fork", map[string]any{"checkpointID": oc.CheckpointID}, 404},
		{"DELETE", base + "/checkpoints/" + oc.CheckpointID, nil, 404},
		{"POST", base + "/rollback", map[string]any{"checkpointID": "ckpt-000000000000"}, 404},
		{"POST", base + "/rollback", map[string]any{"checkpointID": "../../" + oc.CheckpointID}, 400},
		{"POST", base + "/rollback", map[string]any{}, 400},
	} {
		if code, body := d.apiBody(t, tc.method, tc.path, tc.body, nil); code != tc.want {
			t.Fatalf("%s %s %v: %d %s, want %d", tc.method, tc.path, tc.body, code, body, tc.want)
		}
	}
	if code := d.api(t, "DELETE", base+"/checkpoints/"+b.CheckpointID, nil, nil); code != 204 {
		t.Fatalf("delete B: %d", code)
	}
	if code := d.api(t, "POST", base+"/rollback", map[string]any{"checkpointID": b.CheckpointID}, nil); code != 404 {
		t.Fatalf("rollback to deleted B: %d", code)
	}
	// The other sandbox is untouched by all of it.
	if code := d.api(t, "GET", "/sandboxes/"+other.SandboxID+"/checkpoints", nil, &list); code != 200 || len(list) != 1 {
		t.Fatalf("other's checkpoints: %d %+v", code, list)
	}

	// kill -9 of the daemon: the checkpoints are still there and roll back.
	d.restart(t, syscall.SIGKILL)
	if code := d.api(t, "GET", base+"/checkpoints", nil, &list); code != 200 || len(list) != 2 || list[1].CheckpointID != c.CheckpointID || !list[1].Current {
		t.Fatalf("checkpoints after kill -9: %d %+v", code, list)
	}
	cli("rollback", s.SandboxID, c.CheckpointID)
	state("C", "5", map[uint32]bool{counter: true, sleeper: false})

	// A paused sandbox rolls back into running.
	if code := d.api(t, "POST", base+"/pause", map[string]any{}, nil); code != 204 {
		t.Fatalf("pause: %d", code)
	}
	if r := rollback(a.CheckpointID); r.State != "" && r.State != "running" {
		t.Fatalf("rolled back a paused sandbox into %q", r.State)
	}
	state("A", "4", map[uint32]bool{counter: true})

	// Kill: the checkpoints are gone (404), their images with the sandbox's directory, their
	// layers once nothing stacks them (B's stays while the fork child runs on it).
	if code := d.api(t, "DELETE", base, nil, nil); code != 204 {
		t.Fatalf("kill: %d", code)
	}
	if code := d.api(t, "GET", base+"/checkpoints", nil, nil); code != 404 {
		t.Fatalf("checkpoints of a killed sandbox: %d", code)
	}
	if _, err := os.Stat(filepath.Join(d.dataDir, "sandboxes", s.SandboxID)); !os.IsNotExist(err) {
		t.Fatalf("the killed sandbox's directory (checkpoint images): %v", err)
	}
	layers := func() []string {
		l, _ := filepath.Glob(filepath.Join(d.dataDir, "forks", "ckpt-*"))
		return l
	}
	waitLayers := func(want int) {
		t.Helper()
		testutil.EventuallyOr(t, 20*time.Second, func() bool { return len(layers()) == want }, func() string {
			return fmt.Sprintf("checkpoint layers %v, want %d", layers(), want)
		})
	}
	waitLayers(2) // B's (the fork child) and the other sandbox's
	for _, id := range []string{child.SandboxID, other.SandboxID} {
		if code := d.api(t, "DELETE", "/sandboxes/"+id, nil, nil); code != 204 {
			t.Fatalf("kill %s: %d", id, code)
		}
	}
	waitLayers(0)
}
