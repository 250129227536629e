package cli

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"
)

// fakeBuildAPI is E2B's template build API as far as the Dockerfile client uses it. It records
// every request and fails the test on any it does not expect.
type fakeBuildAPI struct {
	t        *testing.T
	mu       sync.Mutex
	calls    []string          // "METHOD /path?query"
	bodies   map[string]string // JSON bodies by call
	uploads  map[string][]string
	keys     map[string]string // X-API-Key by call
	aliases  map[string]bool
	present  map[string]bool // file hashes the daemon has
	storeURL string          // upload URLs for hashes in storeHashes go there
	store    map[string]bool
	status   []string // statuses answered in turn
	failMsg  string
}

func (f *fakeBuildAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	defer f.mu.Unlock()
	call := r.Method + " " + r.URL.Path
	if r.URL.RawQuery != "" {
		call += "?" + r.URL.RawQuery
	}
	f.calls = append(f.calls, call)
	f.keys[call] = r.Header.Get("X-API-Key")
	body, _ := io.ReadAll(r.Body)
	reply := func(code int, v any) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		json.NewEncoder(w).Encode(v)
	}
	p := r.URL.Path
	switch {
	case r.Method == "GET" && strings.HasPrefix(p, "/templates/aliases/"):
		if f.aliases[strings.TrimPrefix(p, "/templates/aliases/")] {
			reply(200, map[string]any{"templateID": "x", "public": false})
		} else {
			reply(404, map[string]any{"code": 404, "message": "template not found"})
		}
	case r.Method == "POST" && p == "/v3/templates":
		f.bodies[call] = string(body)
		reply(202, map[string]any{"templateID": "tpl1", "buildID": "b1", "names": []string{"app"}, "tags": []string{"default"}, "aliases": []string{"app"}, "public": false})
	case r.Method == "GET" && strings.HasPrefix(p, "/templates/tpl1/files/"):
		h := strings.TrimPrefix(p, "/templates/tpl1/files/")
		switch {
		case f.present[h]:
			reply(200, map[string]any{"present": true})
		case f.store[h]:
			reply(201, map[string]any{"present": false, "url": f.storeURL + "/bucket/" + h, "headers": map[string]string{"X-Signed": "yes"}})
		default:
			reply(201, map[string]any{"present": false, "url": "/ember/uploads/" + h})
		}
	case r.Method == "PUT" && (strings.HasPrefix(p, "/ember/uploads/") || strings.HasPrefix(p, "/bucket/")):
		if r.ContentLength != int64(len(body)) || r.ContentLength <= 0 {
			f.t.Errorf("%s: Content-Length %d, body %d bytes", call, r.ContentLength, len(body))
		}
		if strings.HasPrefix(p, "/bucket/") && r.Header.Get("X-Signed") != "yes" {
			f.t.Errorf("%s: the upload link's headers were not sent", call)
		}
		f.uploads[call] = tarNames(f.t, body)
		w.WriteHeader(200)
	case r.Method == "POST" && p == "/v2/templates/tpl1/builds/b1":
		f.bodies[call] = string(body)
		w.WriteHeader(202)
	case r.Method == "GET" && p == "/templates/tpl1/builds/b1/status":
		st := f.status[0]
		if len(f.status) > 1 {
			f.status = f.status[1:]
		}
		off := r.URL.Query().Get("logsOffset")
		all := []map[string]any{
			{"timestamp": "2026-01-01T00:00:00Z", "level": "info", "message": "[base] FROM template base", "step": "base"},
			{"timestamp": "2026-01-01T00:00:01Z", "level": "info", "message": "[1] RUN pip install flask", "step": "1"},
			{"timestamp": "2026-01-01T00:00:02Z", "level": "info", "message": "Successfully installed flask", "step": "1"},
		}
		var n int
		fmt.Sscan(off, &n)
		entries := []map[string]any{}
		if n < len(all) {
			end := n + 2
			if end > len(all) {
				end = len(all)
			}
			entries = all[n:end]
		}
		resp := map[string]any{"buildID": "b1", "templateID": "tpl1", "status": st, "logEntries": entries, "logs": []string{}}
		if st == "error" {
			resp["reason"] = map[string]any{"message": f.failMsg, "step": "1"}
		}
		reply(200, resp)
	default:
		f.t.Errorf("unexpected request %s", call)
		reply(404, map[string]any{"code": 404, "message": "no route"})
	}
}

func tarNames(t *testing.T, b []byte) []string {
	zr, err := gzip.NewReader(bytes.NewReader(b))
	if err != nil {
		t.Errorf("upload is not gzip: %v", err)
		return nil
	}
	tr := tar.NewReader(zr)
	var names []string
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return names
		}
		if err != nil {
			t.Errorf("upload is not a tarball: %v", err)
			return names
		}
		names = append(names, h.Name)
	}
}

