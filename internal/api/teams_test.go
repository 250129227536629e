package api

import (
	"net/http"
	"strings"
	"testing"
)

// teamEnv is newEnv with a second team: e.key is the default team's admin key, other the new
// team's first key.
func teamEnv(t *testing.T) (e *env, other string, otherTeam string) {
	t.Helper()
	e = newEnv(t)
	var tj teamJSON
	r := e.ctl("POST", "/ember/teams", `{"name":"b"}`)
	if r.status != http.StatusCreated {
		t.Fatalf("create team: %d %s", r.status, r.body)
	}
	r.json(t, &tj)
	if tj.Key == nil || tj.Key.Key == "" || tj.Key.Team != tj.ID || tj.Key.Admin {
		t.Fatalf("team's first key: %+v", tj.Key)
	}
	return e, tj.Key.Key, tj.ID
}

func (e *env) as(key, method, path, body string) resp {
	e.t.Helper()
	return e.do(method, path, body, "X-API-Key", key)
}

// Another team's sandbox answers exactly as a missing one, on every route that names it, and
// is in none of its lists; its owner's routes work.
func TestTeamsSandboxIsInvisibleToAnotherTeam(t *testing.T) {
	e, b, _ := teamEnv(t)
	var sj sandboxJSON
	r := e.ctl("POST", "/sandboxes", `{"templateID":"base"}`)
	if r.status != http.StatusCreated {
		t.Fatalf("create: %d %s", r.status, r.body)
	}
	r.json(t, &sj)
	id := sj.SandboxID
	const missing = "0000000000000000000a"
	routes := []struct{ method, path, body string }{
		{"GET", "/sandboxes/%s", ""},
		{"DELETE", "/sandboxes/%s", ""},
		{"POST", "/sandboxes/%s/timeout", `{"timeout":60}`},
		{"POST", "/sandboxes/%s/refreshes", `{"duration":60}`},
		{"GET", "/sandboxes/%s/metrics", ""},
		{"POST", "/sandboxes/%s/pause", ""},
		{"POST", "/sandboxes/%s/connect", `{"timeout":60}`},
		{"POST", "/sandboxes/%s/resume", `{"timeout":60}`},
		{"POST", "/sandboxes/%s/snapshots", `{}`},
		{"POST", "/sandboxes/%s/fork", `{"count":1}`},
		{"PUT", "/sandboxes/%s/network", `{"allowInternetAccess":false}`},
		{"POST", "/sandboxes/%s/checkpoints", ""},
		{"GET", "/sandboxes/%s/checkpoints", ""},
		{"POST", "/sandboxes/%s/rollback", `{"checkpointID":"ckpt-0123456789ab"}`},
		{"DELETE", "/sandboxes/%s/checkpoints/ckpt-0123456789ab", ""},
	}
	for _, rt := range routes {
		got := e.as(b, rt.method, strings.ReplaceAll(rt.path, "%s", id), rt.body)
		want := e.as(b, rt.method, strings.ReplaceAll(rt.path, "%s", missing), rt.body)
		got.wantError(t, http.StatusNotFound)
		if strings.ReplaceAll(string(got.body), id, missing) != string(want.body) {
			t.Errorf("%s %s: another team's sandbox answers %s, a missing one %s", rt.method, rt.path, got.body, want.body)
		}
	}
	for _, path := range []string{"/sandboxes", "/v2/sandboxes", "/v2/sandboxes?state=running,paused", "/snapshots"} {
		if r := e.as(b, "GET", path, ""); r.status != http.StatusOK || strings.Contains(string(r.body), id) {
			t.Errorf("GET %s as the other team: %d %s", path, r.status, r.body)
		}
		if path != "/snapshots" {
			if r := e.ctl("GET", path, ""); !strings.Contains(string(r.body), id) {
				t.Errorf("GET %s as its team lists %s", path, r.body)
			}
		}
	}
	// Still the owner's, running.
	if r := e.ctl("GET", "/sandboxes/"+id, ""); r.status != http.StatusOK || !strings.Contains(string(r.body), `"running"`) {
		t.Fatalf("owner's get: %d %s", r.status, r.body)
	}
}

