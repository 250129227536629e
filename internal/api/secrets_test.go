package api

import (
	"bytes"
	"context"
	"net/http"
	"os"
	"path/filepath"
	"testing"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/secret"
	"github.com/ember-sandbox/ember/internal/store"
)

func newSecretEnv(t *testing.T) (*env, *secret.Manager, string) {
	t.Helper()
	dir := t.TempDir()
	st, err := store.Open(filepath.Join(dir, "store.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	sm, err := secret.Open(st, filepath.Join(dir, "secrets.key"), testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	return newEnvConfig(t, Config{Domain: testDomain, Secrets: sm}), sm, dir
}

// TestSecretAPI: E2B's shapes and answers, values never returned and never stored in clear.
func TestSecretAPI(t *testing.T) {
	e, sm, dir := newSecretEnv(t)
	const value = "sk-very-secret-4f1c9a"
	r := e.ctl("POST", "/secrets", `{"name":"openai-key","value":"`+value+`","metadata":{"env":"prod"}}`)
	if r.status != http.StatusCreated {
		t.Fatalf("create: %d %s", r.status, r.body)
	}
	var s secretJSON
	r.json(t, &s)
	if s.SecretID == "" || s.Name != "openai-key" || s.CurrentVersion != 1 || s.Metadata["env"] != "prod" || s.CreatedAt == "" {
		t.Fatalf("create answered %+v", s)
	}
	if r := e.ctl("POST", "/secrets", `{"name":"openai-key","value":"x"}`); r.status != http.StatusConflict {
		t.Fatalf("duplicate name: %d %s", r.status, r.body)
	}
	for _, bad := range []string{`{"name":"a b","value":"x"}`, `{"name":"x","value":"a\r\nX-Evil: 1"}`, `{"name":"x"}`, `{"name":"x","value":""}`} {
		if r := e.ctl("POST", "/secrets", bad); r.status != http.StatusBadRequest {
			t.Fatalf("%s: %d %s", bad, r.status, r.body)
		}
	}
	r = e.ctl("POST", "/secrets/openai-key", `{"value":"`+value+`-2"}`)
	if r.status != http.StatusOK {
		t.Fatalf("update by name: %d %s", r.status, r.body)
	}
	r.json(t, &s)
	if s.CurrentVersion != 2 || s.Metadata["env"] != "prod" {
		t.Fatalf("update answered %+v", s)
	}
	for _, path := range []string{"/secrets", "/secrets/" + s.SecretID, "/secrets/openai-key"} {
		r := e.ctl("GET", path, "")
		if r.status != http.StatusOK || bytes.Contains(r.body, []byte(value)) || bytes.Contains(r.body, []byte("sealed")) {
			t.Fatalf("GET %s: %d %s", path, r.status, r.body)
		}
	}
	if got, err := sm.Expand(context.Background(), auth.DefaultTeamID, "Bearer ${e2b.secrets.openai-key}"); err != nil || got != "Bearer "+value+"-2" {
		t.Fatalf("Expand = %q, %v", got, err)
	}
	if _, err := sm.Expand(context.Background(), "", "${e2b.secrets.nope}"); err == nil {
		t.Fatal("Expand of an unknown secret succeeded")
	}
	if _, err := sm.Expand(context.Background(), "team-b", "${e2b.secrets.openai-key}"); err == nil {
		t.Fatal("another owner resolved the secret")
	}
	db, err := os.ReadFile(filepath.Join(dir, "store.db"))
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(db, []byte(value)) {
		t.Fatal("the store holds the value in clear")
	}
	if r := e.ctl("DELETE", "/secrets/"+s.SecretID, ""); r.status != http.StatusNoContent {
		t.Fatalf("destroy: %d %s", r.status, r.body)
	}
	for _, c := range [][2]string{{"GET", "/secrets/openai-key"}, {"DELETE", "/secrets/openai-key"}, {"POST", "/secrets/openai-key"}} {
		body := ""
		if c[0] == "POST" {
			body = `{"value":"x"}`
		}
		if r := e.ctl(c[0], c[1], body); r.status != http.StatusNotFound || !bytes.Contains(r.body, []byte(`"code":404`)) {
			t.Fatalf("%s after destroy: %d %s", c, r.status, r.body)
		}
	}
}

// Another team's secret answers as a missing one, is in none of its lists, and its rules cannot
// name it: secrets belong to the team that made them.
func TestSecretsBelongToTheirTeam(t *testing.T) {
	e, sm, _ := newSecretEnv(t)
	var tj teamJSON
	r := e.ctl("POST", "/ember/teams", `{"name":"b"}`)
	if r.status != http.StatusCreated {
		t.Fatalf("create team: %d %s", r.status, r.body)
	}
	r.json(t, &tj)
	other := tj.Key.Key
	if r = e.ctl("POST", "/secrets", `{"name":"mine","value":"v-default"}`); r.status != http.StatusCreated {
		t.Fatalf("create: %d %s", r.status, r.body)
	}
	for _, path := range []string{"/secrets/mine"} {
		if r := e.as(other, "GET", path, ""); r.status != http.StatusNotFound {
			t.Fatalf("team b GET %s: %d %s, want 404", path, r.status, r.body)
		}
	}
	if r := e.as(other, "GET", "/secrets", ""); r.status != http.StatusOK || bytes.Contains(r.body, []byte("mine")) {
		t.Fatalf("team b's list: %d %s", r.status, r.body)
	}
	if r := e.as(other, "DELETE", "/secrets/mine", ""); r.status != http.StatusNotFound {
		t.Fatalf("team b DELETE: %d %s, want 404", r.status, r.body)
	}
	if r := e.as(other, "POST", "/secrets", `{"name":"mine","value":"v-b"}`); r.status != http.StatusCreated {
		t.Fatalf("team b makes its own secret of that name: %d %s", r.status, r.body)
	}
	for team, want := range map[string]string{auth.DefaultTeamID: "v-default", tj.ID: "v-b"} {
		if got, err := sm.Expand(context.Background(), team, "${e2b.secrets.mine}"); err != nil || got != want {
			t.Fatalf("Expand for %s = %q, %v; want %q", team, got, err, want)
		}
	}
}
