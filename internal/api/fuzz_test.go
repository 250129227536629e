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
	"time"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// FuzzControlPlaneDecode throws arbitrary methods, paths and bodies at the authenticated control
// plane. Whatever arrives, the answer is never a 5xx, and every error is E2B's JSON
// {"code":<status>,"message":...} with code equal to the HTTP status.
// CI: go test -run=^$ -fuzz=FuzzControlPlaneDecode -fuzztime=20s ./internal/api
func FuzzControlPlaneDecode(f *testing.F) {
	fake := newFake(f)
	fake.fork = func(_ context.Context, id string, count int, _ time.Duration) ([]sandbox.ForkResult, error) {
		out := make([]sandbox.ForkResult, count)
		for i := range out {
			out[i].Sandbox = &sandbox.Sandbox{ID: "child", TemplateID: "base"}
		}
		return out, nil
	}
	fake.build = func(_ context.Context, req sandbox.BuildRequest, progress func(string)) (*sandbox.Template, error) {
		progress("building " + req.Name)
		return &sandbox.Template{ID: req.Name, Ready: true}, nil
	}
	keys := auth.NewKeys(auth.NewMemoryBackend())
	key, _, err := keys.Create(context.Background(), "fuzz")
	if err != nil {
		f.Fatal(err)
	}
	h := New(Config{Domain: "ember.test"}, fake, keys, slog.New(slog.NewTextHandler(io.Discard, nil)))
	reset := func() {
		fake.mu.Lock()
		fake.sbxs = map[string]*sandbox.Sandbox{}
		fake.seq = 0
		fake.addLocked("base", sandbox.StateRunning, map[string]string{"a": "b"}, time.Minute) // sbx001
		fake.addLocked("base", sandbox.StatePaused, nil, time.Minute)                          // sbx002
		fake.mu.Unlock()
	}
	reset()

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
	}
	for _, s := range seeds {
		f.Add(s.method, s.path, []byte(s.body))
	}

	f.Fuzz(func(t *testing.T, method, path string, body []byte) {
		req, err := http.NewRequest(method, "http://api.ember.test"+path, bytes.NewReader(body))
		if err != nil {
			return // not a request an HTTP server could receive
		}
		req.Header.Set("X-API-Key", key)
		req.Header.Set("Content-Type", "application/json")
		fake.mu.Lock()
		big := len(fake.sbxs) > 200 || len(fake.templates) > 200
		fake.mu.Unlock()
		if big {
			reset()
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
