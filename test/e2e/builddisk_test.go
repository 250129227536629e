package e2e

import (
	"strings"
	"testing"
	"time"
)

// Builds cannot fill the node's disk: a build sandbox's writable layer and a template's
// warm-up have the node's disk limit (--disk-mb), so a step or a start command writing past it
// fails with ENOSPC inside, and the template built still restores (its image holds a plain
// layer, the sandboxes their own limit).
func TestBuildsHaveADiskLimit(t *testing.T) {
	d := newDaemonWith(t, daemonOpts{Flags: []string{"--disk-mb", "64", "--pool-size", "0", "--prestart-max", "0"}})
	status, logs := d.stepBuild(t, "disk-step", map[string]any{"fromTemplate": "base", "steps": []map[string]any{
		{"type": "RUN", "args": []string{"dd if=/dev/zero of=/home/user/big bs=1M count=128"}},
	}})
	if status != "error" || !strings.Contains(logs, "No space left on device") {
		t.Fatalf("a step writing 128 MiB past a 64 MiB limit: %s\n%s", status, logs)
	}
	status, logs = d.stepBuild(t, "disk-warm", map[string]any{"fromTemplate": "base",
		"steps":    []map[string]any{{"type": "RUN", "args": []string{"echo small > /home/user/small"}}},
		"startCmd": "dd if=/dev/zero of=/home/user/big bs=1M count=128 2>/home/user/dd.err; touch /home/user/done",
		"readyCmd": "test -f /home/user/done"})
	if status != "ready" {
		t.Fatalf("build with a start command: %s\n%s", status, logs)
	}
	var s sbx
	if code, body, err := d.call(2*time.Minute, "POST", "/v2/sandboxes", map[string]any{"templateID": "disk-warm"}, &s); err != nil || code != 201 {
		t.Fatalf("create from disk-warm: %d %s %v", code, body, err)
	}
	defer d.call(time.Minute, "DELETE", "/sandboxes/"+s.SandboxID, nil, nil)
	r := d.run(t, s, "cat /home/user/small; cat /home/user/dd.err")
	if !strings.HasPrefix(r.stdout, "small\n") || !strings.Contains(r.stdout, "No space left on device") {
		t.Fatalf("the warm-up's start command wrote past the limit: %q", r.stdout)
	}
}
