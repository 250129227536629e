package api

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// FuzzControlPlaneDecode throws arbitrary methods, paths and bodies at the authenticated control
// plane. Whatever arrives, the answer is never a 5xx, and every error is E2B's JSON
// {"code":<status>,"message":...} with code equal to the HTTP status.
// CI: go test -run=^$ -fuzz=FuzzControlPlaneDecode -fuzztime=20s ./internal/api
func FuzzControlPlaneDecode(f *testing.F) {
	g := newGuest(f)
	svc := newService(f, g.srv.Listener.Addr().String())
	keys := auth.NewKeys(auth.NewMemoryBackend())
	key, _, err := keys.Create(context.Background(), "fuzz")
	if err != nil {
		f.Fatal(err)
	}
	h := New(Config{Domain: "ember.test", Builds: svc.builds()}, svc, keys, slog.New(slog.NewTextHandler(io.Discard, nil)))
	// The seeds name two sandboxes, sbx001 (running) and sbx002 (paused); every input's path is
	// pointed at the Manager's current pair.
	var run, paused string
	reset := func(t testing.TB) {
		list, _ := svc.List(context.Background(), sandbox.ListFilter{})
		for _, sb := range list {
			svc.Kill(context.Background(), sb.ID)
		}
		ts, _ := svc.ListTemplates(context.Background())
		for _, t := range ts {
			if t.ID != "base" {
				svc.DeleteTemplate(context.Background(), t.ID)
			}
		}
		r, err := svc.tryAdd(sandbox.StateRunning, map[string]string{"a": "b"})
		if err != nil {
			t.Fatal(err)
		}
		p, err := svc.tryAdd(sandbox.StatePaused, nil)
		if err != nil {
			t.Fatal(err)
		}
		run, paused = r.ID, p.ID
	}
	reset(f)

	seeds := []struct {
		method, path, body string
	}{
		{"POST", "/v2/sandboxes", `{"templateID":"base","metadata":{"suite":"x"},"envVars":{"FOO":"bar"},"timeout":120}`},
		{"POST", "/sandboxes", `{"templateID":"base","timeout":300,"secure":true,"allow_internet_access":true}`},
		{"POST", "/v2/sandboxes", `{"templateID":"base","timeout":-1}`},
		{"POST", "/v2/sandboxes", `{"templateID":1}`},
		{"GET", "/v2/sandboxes?metadata=suite%3Dx&state=running,paused&limit=10", ""},
		{"GET", "/v2/sandboxes?limit=1&nextToken=MTow", ""},
		{"GET", "/sandboxes/sbx001", ""},
		{"DELETE", "/sandboxes/sbx001", ""},
		{"POST", "/sandboxes/sbx001/timeout", `{"timeout":60}`},
		{"POST", "/sandboxes/sbx002/pause", `{}`},
		{"POST", "/v2/sandboxes/sbx002/connect", `{"timeout":30}`},
		{"POST", "/sandboxes/sbx002/resume", `{"timeout":30,"autoPause":false}`},
		{"POST", "/sandboxes/sbx001/snapshots", `{"name":"snap1"}`},
		{"POST", "/sandboxes/sbx001/fork", `{"count":3,"timeout":60}`},
		{"GET", "/sandboxes/sbx001/metrics?start=0&end=99999999999", ""},
		{"GET", "/snapshots?sandboxID=sbx001&limit=1", ""},
		{"DELETE", "/templates/snap1:default", ""},
		{"POST", "/ember/templates/t1/build", `{"from":"debian:bookworm","cpuCount":1}`},
		{"POST", "/api-keys", `{"name":"x"}`},
		{"DELETE", "/api-keys/00", ""},
		{"GET", "/files?signature=v1_abc&path=/a", ""},
		{"POST", "/v3/templates", `{"name":"t2:v1","tags":["a"],"cpuCount":1,"memoryMB":512}`},
		{"GET", "/templates/t2/files/abababababababababababababababababababababababababababababababab", ""},
		{"POST", "/v2/templates/t2/builds/00000000-0000-4000-8000-000000000000", `{"fromTemplate":"base","steps":[{"type":"RUN","args":["true"]},{"type":"ENV","args":["A","1"]}],"force":true}`},
		{"GET", "/templates/t2/builds/00000000-0000-4000-8000-000000000000/status?logsOffset=3", ""},
		{"GET", "/templates/t2/builds/00000000-0000-4000-8000-000000000000/logs?direction=backward&cursor=1", ""},
		{"POST", "/templates/tags", `{"target":"base:latest","tags":["x"]}`},
		{"DELETE", "/templates/tags", `{"name":"base","tags":["x"]}`},
		{"GET", "/templates/base/tags", ""},
		{"GET", "/templates/base", ""},
		{"PUT", "/ember/template-files/abc", "tar"},
	}
	for _, s := range seeds {
		f.Add(s.method, s.path, []byte(s.body))
	}

	f.Fuzz(func(t *testing.T, method, path string, body []byte) {
		path = strings.NewReplacer("sbx001", run, "sbx002", paused).Replace(path)
		req, err := http.NewRequest(method, "http://api.ember.test"+path, bytes.NewReader(body))
		if err != nil {
			return // not a request an HTTP server could receive
		}
		req.Header.Set("X-API-Key", key)
		req.Header.Set("Content-Type", "application/json")
		list, _ := svc.List(context.Background(), sandbox.ListFilter{})
		ts, _ := svc.ListTemplates(context.Background())
		if len(list) > 100 || len(ts) > 100 {
			reset(t)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		res := rec.Result()
		if res.StatusCode >= 500 {
			t.Fatalf("%s %q -> %d %s", method, path, res.StatusCode, rec.Body.Bytes())
		}
		ct := res.Header.Get("Content-Type")
		if res.StatusCode >= 400 {
			var eb struct {
				Code    *int    `json:"code"`
				Message *string `json:"message"`
			}
			if !strings.HasPrefix(ct, "application/json") || json.Unmarshal(rec.Body.Bytes(), &eb) != nil ||
				eb.Code == nil || *eb.Code != res.StatusCode || eb.Message == nil {
				t.Fatalf("%s %q -> %d with body %q (%s), want {\"code\":%d,...}", method, path, res.StatusCode, rec.Body.Bytes(), ct, res.StatusCode)
			}
			return
		}
		if strings.HasPrefix(ct, "application/json") && !json.Valid(rec.Body.Bytes()) {
			t.Fatalf("%s %q -> %d with invalid JSON %q", method, path, res.StatusCode, rec.Body.Bytes())
		}
	})
}
