package e2e

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/testutil"
)

// A process that allocates far past the sandbox's memory (1 GiB by default) does not hang its
// caller: envd's guard kills the process and the sandbox lives on (TestOOMKillsOnlyTheProcess
// holds that strictly), or, when the guard cannot act, the sandbox is stopped, the command fails
// at once, and GET /sandboxes/{id} says "out of memory" (issue 8, limits; the gvisor package's
// TestMemoryLimitStopsSandbox shows that last resort without envd).
func TestMemoryLimitStopsTheSandboxWithAReason(t *testing.T) {
	d := need(t)
	s := d.create(t, nil)
	start := time.Now()
	r, err := d.tryRun(s, `python3 -c "x = bytearray(8 << 30)"`, "")
	took := time.Since(start)
	t.Logf("command: %v exit %d after %s", err, r.exitCode, took.Round(time.Millisecond))
	if err == nil && r.exitCode == 0 {
		t.Fatal("an 8 GiB allocation succeeded in a 1 GiB sandbox")
	}
	if took > 30*time.Second {
		t.Fatalf("the command took %s: it hung instead of failing", took)
	}
	code, body := 0, ""
	testutil.EventuallyOr(t, 5*time.Second, func() bool {
		code, body = d.apiBody(t, "GET", "/sandboxes/"+s.SandboxID, nil, nil)
		if code == 404 && strings.Contains(body, "out of memory") {
			t.Logf("GET: %s", body)
			return true
		}
		if code == 200 && (err != nil || r.exitCode != 0) {
			// The process alone was killed (by envd's guard: "signal: killed") and the
			// sandbox lives on: the usual case now.
			if rr := d.run(t, s, "echo alive"); rr.stdout == "alive\n" {
				t.Logf("the sandbox survived, the process was killed")
				return true
			}
		}
		return false
	}, func() string {
		return fmt.Sprintf("after the allocation: GET %d %s, want 404 naming out of memory", code, body)
	})
}

// A file written just before a pause is there after the resume, round after round: the
// sandbox's disk-limited layer (an ext4 image) must be flushed and really unmounted before the
// pause moves it, although the exiting gofer's mount namespace still holds it for a moment.
func TestWriteRightBeforePauseSurvives(t *testing.T) {
	d := need(t)
	s := d.create(t, nil)
	for i := 0; i < 8; i++ {
		want := "round-" + string(rune('a'+i))
		d.run(t, s, "echo "+want+" > /home/user/r.txt")
		if code := d.api(t, "POST", "/sandboxes/"+s.SandboxID+"/pause", map[string]any{}, nil); code != 204 {
			t.Fatalf("round %d: pause: %d", i, code)
		}
		var again sbx
		if code := d.api(t, "POST", "/v2/sandboxes/"+s.SandboxID+"/connect", map[string]any{"timeout": 120}, &again); code != 201 {
			t.Fatalf("round %d: resume: %d", i, code)
		}
		s = again
		if r := d.run(t, s, "cat /home/user/r.txt"); r.stdout != want+"\n" {
			t.Fatalf("round %d: a file written right before the pause reads %q after the resume (stderr %q)", i, r.stdout, r.stderr)
		}
	}
}
