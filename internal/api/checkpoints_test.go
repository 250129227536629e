package api

import (
	"strings"
	"testing"

	"github.com/ember-sandbox/ember/internal/sandbox"
)

// The checkpoint routes: shapes, the tree, rollback, fork and snapshot from a checkpoint, and
// every error as {"code","message"} with the right status.
func TestCheckpointRoutes(t *testing.T) {
	e := newEnv(t)
	sb := e.fake.add(sandbox.StateRunning, nil)
	other := e.fake.add(sandbox.StateRunning, nil)
	base := "/sandboxes/" + sb.ID

	take := func(id string) checkpointJSON {
		t.Helper()
		r := e.ctl("POST", "/sandboxes/"+id+"/checkpoints", "")
		if r.status != 201 {
			t.Fatalf("checkpoint %d %s", r.status, r.body)
		}
		var c checkpointJSON
		r.json(t, &c)
		if c.CheckpointID == "" || c.CreatedAt.IsZero() || !c.Current {
			t.Fatalf("checkpoint %s", r.body)
		}
		return c
	}
	a := take(sb.ID)
	if a.ParentID != nil || !strings.Contains(string(e.ctl("POST", base+"/checkpoints", "").body), `"parentID":"`+a.CheckpointID+`"`) {
		t.Fatalf("parents: first %+v", a)
	}
	// Rollback to A, then C's parent is A.
	r := e.ctl("POST", base+"/rollback", `{"checkpointID":"`+a.CheckpointID+`"}`)
	if r.status != 200 {
		t.Fatalf("rollback %d %s", r.status, r.body)
	}
	var rs sandboxJSON
	r.json(t, &rs)
	if rs.SandboxID != sb.ID || rs.EnvdAccessToken != sb.AccessToken {
		t.Fatalf("rollback answered %s", r.body)
	}
	c := take(sb.ID)
	if c.ParentID == nil || *c.ParentID != a.CheckpointID {
		t.Fatalf("C after a rollback to A: %+v", c)
	}
	var list []checkpointJSON
	e.ctl("GET", base+"/checkpoints", "").json(t, &list)
	if len(list) != 3 || list[0].CheckpointID != a.CheckpointID || !list[2].Current || list[0].Current {
		t.Fatalf("list %+v", list)
	}

	// Fork and snapshot from A.
	r = e.ctl("POST", base+"/fork", `{"count":2,"checkpointID":"`+a.CheckpointID+`"}`)
	var fr []forkResultJSON
	r.json(t, &fr)
	if r.status != 201 || len(fr) != 2 || fr[0].Sandbox == nil || fr[1].Sandbox == nil {
		t.Fatalf("fork from a checkpoint %d %s", r.status, r.body)
	}
	r = e.ctl("POST", base+"/snapshots", `{"name":"from-a","checkpointID":"`+a.CheckpointID+`"}`)
	if r.status != 201 {
		t.Fatalf("snapshot from a checkpoint %d %s", r.status, r.body)
	}

	// Errors.
	oc := take(other.ID)
	unknown := "ckpt-000000000000"
	for _, tc := range []struct {
		method, path, body string
		status             int
		msg                string
	}{
		{"POST", base + "/rollback", `{"checkpointID":"` + unknown + `"}`, 404, "checkpoint"},
		{"POST", base + "/rollback", `{"checkpointID":"` + oc.CheckpointID + `"}`, 404, "checkpoint"},
		{"DELETE", base + "/checkpoints/" + oc.CheckpointID, "", 404, "checkpoint"},
		{"POST", base + "/fork", `{"checkpointID":"` + oc.CheckpointID + `"}`, 404, "checkpoint"},
		{"POST", base + "/snapshots", `{"checkpointID":"` + unknown + `"}`, 404, "checkpoint"},
		{"POST", base + "/rollback", `{"checkpointID":"../x"}`, 400, "invalid checkpointID"},
		{"POST", base + "/rollback", `{}`, 400, "required"},
		{"POST", base + "/rollback", `{"checkpointID":`, 400, ""},
		{"POST", base + "/rollback", ``, 400, "required"},
		{"DELETE", base + "/checkpoints/NOT-AN-ID", "", 400, "invalid checkpointID"},
		{"POST", "/sandboxes/nosuch/checkpoints", "", 404, "doesn't exist"},
		{"GET", "/sandboxes/nosuch/checkpoints", "", 404, "doesn't exist"},
		{"POST", "/sandboxes/nosuch/rollback", `{"checkpointID":"` + a.CheckpointID + `"}`, 404, "doesn't exist"},
	} {
		r := e.ctl(tc.method, tc.path, tc.body)
		r.wantError(t, tc.status)
		if !strings.Contains(string(r.body), tc.msg) {
			t.Fatalf("%s %s %s: %s, want it to say %q", tc.method, tc.path, tc.body, r.body, tc.msg)
		}
	}

	// Delete, then it is gone.
	if r := e.ctl("DELETE", base+"/checkpoints/"+c.CheckpointID, ""); r.status != 204 {
		t.Fatalf("delete %d %s", r.status, r.body)
	}
	e.ctl("DELETE", base+"/checkpoints/"+c.CheckpointID, "").wantError(t, 404)
	e.ctl("POST", base+"/rollback", `{"checkpointID":"`+c.CheckpointID+`"}`).wantError(t, 404)

	// A files-only pause: no checkpoint, 409 with the reason; a rollback resumes it.
	if r := e.ctl("POST", base+"/pause", `{"memory":false}`); r.status != 204 {
		t.Fatalf("pause %d %s", r.status, r.body)
	}
	r = e.ctl("POST", base+"/checkpoints", "")
	r.wantError(t, 409)
	if !strings.Contains(string(r.body), "without its memory") {
		t.Fatalf("409 without the reason: %s", r.body)
	}
	if r := e.ctl("POST", base+"/rollback", `{"checkpointID":"`+a.CheckpointID+`"}`); r.status != 200 {
		t.Fatalf("rollback of a paused sandbox %d %s", r.status, r.body)
	}
	var got struct {
		State string `json:"state"`
	}
	e.ctl("GET", base, "").json(t, &got)
	if got.State != "running" {
		t.Fatalf("after rolling back a paused sandbox: %+v", got)
	}

	// Kill: every checkpoint goes with the sandbox.
	if r := e.ctl("DELETE", base, ""); r.status != 204 {
		t.Fatalf("kill %d %s", r.status, r.body)
	}
	e.ctl("GET", base+"/checkpoints", "").wantError(t, 404)
	e.ctl("POST", base+"/rollback", `{"checkpointID":"`+a.CheckpointID+`"}`).wantError(t, 404)
}
