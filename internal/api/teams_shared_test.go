package api

import (
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/ember-sandbox/ember/internal/sandbox"
)

// addTeam makes team "b" through e's admin key: its key and id.
func (e *env) addTeam() (key, id string) {
	e.t.Helper()
	var tj teamJSON
	r := e.ctl("POST", "/ember/teams", `{"name":"b"}`)
	if r.status != http.StatusCreated {
		e.t.Fatalf("create team: %d %s", r.status, r.body)
	}
	r.json(e.t, &tj)
	return tj.Key.Key, tj.ID
}

// importAs uploads an image archive as key's team: its name.
func (e *env) importAs(key string) string {
	e.t.Helper()
	r := e.do("POST", "/ember/imports", "not really a tarball", "X-API-Key", key, "Content-Type", "application/octet-stream")
	if r.status != http.StatusCreated {
		e.t.Fatalf("upload: %d %s", r.status, r.body)
	}
	var imp struct{ Name string }
	r.json(e.t, &imp)
	return imp.Name
}

// An imported archive is its team's: another team's build from it answers as one from a
// missing import, and its delete as a missing one's; the owner's build works.
func TestTeamsImportsAreTheTeams(t *testing.T) {
	e, b, _ := teamEnv(t)
	mine, theirs := e.importAs(e.key), e.importAs(b)
	missing := e.as(b, "POST", "/ember/templates/x/build", `{"from":"archive:sha256-0000000000000000-00000000.tar"}`)
	missing.wantError(t, http.StatusBadRequest)
	for _, c := range []struct{ key, name string }{{b, mine}, {e.key, theirs}} {
		r := e.as(c.key, "POST", "/ember/templates/x/build", `{"from":"archive:`+c.name+`"}`)
		r.wantError(t, http.StatusBadRequest)
		if !strings.Contains(string(r.body), "no such import") {
			t.Fatalf("another team's import: %s (a missing one: %s)", r.body, missing.body)
		}
		e.as(c.key, "DELETE", "/ember/imports/"+c.name, "").wantError(t, http.StatusNotFound)
	}
	for _, c := range []struct{ key, name, tpl string }{{b, theirs, "bt"}, {e.key, mine, "at"}} {
		r := e.as(c.key, "POST", "/ember/templates/"+c.tpl+"/build", `{"from":"archive:`+c.name+`"}`)
		if lines := ndjson(t, r.body); r.status != 200 || len(lines) == 0 || lines[len(lines)-1].Template == nil {
			t.Fatalf("build from its own import: %d %s", r.status, r.body)
		}
		if r := e.as(c.key, "DELETE", "/ember/imports/"+c.name, ""); r.status != http.StatusNoContent {
			t.Fatalf("delete own import: %d %s", r.status, r.body)
		}
	}
}

// COPY files are kept per team: a team that names the hash of another's upload is told it is
// not there (no probing) and gets a link of its own; a build of its steps cannot use another's.
func TestTeamsCopyUploadsAreTheTeams(t *testing.T) {
	e, b, _ := teamEnv(t)
	hash := strings.Repeat("ab", 32)
	var fr fileUploadResponse
	e.ctl("GET", "/templates/t1/files/"+hash, "").json(t, &fr)
	if fr.Present || fr.URL == "" {
		t.Fatalf("first ask: %+v", fr)
	}
	req, _ := http.NewRequest("PUT", fr.URL, strings.NewReader(emptyTar()))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("upload: %d", resp.StatusCode)
	}
	e.ctl("GET", "/templates/t1/files/"+hash, "").json(t, &fr)
	if !fr.Present {
		t.Fatalf("own upload not present: %+v", fr)
	}
	e.as(b, "GET", "/templates/t2/files/"+hash, "").json(t, &fr)
	if fr.Present || fr.URL == "" {
		t.Fatalf("another team's upload is visible by its hash: %+v", fr)
	}
}

// emptyTar is a tar archive with no entries.
func emptyTar() string { return strings.Repeat("\x00", 1024) }

// GET /ember/pools shows a team only the pools of templates it may use; an admin key all.
func TestTeamsPoolsAreTheTeams(t *testing.T) {
	e := poolEnv(t)
	b, _ := e.addTeam()
	// A private template of the first team's, with a pool; a plain key of that team.
	r := e.ctl("POST", "/ember/templates/private/build", `{"from":"archive:`+e.importAs(e.key)+`"}`)
	if lines := ndjson(t, r.body); len(lines) == 0 || lines[len(lines)-1].Template == nil {
		t.Fatalf("build: %s", r.body)
	}
	if r := e.ctl("POST", "/ember/pools/private/warm", `{"count":1}`); r.status != 200 {
		t.Fatalf("warm: %d %s", r.status, r.body)
	}
	var kj struct{ Key string }
	e.ctl("POST", "/api-keys", `{"name":"plain"}`).json(t, &kj)
	pools := func(key string) []sandbox.PoolState {
		var all []sandbox.PoolState
		e.as(key, "GET", "/ember/pools", "").json(t, &all)
		return all
	}
	has := func(ps []sandbox.PoolState) bool {
		for _, p := range ps {
			if p.TemplateID == "private" {
				return true
			}
		}
		return false
	}
	if has(pools(b)) {
		t.Fatalf("another team sees the pool of a private template: %+v", pools(b))
	}
	if !has(pools(e.key)) {
		t.Fatalf("the admin key does not see every pool: %+v", pools(e.key))
	}
	if kj.Key != "" && !has(pools(kj.Key)) {
		t.Fatalf("the owner team's key does not see its pool")
	}
}

// GET /metrics on the API listener holds every team's usage: an admin key's only.
func TestMetricsNeedAnAdminKey(t *testing.T) {
	metrics := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ember_up 1\n") })
	e := newEnvConfig(t, Config{Domain: testDomain, Metrics: metrics})
	b, _ := e.addTeam()
	e.as(b, "GET", "/metrics", "").wantError(t, http.StatusForbidden)
	if r := e.ctl("GET", "/metrics", ""); r.status != 200 || string(r.body) != "ember_up 1\n" {
		t.Fatalf("admin key: %d %s", r.status, r.body)
	}
}
