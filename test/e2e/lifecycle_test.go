package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/testutil"
)

func TestDaemonCrashAndRestart(t *testing.T) {
	d := need(t)
	s := d.create(t, map[string]any{"metadata": map[string]string{"case": "restart"}})
	d.run(t, s, "echo before-crash > /home/user/c.txt")
	p := d.create(t, nil)
	d.run(t, p, "echo paused-file > /home/user/p.txt")
	if code := d.api(t, "POST", "/sandboxes/"+p.SandboxID+"/pause", map[string]any{}, nil); code != 204 {
		t.Fatalf("pause: %d", code)
	}
	// Pause answers once the sandbox is checkpointed and stopped; its slot and runsc state are
	// released right after. Wait for that before taking the reference.
	before := settledResources(t)

	d.crash()
	if err := d.start(); err != nil {
		t.Fatalf("restart: %v\n%s", err, d.logs())
	}
	var list []sbx
	if code := d.api(t, "GET", "/v2/sandboxes?metadata=case%3Drestart", nil, &list); code != 200 {
		t.Fatalf("list: %d", code)
	}
	if len(list) != 1 || list[0].SandboxID != s.SandboxID || list[0].State != "running" {
		t.Fatalf("after restart the running sandbox should be listed: %+v", list)
	}
	if r := d.run(t, s, "cat /home/user/c.txt"); r.stdout != "before-crash\n" {
		t.Fatalf("after restart: %q", r.stdout)
	}
	// The warm pool and the slot pool are rebuilt after a restart, and the pool's size follows
	// demand (the restarted daemon has seen none): nothing may be held beyond what was before.
	// (Loss is checked by reading the sandboxes' files.)
	after := settledResources(t)
	if !after.notMore(before) {
		t.Fatalf("restart leaked resources:\nbefore %s\nafter  %s", before.summary(), after.summary())
	}
	// The paused sandbox survived too and resumes with its file.
	var resumed sbx
	if code := d.api(t, "POST", "/v2/sandboxes/"+p.SandboxID+"/connect", map[string]any{"timeout": 120}, &resumed); code != 201 {
		t.Fatalf("resume after restart: %d\n%s", code, d.logs())
	}
	if r := d.run(t, resumed, "cat /home/user/p.txt"); r.stdout != "paused-file\n" {
		t.Fatalf("resumed after restart: %q", r.stdout)
	}
}

func TestPauseResumeKeepsProcessesAndFiles(t *testing.T) {
	d := need(t)
	s := d.create(t, nil)
	d.run(t, s, "echo survives > /home/user/keep.txt")
	pid := d.background(t, s, "exec sleep 600")
	inst, _ := d.instanceOf(t, s)
	if code := d.api(t, "POST", "/sandboxes/"+s.SandboxID+"/pause", map[string]any{}, nil); code != 204 {
		t.Fatalf("pause: %d", code)
	}
	if code := d.api(t, "POST", "/sandboxes/"+s.SandboxID+"/pause", map[string]any{}, nil); code != 409 {
		t.Fatalf("second pause: %d, want 409", code)
	}
	// A pause (hot, the default) freezes the sandbox's instance in place: runsc reports it
	// paused, and no command runs in it (TestHotPause: tiers, and the checkpoint pause that
	// releases the instance).
	if st, err := d.instanceState(inst.ID); err != nil || st.Status != "paused" {
		t.Fatalf("runsc state of the paused sandbox's instance %s: %+v %v, want paused", inst.ID, st, err)
	}
	var info sbx
	d.api(t, "GET", "/sandboxes/"+s.SandboxID, nil, &info)
	if info.State != "paused" || info.PausedIn != "memory" {
		t.Fatalf("state after pause: %q in %q, want paused in memory", info.State, info.PausedIn)
	}
	if _, err := d.tryRun(s, "true", ""); err == nil {
		t.Fatal("a paused sandbox still runs commands")
	}
	var again sbx
	if code := d.api(t, "POST", "/v2/sandboxes/"+s.SandboxID+"/connect", map[string]any{"timeout": 120}, &again); code != 201 {
		t.Fatalf("resume: %d", code)
	}
	if again.SandboxID != s.SandboxID || again.EnvdAccessToken != s.EnvdAccessToken {
		t.Fatalf("resume changed identity: %+v vs %+v", again, s)
	}
	if r := d.run(t, again, "cat /home/user/keep.txt"); r.stdout != "survives\n" {
		t.Fatalf("file after resume: %q", r.stdout)
	}
	if pids := d.listPids(t, again); !strings.Contains(pids[pid], "sleep 600") {
		t.Fatalf("pid %d (sleep 600) not in envd's list after resume: %v", pid, pids)
	}
	if code := d.api(t, "POST", "/v2/sandboxes/"+s.SandboxID+"/connect", map[string]any{"timeout": 120}, nil); code != 200 {
		t.Fatalf("connect to a running sandbox: %d, want 200", code)
	}
}

