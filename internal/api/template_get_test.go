package api

import (
	"testing"

	"github.com/ember-sandbox/ember/internal/sandbox"
)

// A snapshot says where its image is in its create answer, in GET /snapshots, GET /templates
// and GET /templates/{id}; an unknown id is E2B's 404.
func TestSnapshotStateIsVisible(t *testing.T) {
	e := newEnv(t)
	src := e.fake.add(sandbox.StateRunning, nil)
	r := e.ctl("POST", "/sandboxes/"+src.ID+"/snapshots", `{"name":"vis"}`)
	var created createSnapshotResponse
	r.json(t, &created)
	if created.SnapshotID != "vis" || created.State != sandbox.SnapshotLocal {
		t.Fatalf("create answer %+v", created)
	}
	var list []snapshotJSON
	e.ctl("GET", "/snapshots", "").json(t, &list)
	if len(list) != 1 || list[0].State != sandbox.SnapshotLocal {
		t.Fatalf("GET /snapshots %+v", list)
	}
	var tpl templateJSON
	e.ctl("GET", "/templates/vis", "").json(t, &tpl)
	if tpl.TemplateID != "vis" || tpl.Kind != "snapshot" || tpl.SnapshotState != sandbox.SnapshotLocal {
		t.Fatalf("GET /templates/vis %+v", tpl)
	}
	r = e.ctl("GET", "/templates/nope", "")
	r.wantError(t, 404)
	var eb errorBody
	r.json(t, &eb)
	if eb.Message != "template 'nope' not found" {
		t.Fatalf("404 message %q", eb.Message)
	}
}
