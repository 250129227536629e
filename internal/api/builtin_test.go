package api

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/template/build"
)

// interpDef is a built-in template shaped like code-interpreter-v1: from base, a RUN step
// (run, as root), a COPY of server.py, and a start command.
func interpDef(t *testing.T, run string) build.BuiltinTemplate {
	files := gzTar(t, "server.py", "print('hi')")
	sum := sha256.Sum256(files)
	hash := hex.EncodeToString(sum[:])
	return build.BuiltinTemplate{
		Files: map[string][]byte{hash: files},
		Build: build.StepBuildRequest{FromTemplate: "base", StartCmd: "start-interpreter", Steps: []build.Step{
			{Type: "RUN", Args: []string{run, "root"}},
			{Type: "COPY", Args: []string{"server.py", "/opt/x/server.py", "root", "0644"}, FilesHash: hash},
		}},
	}
}

// builtinEnv is newEnv on a node that builds def as its built-in template interp-v1.
func builtinEnv(t *testing.T, def build.BuiltinTemplate) (*env, *guest) {
	keys := auth.NewKeys(auth.NewMemoryBackend())
	key, _, err := keys.Create(context.Background(), "test")
	if err != nil {
		t.Fatal(err)
	}
	g := newGuest(t)
	fake := newServiceBuilds(t, g.srv.Listener.Addr().String(), nil, func(c *build.Config) {
		c.Builtins = map[string]build.BuiltinTemplate{"interp-v1": def}
	})
	api := httptest.NewServer(New(Config{Domain: testDomain, Builds: fake.builds()}, fake, keys, testLogger(t)))
	t.Cleanup(api.Close)
	return &env{t: t, fake: fake, keys: keys, key: key, api: api, guest: g}, g
}

// TestCreateBuildsABuiltinTemplate: a create that names a built-in template the node lacks
// (E2B's code-interpreter-v1 is one) builds it first, as a step build with its COPY files, and
// then creates the sandbox; the template is then an ordinary one (listed; the next create does
// not build again).
func TestCreateBuildsABuiltinTemplate(t *testing.T) {
	e, g := builtinEnv(t, interpDef(t, "install-packages"))

	e.ctl("POST", "/sandboxes", `{"templateID":"nosuch"}`).wantError(t, http.StatusNotFound)
	r := e.ctl("POST", "/sandboxes", `{"templateID":"interp-v1"}`)
	if r.status != http.StatusCreated {
		t.Fatalf("create: %d %s", r.status, r.body)
	}
	if run, ok := g.procs.find("install-packages"); !ok || run.User != "root" {
		t.Fatalf("the RUN step did not run as root: %+v", run)
	}
	if run, ok := g.procs.find("tar -xf"); !ok || !strings.Contains(run.Line, "/opt/x/server.py") {
		t.Fatalf("the COPY step: %+v", run)
	}
	if _, ok := g.procs.find("start-interpreter"); !ok {
		t.Fatal("the start command did not run before the checkpoint")
	}
	var ts []templateJSON
	e.ctl("GET", "/templates", "").json(t, &ts)
	found := false
	for _, tj := range ts {
		found = found || tj.TemplateID == "interp-v1" && tj.BuildStatus == "ready"
	}
	if !found {
		t.Fatalf("templates %+v", ts)
	}
	before := len(g.procs.lines())
	if r := e.ctl("POST", "/sandboxes", `{"templateID":"interp-v1"}`); r.status != http.StatusCreated {
		t.Fatalf("second create: %d %s", r.status, r.body)
	}
	for _, l := range g.procs.lines()[before:] {
		if strings.Contains(l, "install-packages") {
			t.Fatal("the second create built the template again")
		}
	}
}

// A built-in template is every team's, as base is: a team other than the default one creates
// it (building it first), and the default team then uses the same template.
func TestBuiltinTemplateIsEveryTeams(t *testing.T) {
	e, _ := builtinEnv(t, interpDef(t, "install-packages"))
	var tj teamJSON
	r := e.ctl("POST", "/ember/teams", `{"name":"b"}`)
	if r.status != http.StatusCreated {
		t.Fatalf("create team: %d %s", r.status, r.body)
	}
	r.json(t, &tj)
	if r := e.as(tj.Key.Key, "POST", "/sandboxes", `{"templateID":"interp-v1"}`); r.status != http.StatusCreated {
		t.Fatalf("team b's create of the built-in template: %d %s", r.status, r.body)
	}
	if r := e.as(tj.Key.Key, "POST", "/sandboxes", `{"templateID":"interp-v1"}`); r.status != http.StatusCreated {
		t.Fatalf("team b's second create of the built-in template: %d %s", r.status, r.body)
	}
	if r := e.ctl("POST", "/sandboxes", `{"templateID":"interp-v1"}`); r.status != http.StatusCreated {
		t.Fatalf("the default team's create of the built-in template: %d %s", r.status, r.body)
	}
}