// A snapshot (and a template) of one team is neither listed for, nor usable by, another;
// public templates are.
func TestTeamsTemplatesAndSnapshots(t *testing.T) {
	e, b, _ := teamEnv(t)
	var sj sandboxJSON
	e.ctl("POST", "/sandboxes", `{"templateID":"base"}`).json(t, &sj)
	if r := e.ctl("POST", "/sandboxes/"+sj.SandboxID+"/snapshots", `{"name":"mine"}`); r.status != http.StatusCreated {
		t.Fatalf("snapshot: %d %s", r.status, r.body)
	}
	for _, path := range []string{"/templates", "/v2/templates", "/snapshots"} {
		r := e.as(b, "GET", path, "")
		if r.status != http.StatusOK || strings.Contains(string(r.body), `"mine"`) {
			t.Errorf("GET %s as the other team: %d %s", path, r.status, r.body)
		}
	}
	if r := e.as(b, "GET", "/templates", ""); !strings.Contains(string(r.body), `"base"`) {
		t.Errorf("the public base template is not listed for the other team: %s", r.body)
	}
	got := e.as(b, "POST", "/sandboxes", `{"templateID":"mine"}`)
	want := e.as(b, "POST", "/sandboxes", `{"templateID":"nosuch"}`)
	got.wantError(t, http.StatusNotFound)
	if strings.ReplaceAll(string(got.body), "mine", "nosuch") != string(want.body) {
		t.Errorf("create from another team's snapshot: %s; from a missing one: %s", got.body, want.body)
	}
	for _, rt := range []struct{ method, path string }{{"GET", "/templates/mine"}, {"DELETE", "/templates/mine"}, {"GET", "/templates/aliases/mine"}} {
		got := e.as(b, rt.method, rt.path, "")
		want := e.as(b, rt.method, strings.ReplaceAll(rt.path, "mine", "nosuch"), "")
		got.wantError(t, http.StatusNotFound)
		if strings.ReplaceAll(string(got.body), "mine", "nosuch") != string(want.body) || want.status != got.status {
			t.Errorf("%s %s of another team's: %s; of a missing one: %d %s", rt.method, rt.path, got.body, want.status, want.body)
		}
	}
	// Building under its name, or from it, is refused: from it as from a missing one.
	e.as(b, "POST", "/v3/templates", `{"name":"mine"}`).wantError(t, http.StatusConflict)
	var req struct{ TemplateID, BuildID string }
	e.as(b, "POST", "/v3/templates", `{"name":"from-mine"}`).json(t, &req)
	got = e.as(b, "POST", "/v2/templates/"+req.TemplateID+"/builds/"+req.BuildID, `{"fromTemplate":"mine","steps":[]}`)
	want = e.as(b, "POST", "/v2/templates/"+req.TemplateID+"/builds/"+req.BuildID, `{"fromTemplate":"nosuch","steps":[]}`)
	got.wantError(t, http.StatusNotFound)
	if strings.ReplaceAll(string(got.body), "mine", "nosuch") != string(want.body) || want.status != got.status {
		t.Errorf("a build from another team's snapshot: %s; from a missing one: %d %s", got.body, want.status, want.body)
	}
	// The other team uses base.
	if r := e.as(b, "POST", "/sandboxes", `{"templateID":"base"}`); r.status != http.StatusCreated {
		t.Fatalf("the other team's create from base: %d %s", r.status, r.body)
	}
	// Its owner still sees it.
	if r := e.ctl("GET", "/templates/mine", ""); r.status != http.StatusOK {
		t.Fatalf("owner's template get: %d %s", r.status, r.body)
	}
	// Made public by its owner (not by the other team): listed and usable by every team, and
	// still the owner's alone to change.
	e.as(b, "PATCH", "/templates/mine", `{"public":true}`).wantError(t, http.StatusNotFound)
	if r := e.ctl("PATCH", "/templates/mine", `{"public":true}`); r.status != http.StatusNoContent {
		t.Fatalf("publish: %d %s", r.status, r.body)
	}
	if r := e.as(b, "GET", "/templates", ""); !strings.Contains(string(r.body), `"mine"`) {
		t.Fatalf("a public template is not listed for the other team: %s", r.body)
	}
	if r := e.as(b, "POST", "/sandboxes", `{"templateID":"mine"}`); r.status != http.StatusCreated {
		t.Fatalf("the other team's create from a public template: %d %s", r.status, r.body)
	}
	e.as(b, "DELETE", "/templates/mine", "").wantError(t, http.StatusForbidden)
	e.as(b, "PATCH", "/templates/mine", `{"public":false}`).wantError(t, http.StatusForbidden)
	if r := e.ctl("PATCH", "/templates/mine", `{"public":false}`); r.status != http.StatusNoContent {
		t.Fatalf("unpublish: %d %s", r.status, r.body)
	}
	e.as(b, "GET", "/templates/mine", "").wantError(t, http.StatusNotFound)
}

