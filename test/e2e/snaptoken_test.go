package e2e

import (
	"strings"
	"testing"
	"time"
)

// TestSnapshotTokenSwapCrash (issue 19): a snapshot's image holds a token of its own, so for
// the time of its checkpoint the source's envd holds that token. kill -9 of the daemon between
// the two /init calls (EMBER_CRASH_AT: right after the checkpoint, before the sandbox's own
// token is given back): at the next start the sandbox answers its clients with its own token
// again, keeps its files, and a snapshot taken then starts sandboxes that answer with tokens
// of their own while the source keeps its own. Node c1. Bound: ~1 min.
func TestSnapshotTokenSwapCrash(t *testing.T) {
	d := lostNode(t)
	d.stop()
	d.env = []string{"EMBER_CRASH_AT=snapshot-token-checkpointed"}
	if err := d.start(); err != nil {
		t.Fatalf("start with the crash point: %v\n%s", err, d.logs())
	}
	s := d.createNoCleanup(t, nil)
	defer d.call(30*time.Second, "DELETE", "/sandboxes/"+s.SandboxID, nil, nil)
	d.run(t, s, "echo precious > /home/user/keep.txt")
	code, body, err := d.call(2*time.Minute, "POST", "/sandboxes/"+s.SandboxID+"/snapshots", map[string]any{"name": "swapcut"}, nil)
	if err == nil {
		t.Fatalf("the snapshot answered %d %s: the daemon did not die at the crash point\n%s", code, body, d.logs())
	}
	select {
	case <-d.done:
	case <-time.After(30 * time.Second):
		t.Fatalf("the daemon still runs after its crash point\n%s", d.logs())
	}
	d.env = nil
	err = d.start()
	for i := 0; i < 5 && err != nil && strings.Contains(d.logs(), "address already in use"); i++ {
		time.Sleep(time.Second) // a connection of the dead daemon still holds its port
		err = d.start()
	}
	if err != nil {
		t.Fatalf("restart after the crash: %v\n%s", err, d.logs())
	}
	// The sandbox answers with its own token: no 401.
	if r, err := d.tryRun(s, "cat /home/user/keep.txt", ""); err != nil || r.stdout != "precious\n" {
		t.Fatalf("the source after the crash: %q %v (its envd kept the snapshot's token?)\n%s", r.stdout, err, d.logs())
	}
	// A snapshot now: its sandboxes start (their /init authenticates with the snapshot's own
	// token) and answer with their own tokens; the source keeps its own.
	var snap struct {
		SnapshotID string `json:"snapshotID"`
	}
	if code, body := d.apiBody(t, "POST", "/sandboxes/"+s.SandboxID+"/snapshots", map[string]any{"name": "swapok"}, &snap); code != 201 {
		t.Fatalf("snapshot after the restart: %d %s\n%s", code, body, d.logs())
	}
	defer d.call(30*time.Second, "DELETE", "/templates/"+snap.SnapshotID, nil, nil)
	c := d.create(t, map[string]any{"templateID": snap.SnapshotID})
	if c.EnvdAccessToken == "" || c.EnvdAccessToken == s.EnvdAccessToken {
		t.Fatalf("the snapshot's sandbox has token %q, the source %q: want one of its own", c.EnvdAccessToken, s.EnvdAccessToken)
	}
	if r := d.run(t, c, "cat /home/user/keep.txt"); r.stdout != "precious\n" {
		t.Fatalf("the snapshot's sandbox reads %q", r.stdout)
	}
	if _, err := d.tryRun(sbx{SandboxID: c.SandboxID, EnvdAccessToken: s.EnvdAccessToken}, "true", ""); err == nil {
		t.Fatal("the snapshot's sandbox accepts the source's token")
	}
	if r, err := d.tryRun(s, "echo still", ""); err != nil || r.stdout != "still\n" {
		t.Fatalf("the source after the second snapshot: %q %v", r.stdout, err)
	}
}
