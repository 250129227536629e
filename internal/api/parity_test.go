package api

import (
	"net/url"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// TestE2BErrorWording: the statuses and messages E2B's API gives for what the SDKs can hit.
func TestE2BErrorWording(t *testing.T) {
	e := newEnv(t)
	run := e.fake.add(sandbox.StateRunning, nil)
	paused := e.fake.add(sandbox.StatePaused, nil)
	past := time.Now().Unix() - 10
	notFound := func(id string) string { return `Sandbox "` + id + `" doesn't exist or you don't have access to it` }
	cases := []struct {
		name, method, path, body string
		status                   int
		msg                      string
	}{
		{"fork count 0 before the id", "POST", "/sandboxes/no-such-id/fork", `{"count":0}`, 400, "Count must be at least 1"},
		{"fork count 0, invalid id", "POST", "/sandboxes/NO_SUCH/fork", `{"count":0}`, 400, "Count must be at least 1"},
		{"fork count too big", "POST", "/sandboxes/" + run.ID + "/fork", `{"count":1000}`, 400, "Count cannot be greater than 64"},
		{"fork unknown", "POST", "/sandboxes/nosuch/fork", `{}`, 404, notFound("nosuch")},
		{"get unknown", "GET", "/sandboxes/nosuch", "", 404, notFound("nosuch")},
		{"get unknown with client id", "GET", "/sandboxes/nosuch-client", "", 404, notFound("nosuch")},
		{"kill unknown", "DELETE", "/sandboxes/nosuch", "", 404, notFound("nosuch")},
		{"timeout unknown", "POST", "/sandboxes/nosuch/timeout", `{"timeout":10}`, 404, notFound("nosuch")},
		{"timeout paused", "POST", "/sandboxes/" + paused.ID + "/timeout", `{"timeout":10}`, 404, notFound(paused.ID)},
		{"pause unknown", "POST", "/sandboxes/nosuch/pause", `{}`, 404, notFound("nosuch")},
		{"pause paused", "POST", "/sandboxes/" + paused.ID + "/pause", `{}`, 409, "Error pausing sandbox - sandbox '" + paused.ID + "' is already paused"},
		{"connect unknown", "POST", "/v2/sandboxes/nosuch/connect", `{}`, 404, notFound("nosuch")},
		{"metrics unknown", "GET", "/sandboxes/nosuch/metrics", "", 404, notFound("nosuch")},
		{"snapshot unknown", "POST", "/sandboxes/nosuch/snapshots", `{}`, 404, notFound("nosuch")},
		{"alias unknown", "GET", "/templates/aliases/nope", "", 404, "template 'nope' not found"},
		{"create unknown template", "POST", "/v2/sandboxes", `{"templateID":"nope"}`, 404, "template 'nope' not found"},
		{"create unknown template v1", "POST", "/sandboxes", `{"templateID":"no:pe"}`, 404, "template 'no:pe' not found"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := e.ctl(tc.method, tc.path, tc.body)
			r.wantError(t, tc.status)
			var eb errorBody
			r.json(t, &eb)
			if eb.Message != tc.msg {
				t.Fatalf("message %q, want %q", eb.Message, tc.msg)
			}
		})
	}

	t.Run("signed URLs", func(t *testing.T) {
		for _, tc := range []struct{ name, query, msg string }{
			{"expired", "path=/a&signature_expiration=" + itoa(past) + "&signature=" + url.QueryEscape(auth.FileSignature("/a", "read", "", run.AccessToken, past)), "signature is already expired"},
			{"invalid", "path=/a&signature=v1_nope", "invalid signature"},
		} {
			r := e.do("GET", "/files?"+tc.query, "")
			r.wantError(t, 401)
			var eb errorBody
			r.json(t, &eb)
			if eb.Message != tc.msg {
				t.Fatalf("%s: message %q, want %q", tc.name, eb.Message, tc.msg)
			}
		}
	})
}

// TestTemplateAlias: Template.exists() is GET /templates/aliases/{alias}: 200 TemplateAliasResponse
// for a known template, 404 otherwise.
func TestTemplateAlias(t *testing.T) {
	e := newEnv(t)
	e.fake.templates["snap1:default"] = &sandbox.Template{ID: "snap1:default", Kind: "snapshot", Names: []string{"snap1"}}
	for _, tc := range []struct {
		alias  string
		status int
		id     string
	}{
		{"base", 200, "base"},
		{"snap1", 200, "snap1:default"},
		{"no-such-template", 404, ""},
		{"%2e%2e", 404, ""},
	} {
		t.Run(tc.alias, func(t *testing.T) {
			r := e.ctl("GET", "/templates/aliases/"+tc.alias, "")
			if tc.status != 200 {
				r.wantError(t, tc.status)
				return
			}
			var got map[string]any
			r.json(t, &got)
			if r.status != 200 || got["templateID"] != tc.id || got["public"] != false {
				t.Fatalf("%d %s", r.status, r.body)
			}
		})
	}
}