// Keys and teams: a team's key sees and revokes its own team's keys only and manages no team;
// an admin key manages every team and its keys.
func TestTeamsKeysAndAdmin(t *testing.T) {
	e, b, bTeam := teamEnv(t)
	var ks []apiKeyJSON
	e.as(b, "GET", "/api-keys", "").json(t, &ks)
	if len(ks) != 1 || ks[0].Team != bTeam {
		t.Fatalf("the other team's key list: %+v", ks)
	}
	var own []apiKeyJSON
	e.ctl("GET", "/api-keys", "").json(t, &own)
	if len(own) != 1 || own[0].Team != "default" || !own[0].Admin {
		t.Fatalf("the default team's key list: %+v", own)
	}
	e.as(b, "DELETE", "/api-keys/"+own[0].ID, "").wantError(t, http.StatusNotFound)
	e.as(b, "GET", "/api-keys?team=default", "").wantError(t, http.StatusNotFound)
	e.as(b, "POST", "/api-keys", `{"team":"default"}`).wantError(t, http.StatusNotFound)
	e.as(b, "POST", "/api-keys", `{"admin":true}`).wantError(t, http.StatusForbidden)
	e.as(b, "POST", "/ember/teams", `{"name":"c"}`).wantError(t, http.StatusForbidden)
	e.as(b, "DELETE", "/ember/teams/default", "").wantError(t, http.StatusForbidden)
	var teams []teamJSON
	e.as(b, "GET", "/ember/teams", "").json(t, &teams)
	if len(teams) != 1 || teams[0].ID != bTeam {
		t.Fatalf("the other team's team list: %+v", teams)
	}

	// The admin key: a key for team b, every team's keys, then team b removed with its keys.
	var nk apiKeyJSON
	if r := e.ctl("POST", "/api-keys", `{"name":"b2","team":"`+bTeam+`"}`); r.status != http.StatusCreated {
		t.Fatalf("admin's key for team b: %d %s", r.status, r.body)
	} else {
		r.json(t, &nk)
	}
	if nk.Team != bTeam {
		t.Fatalf("admin's key for team b: %+v", nk)
	}
	var all []apiKeyJSON
	e.ctl("GET", "/api-keys?team=*", "").json(t, &all)
	if len(all) != 3 {
		t.Fatalf("every team's keys: %+v", all)
	}
	e.ctl("GET", "/ember/teams", "").json(t, &teams)
	if len(teams) != 2 {
		t.Fatalf("admin's team list: %+v", teams)
	}
	e.ctl("DELETE", "/ember/teams/default", "").wantError(t, http.StatusConflict)
	if r := e.ctl("DELETE", "/ember/teams/"+bTeam, ""); r.status != http.StatusNoContent {
		t.Fatalf("remove team b: %d %s", r.status, r.body)
	}
	e.as(nk.Key, "GET", "/sandboxes", "").wantError(t, http.StatusUnauthorized)
	e.as(b, "GET", "/sandboxes", "").wantError(t, http.StatusUnauthorized)
}

// A volume is its team's: another team neither lists, reads, destroys nor mounts it.
func TestTeamsVolumes(t *testing.T) {
	e, _ := newVolumeEnv(t)
	var tj teamJSON
	e.ctl("POST", "/ember/teams", `{"name":"b"}`).json(t, &tj)
	b := tj.Key.Key
	r := e.ctl("POST", "/volumes", `{"name":"data"}`)
	if r.status != http.StatusCreated {
		t.Fatalf("create volume: %d %s", r.status, r.body)
	}
	var v struct {
		ID string `json:"volumeID"`
	}
	r.json(t, &v)
	if r := e.as(b, "GET", "/volumes", ""); strings.Contains(string(r.body), v.ID) {
		t.Fatalf("listed for the other team: %s", r.body)
	}
	e.as(b, "GET", "/volumes/"+v.ID, "").wantError(t, http.StatusNotFound)
	e.as(b, "DELETE", "/volumes/"+v.ID, "").wantError(t, http.StatusNotFound)
	if r := e.as(b, "POST", "/sandboxes", `{"templateID":"base","volumeMounts":[{"name":"data","path":"/data"}]}`); r.status == http.StatusCreated {
		t.Fatalf("the other team mounted it: %s", r.body)
	}
	if r := e.ctl("GET", "/volumes/"+v.ID, ""); r.status != http.StatusOK {
		t.Fatalf("owner's get: %d %s", r.status, r.body)
	}
}
