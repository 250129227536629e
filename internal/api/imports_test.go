package api

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ember-sandbox/ember/internal/datadir"
)

// TestArchiveBuildsConfinedToImports: a build's `archive:` source is a file in the import
// directory (uploaded through POST /ember/imports); a host path, a `..` name or a symlink in
// the import directory that leads out are a 400 before anything is built, and nothing is read.
func TestArchiveBuildsConfinedToImports(t *testing.T) {
	e := newEnv(t)
	secret := filepath.Join(t.TempDir(), "secret.tar")
	os.WriteFile(secret, []byte("host file"), 0o600)
	imports := datadir.Imports(e.fake.dataDir)
	os.MkdirAll(imports, 0o700)
	if err := os.Symlink(secret, filepath.Join(imports, "out.tar")); err != nil {
		t.Fatal(err)
	}
	for _, from := range []string{"archive:" + secret, "archive:../../" + filepath.Base(secret), "archive:../imports/out.tar", "archive:out.tar", "archive:nosuch.tar", "archive:"} {
		r := e.ctl("POST", "/ember/templates/hostile/build", `{"from":"`+from+`"}`)
		r.wantError(t, 400)
		if !strings.Contains(string(r.body), "import directory") {
			t.Errorf("%s: the error does not say where archives go: %s", from, r.body)
		}
	}
	e.ctl("GET", "/templates/aliases/hostile", "").wantError(t, 404)

	// An uploaded archive builds.
	var imp struct {
		Name string `json:"name"`
		Size int64  `json:"size"`
	}
	r := e.ctl("POST", "/ember/imports", "not really a tarball", "Content-Type", "application/octet-stream")
	if r.status != 201 {
		t.Fatalf("upload: %d %s", r.status, r.body)
	}
	r.json(t, &imp)
	if imp.Size != int64(len("not really a tarball")) || strings.ContainsAny(imp.Name, "/") {
		t.Fatalf("upload answered %+v", imp)
	}
	if b, err := os.ReadFile(filepath.Join(imports, imp.Name)); err != nil || string(b) != "not really a tarball" {
		t.Fatalf("imported file: %q %v", b, err)
	}
	r = e.ctl("POST", "/ember/templates/imported/build", `{"from":"archive:`+imp.Name+`"}`)
	if r.status != 200 {
		t.Fatalf("build from an import: %d %s", r.status, r.body)
	}
	if lines := ndjson(t, r.body); len(lines) == 0 || lines[len(lines)-1].Template == nil {
		t.Fatalf("build from an import: %s", r.body)
	}
	if r := e.ctl("DELETE", "/ember/imports/"+imp.Name, ""); r.status != 204 {
		t.Fatalf("delete import: %d %s", r.status, r.body)
	}
	e.ctl("DELETE", "/ember/imports/"+imp.Name, "").wantError(t, 404)
	e.ctl("DELETE", "/ember/imports/..", "").wantError(t, 404)
}