type forkItem struct {
	Sandbox *sbx `json:"sandbox"`
	Error   *struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	} `json:"error"`
}

func TestForkChildrenDiverge(t *testing.T) {
	d := need(t)
	parent := d.create(t, nil)
	d.run(t, parent, "echo from-parent > /home/user/x")
	var items []forkItem
	if code := d.api(t, "POST", "/sandboxes/"+parent.SandboxID+"/fork", map[string]any{"count": 8, "timeout": 120}, &items); code != 201 {
		t.Fatalf("fork: %d\n%s", code, d.logs())
	}
	if len(items) != 8 {
		t.Fatalf("fork returned %d items", len(items))
	}
	var kids []sbx
	for i, it := range items {
		if it.Sandbox == nil {
			t.Fatalf("child %d failed: %+v", i, it.Error)
		}
		kids = append(kids, *it.Sandbox)
		k := *it.Sandbox
		t.Cleanup(func() { d.api(t, "DELETE", "/sandboxes/"+k.SandboxID, nil, nil) })
	}
	var wg sync.WaitGroup
	errs := make(chan string, 64)
	for i, k := range kids {
		wg.Add(1)
		go func(i int, k sbx) {
			defer wg.Done()
			r, err := d.tryRun(k, fmt.Sprintf("cat /home/user/x && echo child-%d > /home/user/own", i), "")
			if err != nil || r.stdout != "from-parent\n" {
				errs <- fmt.Sprintf("child %d: %q %v", i, r.stdout, err)
			}
		}(i, k)
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
	for i, k := range kids {
		if r := d.run(t, k, "cat /home/user/own"); r.stdout != fmt.Sprintf("child-%d\n", i) {
			t.Errorf("child %d sees %q in its own file (a sibling's write leaked)", i, r.stdout)
		}
	}
	if r := d.run(t, parent, "test -e /home/user/own"); r.exitCode == 0 {
		t.Error("the parent sees a child's write")
	}
	if r := d.run(t, parent, "cat /home/user/x"); r.stdout != "from-parent\n" {
		t.Errorf("parent lost its file: %q", r.stdout)
	}
}

func TestSnapshotRestoresAsNewSandbox(t *testing.T) {
	d := need(t)
	src := d.create(t, nil)
	d.run(t, src, "echo in-snapshot > /home/user/s.txt")
	var snap struct {
		SnapshotID string `json:"snapshotID"`
	}
	if code := d.api(t, "POST", "/sandboxes/"+src.SandboxID+"/snapshots", map[string]any{"name": "e2e-snap"}, &snap); code != 201 {
		t.Fatalf("snapshot: %d", code)
	}
	t.Cleanup(func() { d.api(t, "DELETE", "/templates/"+snap.SnapshotID, nil, nil) })
	d.run(t, src, "echo changed-after > /home/user/s.txt")
	child := d.create(t, map[string]any{"templateID": snap.SnapshotID})
	if r := d.run(t, child, "cat /home/user/s.txt"); r.stdout != "in-snapshot\n" {
		t.Fatalf("sandbox from snapshot sees %q", r.stdout)
	}
	if r := d.run(t, src, "cat /home/user/s.txt"); r.stdout != "changed-after\n" {
		t.Fatalf("source after snapshot: %q", r.stdout)
	}
}

func TestCorruptSnapshotIsRefused(t *testing.T) {
	d := need(t)
	src := d.create(t, nil)
	var snap struct {
		SnapshotID string `json:"snapshotID"`
	}
	if code := d.api(t, "POST", "/sandboxes/"+src.SandboxID+"/snapshots", map[string]any{"name": "e2e-corrupt"}, &snap); code != 201 {
		t.Fatalf("snapshot: %d", code)
	}
	t.Cleanup(func() { d.api(t, "DELETE", "/templates/"+snap.SnapshotID, nil, nil) })
	// The snapshot answers once captured; its upload to the store follows. This node then
	// keeps its own capture as the local copy: remove it, so that the create below loads the
	// snapshot from the store, as another node would.
	snapState := ""
	testutil.EventuallyOr(t, 2*time.Minute, func() bool {
		snapState = d.snapshotState(t, snap.SnapshotID)
		return snapState == "stored"
	}, func() string {
		return fmt.Sprintf("snapshot %s %q, not stored\n%s", snap.SnapshotID, snapState, d.logs())
	})
	if err := os.RemoveAll(filepath.Join(d.dataDir, "images", snap.SnapshotID)); err != nil {
		t.Fatal(err)
	}
	// Flip one byte of the largest chunk this snapshot's manifest references.
	var manifest struct {
		Files []struct {
			Chunks []struct {
				Hash string `json:"hash"`
				Size int64  `json:"size"`
			} `json:"chunks"`
		} `json:"files"`
	}
	mb, err := os.ReadFile(filepath.Join(d.dataDir, "snapshots", "manifests", snap.SnapshotID+".json"))
	if err != nil {
		t.Fatalf("snapshot manifest: %v", err)
	}
	// The manifest is a JSON document followed by its signature line.
	if err := json.NewDecoder(bytes.NewReader(mb)).Decode(&manifest); err != nil {
		t.Fatalf("snapshot manifest: %v", err)
	}
	var biggest string
	var size int64
	for _, f := range manifest.Files {
		for _, c := range f.Chunks {
			p := filepath.Join(d.dataDir, "snapshots", "chunks", c.Hash[:2], c.Hash)
			if fi, err := os.Stat(p); err == nil && fi.Size() > size {
				biggest, size = p, fi.Size()
			}
		}
	}
	if biggest == "" {
		t.Fatalf("no stored chunk of %s found", snap.SnapshotID)
	}
	f, err := os.OpenFile(biggest, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 1)
	f.ReadAt(b, size/2)
	b[0] ^= 0xff
	f.WriteAt(b, size/2)
	f.Close()
	var s sbx
	code, body := d.apiBody(t, "POST", "/v2/sandboxes", map[string]any{"templateID": snap.SnapshotID}, &s)
	if code/100 == 2 {
		d.api(t, "DELETE", "/sandboxes/"+s.SandboxID, nil, nil)
		t.Fatalf("a sandbox was created from a corrupt snapshot (flipped a byte of %s)\n%s", biggest, d.logs())
	}
	if !strings.Contains(body, "checksum mismatch") || !strings.Contains(body, snap.SnapshotID) {
		t.Fatalf("create from a corrupt snapshot: %d %s, want an error naming the snapshot and the checksum mismatch", code, body)
	}
}

func TestTimeoutKillsOrAutoPauses(t *testing.T) {
	d := need(t)
	killed := d.create(t, map[string]any{"timeout": 2})
	paused := d.create(t, map[string]any{"timeout": 2, "autoPause": true})
	d.run(t, paused, "echo kept > /home/user/auto.txt")
	codeK, pausedState := 0, ""
	testutil.EventuallyOr(t, 20*time.Second, func() bool {
		var info sbx
		codeK = d.api(t, "GET", "/sandboxes/"+killed.SandboxID, nil, nil)
		d.api(t, "GET", "/sandboxes/"+paused.SandboxID, nil, &info)
		pausedState = info.State
		return codeK == 404 && pausedState == "paused"
	}, func() string {
		return fmt.Sprintf("after the timeout: plain sandbox status %d (want 404), autoPause sandbox state %q (want paused)", codeK, pausedState)
	})
	var again sbx
	if code := d.api(t, "POST", "/v2/sandboxes/"+paused.SandboxID+"/connect", map[string]any{"timeout": 60}, &again); code != 201 {
		t.Fatalf("resume auto-paused: %d", code)
	}
	if r := d.run(t, again, "cat /home/user/auto.txt"); r.stdout != "kept\n" {
		t.Fatalf("auto-paused sandbox lost its file: %q", r.stdout)
	}
}