const clientDockerfile = `FROM base
COPY app /home/user/app
COPY requirements.txt /tmp/
COPY cached.txt /tmp/
RUN pip install flask
CMD ["python3", "app/main.py"]
`

func newFakeBuild(t *testing.T) (*fakeBuildAPI, *client, string, map[string]string) {
	t.Helper()
	dir := t.TempDir()
	for name, body := range map[string]string{"app/main.py": "print(1)\n", "requirements.txt": "flask\n", "cached.txt": "c", "Dockerfile": clientDockerfile} {
		os.MkdirAll(filepath.Dir(filepath.Join(dir, name)), 0o755)
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	f := &fakeBuildAPI{t: t, bodies: map[string]string{}, uploads: map[string][]string{}, keys: map[string]string{},
		aliases: map[string]bool{"base": true}, present: map[string]bool{}, store: map[string]bool{},
		status: []string{"building", "ready"}}
	api := httptest.NewServer(f)
	t.Cleanup(api.Close)
	store := httptest.NewServer(f) // another host: a presigned object-store URL
	t.Cleanup(store.Close)
	f.storeURL = store.URL
	// Hashes of the three COPY steps, from a dry translation.
	hashes := map[string]string{}
	b := &dockerfileBuild{dockerfile: filepath.Join(dir, "Dockerfile")}
	res := translateForTest(t, b)
	for _, fs := range res {
		hashes[fs[0]] = fs[1]
	}
	f.store[hashes["requirements.txt"]] = true
	f.present[hashes["cached.txt"]] = true
	return f, &client{base: api.URL, key: "e2b_testkey", http: &http.Client{}}, filepath.Join(dir, "Dockerfile"), hashes
}

func TestDockerfileBuildRequests(t *testing.T) {
	f, c, df, h := newFakeBuild(t)
	var out, errOut bytes.Buffer
	b := &dockerfileBuild{name: "app:v1", dockerfile: df, out: &out, errOut: &errOut, poll: time.Millisecond}
	if err := b.run(context.Background(), c); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	want := []string{
		"GET /templates/aliases/base",
		"POST /v3/templates",
		"GET /templates/tpl1/files/" + h["app"],
		"PUT /ember/uploads/" + h["app"],
		"GET /templates/tpl1/files/" + h["requirements.txt"],
		"PUT /bucket/" + h["requirements.txt"],
		"GET /templates/tpl1/files/" + h["cached.txt"],
		"POST /v2/templates/tpl1/builds/b1",
		"GET /templates/tpl1/builds/b1/status?logsOffset=0",
		"GET /templates/tpl1/builds/b1/status?logsOffset=2",
		"GET /templates/tpl1/builds/b1/status?logsOffset=3",
	}
	if !reflect.DeepEqual(f.calls, want) {
		t.Errorf("requests:\n got %s\nwant %s", strings.Join(f.calls, "\n     "), strings.Join(want, "\n     "))
	}
	if got := f.bodies["POST /v3/templates"]; strings.TrimSpace(got) != `{"name":"app:v1"}` {
		t.Errorf("POST /v3/templates body %s", got)
	}
	var start map[string]any
	if err := json.Unmarshal([]byte(f.bodies["POST /v2/templates/tpl1/builds/b1"]), &start); err != nil {
		t.Fatal(err)
	}
	wantStart := map[string]any{
		"fromTemplate": "base",
		"startCmd":     "python3 app/main.py",
		"force":        false,
		"steps": []any{
			map[string]any{"type": "USER", "args": []any{"root"}, "force": false},
			map[string]any{"type": "WORKDIR", "args": []any{"/"}, "force": false},
			map[string]any{"type": "COPY", "args": []any{"app", "/home/user/app", "", ""}, "force": false, "filesHash": h["app"]},
			map[string]any{"type": "COPY", "args": []any{"requirements.txt", "/tmp/", "", ""}, "force": false, "filesHash": h["requirements.txt"]},
			map[string]any{"type": "COPY", "args": []any{"cached.txt", "/tmp/", "", ""}, "force": false, "filesHash": h["cached.txt"]},
			map[string]any{"type": "RUN", "args": []any{"pip install flask"}, "force": false},
			map[string]any{"type": "USER", "args": []any{"user"}, "force": false},
			map[string]any{"type": "WORKDIR", "args": []any{"/home/user"}, "force": false},
		},
	}
	if !reflect.DeepEqual(start, wantStart) {
		t.Errorf("build start body:\n got %v\nwant %v", start, wantStart)
	}
	if got := f.uploads["PUT /ember/uploads/"+h["app"]]; !reflect.DeepEqual(got, []string{"app/", "app/main.py"}) {
		t.Errorf("app tarball: %q", got)
	}
	if got := f.uploads["PUT /bucket/"+h["requirements.txt"]]; !reflect.DeepEqual(got, []string{"requirements.txt"}) {
		t.Errorf("requirements tarball: %q", got)
	}
	for call, key := range f.keys {
		wantKey := "e2b_testkey"
		if strings.HasPrefix(call, "PUT /bucket/") {
			wantKey = "" // another host never gets the API key
		}
		if key != wantKey {
			t.Errorf("%s: X-API-Key %q, want %q", call, key, wantKey)
		}
	}
	for _, line := range []string{"FROM base: the template of that name", "COPY app: uploaded 2 files", "COPY cached.txt: already on the daemon",
		"[1] RUN pip install flask", "Successfully installed flask", "template app:v1 built in"} {
		if !strings.Contains(out.String(), line) {
			t.Errorf("output lacks %q:\n%s", line, out.String())
		}
	}
}

func TestDockerfileBuildJSONAndImage(t *testing.T) {
	f, c, df, _ := newFakeBuild(t)
	f.aliases = map[string]bool{} // FROM base is not a template here: an image
	var out, errOut bytes.Buffer
	b := &dockerfileBuild{name: "app", dockerfile: df, out: &out, errOut: &errOut, asJSON: true, poll: time.Millisecond, startCmd: "sleep infinity", readyCmd: "true", force: true}
	if err := b.run(context.Background(), c); err != nil {
		t.Fatal(err)
	}
	var start map[string]any
	json.Unmarshal([]byte(f.bodies["POST /v2/templates/tpl1/builds/b1"]), &start)
	if start["fromImage"] != "base" || start["fromTemplate"] != nil || start["startCmd"] != "sleep infinity" || start["readyCmd"] != "true" || start["force"] != true {
		t.Errorf("build start body: %v", start)
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(lines) != 4 {
		t.Fatalf("--json printed %d lines, want 3 log entries and the result:\n%s", len(lines), out.String())
	}
	var e logEntry
	if err := json.Unmarshal([]byte(lines[1]), &e); err != nil || e.Message != "[1] RUN pip install flask" || e.Step != "1" {
		t.Errorf("log line %q: %+v %v", lines[1], e, err)
	}
	var r buildResult
	if err := json.Unmarshal([]byte(lines[3]), &r); err != nil || r != (buildResult{TemplateID: "tpl1", BuildID: "b1", Name: "app", Status: "ready"}) {
		t.Errorf("result line %q: %+v %v", lines[3], r, err)
	}
}

func TestDockerfileBuildFailure(t *testing.T) {
	f, c, df, _ := newFakeBuild(t)
	f.status = []string{"building", "error"}
	f.failMsg = "command exited with 1"
	var out bytes.Buffer
	b := &dockerfileBuild{name: "app", dockerfile: df, out: &out, errOut: &out, poll: time.Millisecond}
	err := b.run(context.Background(), c)
	if err == nil || err.Error() != "build failed: step 1: command exited with 1" {
		t.Fatalf("error %v", err)
	}
	if !strings.Contains(out.String(), "Successfully installed flask") {
		t.Errorf("the log after the failure was not read to the end:\n%s", out.String())
	}
}

func TestDockerfileErrorBeforeAnyRequest(t *testing.T) {
	f, c, df, _ := newFakeBuild(t)
	os.WriteFile(df, []byte("FROM base\nRUN true\nHEALTHCHECK NONE\n"), 0o644)
	var out bytes.Buffer
	b := &dockerfileBuild{name: "app", dockerfile: df, out: &out, errOut: &out, poll: time.Millisecond}
	err := b.run(context.Background(), c)
	if err == nil || err.Error() != "Dockerfile:3: HEALTHCHECK is not supported" {
		t.Fatalf("error %v", err)
	}
	if len(f.calls) != 0 {
		t.Errorf("a Dockerfile error still sent %v", f.calls)
	}
}

// translateForTest returns [src, hash] of each COPY of b's Dockerfile.
func translateForTest(t *testing.T, b *dockerfileBuild) [][2]string {
	t.Helper()
	var out [][2]string
	src, _ := os.ReadFile(b.dockerfile)
	res, err := translateDockerfile(src, b.dockerfile, "", nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, fs := range res.Files {
		out = append(out, [2]string{fs.Src, fs.Hash})
	}
	sort.Slice(out, func(i, j int) bool { return out[i][0] < out[j][0] })
	return out
}

// Interrupted while the build runs: the error says the build goes on, not "cannot reach".
func TestDockerfileBuildInterrupted(t *testing.T) {
	f, c, df, _ := newFakeBuild(t)
	f.status = []string{"building"}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	var out bytes.Buffer
	b := &dockerfileBuild{name: "app", dockerfile: df, out: &out, errOut: &out, poll: 50 * time.Millisecond}
	err := b.run(ctx, c)
	if err == nil || !strings.HasPrefix(err.Error(), "stopped waiting (the build goes on on the daemon: GET /templates/tpl1/builds/b1/status)") {
		t.Fatalf("error %v", err)
	}
}
