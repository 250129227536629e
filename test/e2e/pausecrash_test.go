package e2e

import (
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestCrashRightAfterPause (issue 11 lever 3): a checkpoint pause answers once the memory image is written;
// the paused instance's processes exit and its writable layer moves into the image after the
// answer. kill -9 of the daemon right after the answer, before that move: at the next start the
// sandbox is paused, resumes with its files and processes, and nothing is leaked (instances,
// mounts, netns, instance dirs). Node c1.
func TestCrashRightAfterPause(t *testing.T) {
	// The window is the checkpoint pause's (hot pauses: TestHotPause).
	d := lostNode(t, "--pause-mode", "checkpoint")
	hits := 0
	for round := 0; round < 3; round++ {
		s := d.create(t, nil)
		d.run(t, s, "echo precious > /home/user/keep.txt")
		pid := d.background(t, s, "exec sleep 600")
		// No keep-alive connection of ours outlives the daemon (its port must be free again).
		http.DefaultTransport.(*http.Transport).CloseIdleConnections()
		if code := d.api(t, "POST", "/sandboxes/"+s.SandboxID+"/pause", map[string]any{}, nil); code != 204 {
			t.Fatalf("pause: %d\n%s", code, d.logs())
		}
		d.crash()
		// Did the kill land before the layer moved? Then the image has no layer yet and an
		// instance dir of the sandbox still holds it, owed to the image.
		dir := filepath.Join(d.dataDir, "sandboxes", s.SandboxID)
		images, _ := filepath.Glob(filepath.Join(dir, "image-*"))
		if len(images) != 1 {
			t.Fatalf("pause images in %s after the crash: %v", dir, images)
		}
		if _, err := os.Stat(filepath.Join(images[0], "layer")); os.IsNotExist(err) {
			owed := false
			runs, _ := filepath.Glob(filepath.Join(dir, "run-*", "layer-from"))
			for _, r := range runs {
				if b, _ := os.ReadFile(r); string(b) == images[0] {
					owed = true
				}
			}
			if !owed {
				t.Fatalf("the image %s has no layer and no instance dir owes it one: the sandbox's files are gone", images[0])
			}
			hits++
		}
		err := d.start()
		for i := 0; i < 5 && err != nil && strings.Contains(d.logs(), "address already in use"); i++ {
			time.Sleep(time.Second) // a connection of the dead daemon still holds its port
			err = d.start()
		}
		if err != nil {
			t.Fatalf("restart after kill -9: %v\n%s", err, d.logs())
		}
		var info sbx
		if code := d.api(t, "GET", "/sandboxes/"+s.SandboxID, nil, &info); code != 200 || info.State != "paused" {
			t.Fatalf("after the crash: %d, state %q, want paused\n%s", code, info.State, d.logs())
		}
		var again sbx
		if code := d.api(t, "POST", "/v2/sandboxes/"+s.SandboxID+"/connect", map[string]any{"timeout": 120}, &again); code != 201 {
			t.Fatalf("resume after the crash: %d\n%s", code, d.logs())
		}
		if r := d.run(t, again, "cat /home/user/keep.txt"); r.stdout != "precious\n" {
			t.Fatalf("file after the crash and resume: %q", r.stdout)
		}
		if pids := d.listPids(t, again); !strings.Contains(pids[pid], "sleep 600") {
			t.Fatalf("pid %d (sleep 600) not in envd's list after the crash and resume: %v", pid, pids)
		}
		if code := d.api(t, "DELETE", "/sandboxes/"+s.SandboxID, nil, nil); code != 204 {
			t.Fatalf("kill: %d", code)
		}
	}
	t.Logf("%d of 3 crashes landed before the layer reached the image", hits)
	if hits == 0 {
		t.Errorf("no crash landed between the pause's answer and its layer move: the window was not tested")
	}
	// Nothing leaked: what runs, once the pools have refilled, is theirs only.
	quiet := 0
	for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline) && quiet < 3; time.Sleep(500 * time.Millisecond) {
		busy := false
		for _, p := range d.runscProcs() {
			for _, cmd := range []string{" create ", " restore ", " delete ", " checkpoint "} {
				busy = busy || strings.Contains(p.args, cmd)
			}
		}
		if busy {
			quiet = 0
		} else {
			quiet++
		}
	}
	checkOnlyPool(t, d, d.host(), crashPoolSize, crashSlotPool)
}
