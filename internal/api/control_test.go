package api

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

func TestAuth(t *testing.T) {
	e := newEnv(t)
	tests := []struct {
		name string
		hdr  []string
		want int
	}{
		{"no key", nil, 401},
		{"wrong key", []string{"X-API-Key", "e2b_" + strings.Repeat("a", 40)}, 401},
		{"malformed key", []string{"X-API-Key", "nope"}, 401},
		{"valid key", []string{"X-API-Key", e.key}, 200},
		{"lower-case header", []string{"x-api-key", e.key}, 200},
		{"bearer fallback", []string{"Authorization", "Bearer " + e.key}, 200},
		{"bad bearer", []string{"Authorization", "Bearer e2b_00"}, 401},
		{"bearer access token ignored next to a valid key", []string{"X-API-Key", e.key, "Authorization", "Bearer sk_e2b_xyz"}, 200},
		{"bad key wins over good bearer", []string{"X-API-Key", "e2b_00", "Authorization", "Bearer " + e.key}, 401},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := e.do("GET", "/v2/sandboxes", "", tt.hdr...)
			if tt.want != 200 {
				r.wantError(t, tt.want)
				var eb errorBody
				r.json(t, &eb)
				if eb.Message != "Invalid API key" {
					t.Fatalf("message %q", eb.Message)
				}
				return
			}
			if r.status != 200 {
				t.Fatalf("status %d: %s", r.status, r.body)
			}
		})
	}
	t.Run("health needs no key", func(t *testing.T) {
		if r := e.do("GET", "/health", ""); r.status != 200 {
			t.Fatalf("status %d", r.status)
		}
	})
}

func TestSandboxLifecycle(t *testing.T) {
	e := newEnv(t)
	r := e.ctl("POST", "/v2/sandboxes", `{"templateID":"base","metadata":{"suite":"x"},"envVars":{"FOO":"bar"},"timeout":120}`)
	if r.status != 201 {
		t.Fatalf("create: %d %s", r.status, r.body)
	}
	var raw map[string]any
	r.json(t, &raw)
	for _, f := range []string{"sandboxID", "templateID", "clientID", "envdVersion", "envdAccessToken", "domain", "trafficAccessToken"} {
		if _, ok := raw[f]; !ok {
			t.Fatalf("create response lacks %q: %s", f, r.body)
		}
	}
	if raw["trafficAccessToken"] != nil || raw["domain"] != testDomain || raw["envdVersion"] != sandbox.EnvdVersion || raw["clientID"] != DefaultClientID {
		t.Fatalf("create response %s", r.body)
	}
	id := raw["sandboxID"].(string)
	token := raw["envdAccessToken"].(string)

	r = e.ctl("GET", "/sandboxes/"+id, "")
	if r.status != 200 {
		t.Fatalf("get: %d %s", r.status, r.body)
	}
	var detail map[string]any
	r.json(t, &detail)
	for _, f := range []string{"sandboxID", "templateID", "clientID", "cpuCount", "memoryMB", "diskSizeMB", "startedAt", "endAt",
		"envdVersion", "state", "metadata", "envdAccessToken", "domain", "lifecycle", "allowInternetAccess", "volumeMounts"} {
		if _, ok := detail[f]; !ok {
			t.Fatalf("detail lacks %q: %s", f, r.body)
		}
	}
	if detail["state"] != "running" || detail["envdAccessToken"] != token {
		t.Fatalf("detail %s", r.body)
	}
	if _, err := time.Parse(time.RFC3339, detail["startedAt"].(string)); err != nil {
		t.Fatalf("startedAt not RFC 3339: %v", err)
	}

	steps := []struct {
		name, method, path, body string
		want                     int
		wantState                sandbox.State
	}{
		{"set timeout", "POST", "/sandboxes/" + id + "/timeout", `{"timeout":60}`, 204, sandbox.StateRunning},
		{"refresh", "POST", "/sandboxes/" + id + "/refreshes", `{"duration":30}`, 204, sandbox.StateRunning},
		{"resume running", "POST", "/sandboxes/" + id + "/resume", `{"timeout":60,"autoPause":false}`, 409, sandbox.StateRunning},
		{"pause", "POST", "/sandboxes/" + id + "/pause", `{}`, 204, sandbox.StatePaused},
		{"pause again", "POST", "/sandboxes/" + id + "/pause", `{}`, 409, sandbox.StatePaused},
		{"timeout on paused fails (legacy connect trap)", "POST", "/sandboxes/" + id + "/timeout", `{"timeout":60}`, 404, sandbox.StatePaused},
		{"connect v2 resumes", "POST", "/v2/sandboxes/" + id + "/connect", `{"timeout":30}`, 201, sandbox.StateRunning},
		{"connect v2 running", "POST", "/v2/sandboxes/" + id + "/connect", ``, 200, sandbox.StateRunning},
		{"pause with memory flag", "POST", "/sandboxes/" + id + "/pause", `{"memory":false}`, 204, sandbox.StatePaused},
		{"connect v1 resumes", "POST", "/sandboxes/" + id + "/connect", `{"timeout":30}`, 201, sandbox.StateRunning},
		{"pause empty body", "POST", "/sandboxes/" + id + "/pause", ``, 204, sandbox.StatePaused},
		{"resume", "POST", "/sandboxes/" + id + "/resume", `{"timeout":30}`, 201, sandbox.StateRunning},
		{"legacy id with clientID", "GET", "/sandboxes/" + id + "-" + DefaultClientID, ``, 200, sandbox.StateRunning},
		{"kill", "DELETE", "/sandboxes/" + id, ``, 204, sandbox.StateKilled},
		{"kill again", "DELETE", "/sandboxes/" + id, ``, 404, sandbox.StateKilled},
		{"get killed", "GET", "/sandboxes/" + id, ``, 404, sandbox.StateKilled},
		{"connect killed", "POST", "/v2/sandboxes/" + id + "/connect", `{}`, 404, sandbox.StateKilled},
		{"pause killed", "POST", "/sandboxes/" + id + "/pause", `{}`, 404, sandbox.StateKilled},
	}
	for _, st := range steps {
		r := e.ctl(st.method, st.path, st.body)
		if st.want >= 400 {
			func() {
				defer func() {
					if t.Failed() {
						t.Fatalf("step %q", st.name)
					}
				}()
				r.wantError(t, st.want)
			}()
		} else if r.status != st.want {
			t.Fatalf("step %q: status %d, want %d: %s", st.name, r.status, st.want, r.body)
		}
		if st.want == 200 || st.want == 201 && strings.Contains(st.path, "connect") || strings.HasSuffix(st.path, "/resume") && st.want == 201 {
			var sj map[string]any
			r.json(t, &sj)
			if sj["sandboxID"] != id || sj["envdAccessToken"] != token {
				t.Fatalf("step %q: response %s must carry the same id and token", st.name, r.body)
			}
		}
		if got := e.fake.state(id); got != st.wantState {
			t.Fatalf("step %q: state %s, want %s", st.name, got, st.wantState)
		}
	}
}

func TestBadInput(t *testing.T) {
	e := newEnv(t)
	sb := e.fake.add(sandbox.StateRunning, nil)
	huge := fmt.Sprintf(`{"templateID":"base","metadata":{"k":"%s"}}`, strings.Repeat("v", DefaultMaxBodyBytes))
	tests := []struct {
		name, method, path, body string
		want                     int
	}{
		{"malformed JSON", "POST", "/v2/sandboxes", `{"templateID":`, 400},
		{"not an object", "POST", "/v2/sandboxes", `[1,2]`, 400},
		{"string", "POST", "/v2/sandboxes", `"base"`, 400},
		{"wrong type timeout", "POST", "/v2/sandboxes", `{"templateID":"base","timeout":"soon"}`, 400},
		{"fractional timeout", "POST", "/v2/sandboxes", `{"templateID":"base","timeout":1.5}`, 400},
		{"overflowing timeout", "POST", "/v2/sandboxes", `{"templateID":"base","timeout":1e30}`, 400},
		{"negative timeout", "POST", "/v2/sandboxes", `{"templateID":"base","timeout":-1}`, 400},
		{"timeout over max", "POST", "/v2/sandboxes", fmt.Sprintf(`{"templateID":"base","timeout":%d}`, int64(sandbox.MaxTimeout/time.Second)+1), 400},
		{"wrong type metadata", "POST", "/v2/sandboxes", `{"templateID":"base","metadata":{"a":1}}`, 400},
		{"wrong type envVars", "POST", "/sandboxes", `{"templateID":"base","envVars":["A=1"]}`, 400},
		{"trailing data", "POST", "/v2/sandboxes", `{"templateID":"base"} {}`, 400},
		{"empty body", "POST", "/v2/sandboxes", ``, 400},
		{"missing templateID", "POST", "/v2/sandboxes", `{}`, 400},
		{"odd templateID", "POST", "/v2/sandboxes", `{"templateID":"../etc"}`, 400},
		{"unknown template", "POST", "/v2/sandboxes", `{"templateID":"nosuch"}`, 404},
		{"body over limit", "POST", "/v2/sandboxes", huge, 413},
		{"odd sandbox id", "GET", "/sandboxes/ABC$", ``, 404},
		{"encoded slash in id", "GET", "/sandboxes/a%2Fb", ``, 404},
		{"unknown sandbox", "GET", "/sandboxes/nosuch", ``, 404},
		{"timeout missing", "POST", "/sandboxes/" + sb.ID + "/timeout", `{}`, 400},
		{"timeout negative", "POST", "/sandboxes/" + sb.ID + "/timeout", `{"timeout":-5}`, 400},
		{"timeout huge", "POST", "/sandboxes/" + sb.ID + "/timeout", `{"timeout":9223372036854775807}`, 400},
		{"connect wrong type", "POST", "/v2/sandboxes/" + sb.ID + "/connect", `{"timeout":true}`, 400},
		{"fork count zero", "POST", "/sandboxes/" + sb.ID + "/fork", `{"count":0}`, 400},
		{"fork count too big", "POST", "/sandboxes/" + sb.ID + "/fork", `{"count":65}`, 400},
		{"fork count negative", "POST", "/sandboxes/" + sb.ID + "/fork", `{"count":-1}`, 400},
		{"metrics bad start", "GET", "/sandboxes/" + sb.ID + "/metrics?start=yesterday", ``, 400},
		{"list bad limit", "GET", "/v2/sandboxes?limit=0", ``, 400},
		{"list limit too big", "GET", "/v2/sandboxes?limit=100000", ``, 400},
		{"list bad state", "GET", "/v2/sandboxes?state=running,dead", ``, 400},
		{"list bad order", "GET", "/v2/sandboxes?order=sideways", ``, 400},
		{"list bad token", "GET", "/v2/sandboxes?nextToken=Zm9v", ``, 400},
		{"list bad startedAfter", "GET", "/v2/sandboxes?startedAfter=monday", ``, 400},
		{"list bad metadata", "GET", "/v2/sandboxes?metadata=" + url.QueryEscape("a=%zz"), ``, 400},
		{"unknown route", "GET", "/nope", ``, 404},
		{"trailing slash", "GET", "/sandboxes/", ``, 404},
		{"wrong method", "PATCH", "/sandboxes/" + sb.ID, ``, 405},
		{"wrong method on collection", "DELETE", "/v2/sandboxes", ``, 405},
		{"delete odd template", "DELETE", "/templates/$$", ``, 404},
		{"delete unknown template", "DELETE", "/templates/nosuch", ``, 404},
		{"build bad name", "POST", "/ember/templates/Bad%20Name/build", `{}`, 400},
		{"build bad cpu", "POST", "/ember/templates/t1/build", `{"cpuCount":-2}`, 400},
		{"api key wrong type", "POST", "/api-keys", `{"name":5}`, 400},
		{"delete odd api key", "DELETE", "/api-keys/zz!", ``, 404},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := e.ctl(tt.method, tt.path, tt.body, "Content-Type", "application/json")
			r.wantError(t, tt.want)
		})
	}
	t.Run("unknown fields are ignored", func(t *testing.T) {
		r := e.ctl("POST", "/sandboxes", `{"templateID":"base","secure":true,"allow_internet_access":false,"somethingNew":{"x":[1]}}`)
		if r.status != 201 {
			t.Fatalf("status %d: %s", r.status, r.body)
		}
		var sj sandboxJSON
		r.json(t, &sj)
		got, _ := e.fake.Get(context.Background(), sj.SandboxID)
		if got.AllowInternet {
			t.Fatalf("allow_internet_access=false was not passed on")
		}
	})
	t.Run("405 names the allowed methods", func(t *testing.T) {
		r := e.ctl("PUT", "/sandboxes/"+sb.ID, "")
		if allow := r.header.Get("Allow"); allow != "DELETE, GET" {
			t.Fatalf("Allow %q", allow)
		}
	})
}

func TestListPagination(t *testing.T) {
	e := newEnv(t)
	var ids []string // in start order
	for i := 0; i < 5; i++ {
		ids = append(ids, e.fake.add(sandbox.StateRunning, map[string]string{"n": fmt.Sprint(i)}).ID)
	}
	e.fake.Pause(context.Background(), ids[1])
	e.fake.Kill(context.Background(), ids[2])
	live := []string{ids[4], ids[3], ids[1], ids[0]} // newest first

	for _, order := range []string{"", "asc"} {
		t.Run("order="+order, func(t *testing.T) {
			want := live
			if order == "asc" {
				want = []string{ids[0], ids[1], ids[3], ids[4]}
			}
			var got []string
			token := ""
			pages := 0
			for {
				q := url.Values{"limit": {"3"}}
				if order != "" {
					q.Set("order", order)
				}
				if token != "" {
					q.Set("nextToken", token)
				}
				r := e.ctl("GET", "/v2/sandboxes?"+q.Encode(), "")
				if r.status != 200 {
					t.Fatalf("status %d %s", r.status, r.body)
				}
				var page []listedSandboxJSON
				r.json(t, &page)
				for _, s := range page {
					got = append(got, s.SandboxID)
				}
				pages++
				token = r.header.Get(HeaderNextToken)
				if token == "" {
					break
				}
				if pages > 5 {
					t.Fatal("pagination does not end")
				}
			}
			if pages != 2 || strings.Join(got, ",") != strings.Join(want, ",") {
				t.Fatalf("got %v in %d pages, want %v in 2", got, pages, want)
			}
		})
	}

	t.Run("last page has no token", func(t *testing.T) {
		r := e.ctl("GET", "/v2/sandboxes?limit=4", "")
		if tok := r.header.Get(HeaderNextToken); tok != "" {
			t.Fatalf("token %q on the last page", tok)
		}
	})
	t.Run("v1 list is running only", func(t *testing.T) {
		var got []listedSandboxJSON
		e.ctl("GET", "/sandboxes", "").json(t, &got)
		if len(got) != 3 {
			t.Fatalf("v1 list %d sandboxes, want 3 running", len(got))
		}
		for _, s := range got {
			if s.State != "running" || s.Metadata == nil || s.VolumeMounts == nil {
				t.Fatalf("v1 list item %+v", s)
			}
		}
	})
}

func TestListFilters(t *testing.T) {
	e := newEnv(t)
	a := e.fake.add(sandbox.StateRunning, map[string]string{"suite": "x", "who": "a b&c=d"})
	b := e.fake.add(sandbox.StatePaused, map[string]string{"suite": "x"})
	c := e.fake.add(sandbox.StateRunning, map[string]string{"suite": "y"})
	// The JS SDK encodes each key and value, joins with & and =, then the whole is encoded again.
	sdkMetadata := func(kv ...string) string {
		var parts []string
		for i := 0; i < len(kv); i += 2 {
			parts = append(parts, url.QueryEscape(kv[i])+"="+url.QueryEscape(kv[i+1]))
		}
		return url.QueryEscape(strings.Join(parts, "&"))
	}
	tests := []struct {
		name  string
		query string
		want  []string
	}{
		{"none: running and paused", "", []string{c.ID, b.ID, a.ID}},
		{"metadata", "metadata=" + sdkMetadata("suite", "x"), []string{b.ID, a.ID}},
		{"metadata with reserved characters ANDed", "metadata=" + sdkMetadata("suite", "x", "who", "a b&c=d"), []string{a.ID}},
		{"metadata no match", "metadata=" + sdkMetadata("suite", "z"), nil},
		{"state comma", "state=running,paused", []string{c.ID, b.ID, a.ID}},
		{"state exploded", "state=paused&state=running", []string{c.ID, b.ID, a.ID}},
		{"state paused", "state=paused", []string{b.ID}},
		{"state running plus metadata", "state=running&metadata=" + sdkMetadata("suite", "x"), []string{a.ID}},
		{"template", "template=base", []string{c.ID, b.ID, a.ID}},
		{"other template", "template=other", nil},
		{"startedAfter", "startedAfter=" + url.QueryEscape(a.StartedAt.Format(time.RFC3339Nano)), []string{c.ID, b.ID}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := e.ctl("GET", "/v2/sandboxes?"+tt.query, "")
			if r.status != 200 {
				t.Fatalf("status %d %s", r.status, r.body)
			}
			var got []listedSandboxJSON
			r.json(t, &got)
			var ids []string
			for _, s := range got {
				ids = append(ids, s.SandboxID)
			}
			if strings.Join(ids, ",") != strings.Join(tt.want, ",") {
				t.Fatalf("got %v, want %v", ids, tt.want)
			}
		})
	}
}

func TestForkSnapshotsMetricsTemplates(t *testing.T) {
	e := newEnv(t)
	sb := e.fake.add(sandbox.StateRunning, nil)

	// The second child's restore fails: the fork answers 201 with one sandbox and one error.
	var restores atomic.Int32
	e.fake.rig.Driver.Fail = func(op, id string) error {
		if op == "Restore" {
			if restores.Add(1) == 2 {
				return fmt.Errorf("no slot: %w", errdefs.ErrExhausted)
			}
		}
		return nil
	}
	r := e.ctl("POST", "/sandboxes/"+sb.ID+"/fork", `{"count":2,"timeout":60}`)
	e.fake.rig.Driver.Fail = nil
	if r.status != 201 {
		t.Fatalf("fork %d %s", r.status, r.body)
	}
	var fr []forkResultJSON
	r.json(t, &fr)
	var ok, failed int
	for _, c := range fr {
		switch {
		case c.Sandbox != nil && c.Sandbox.SandboxID != sb.ID && c.Sandbox.EnvdAccessToken != "" && c.Sandbox.EnvdAccessToken != sb.AccessToken:
			ok++
			if got, err := e.fake.Get(context.Background(), c.Sandbox.SandboxID); err != nil || got.State != sandbox.StateRunning {
				t.Fatalf("fork child %s: %v", c.Sandbox.SandboxID, err)
			}
		case c.Error != nil && c.Error.Code == 429:
			failed++
		}
	}
	if len(fr) != 2 || ok != 1 || failed != 1 {
		t.Fatalf("fork results %s", r.body)
	}
	e.ctl("POST", "/sandboxes/nosuch/fork", `{}`).wantError(t, 404)

	r = e.ctl("POST", "/sandboxes/"+sb.ID+"/snapshots", `{"name":"snap1"}`)
	if r.status != 201 {
		t.Fatalf("snapshot %d %s", r.status, r.body)
	}
	var snap createSnapshotResponse
	r.json(t, &snap)
	if snap.SnapshotID != "snap1" || len(snap.Names) != 1 || snap.Names[0] != "snap1" {
		t.Fatalf("snapshot %s", r.body)
	}
	other := e.fake.add(sandbox.StateRunning, nil)
	e.ctl("POST", "/sandboxes/"+other.ID+"/snapshots", ``)
	var snaps []snapshotJSON
	e.ctl("GET", "/snapshots?sandboxID="+sb.ID, "").json(t, &snaps)
	if len(snaps) != 1 || snaps[0].SnapshotID != snap.SnapshotID {
		t.Fatalf("snapshots of %s: %+v", sb.ID, snaps)
	}
	r = e.ctl("GET", "/snapshots?limit=1", "")
	r.json(t, &snaps)
	if len(snaps) != 1 || r.header.Get(HeaderNextToken) == "" {
		t.Fatalf("paged snapshots %s token %q", r.body, r.header.Get(HeaderNextToken))
	}
	r = e.ctl("GET", "/snapshots?limit=1&nextToken="+url.QueryEscape(r.header.Get(HeaderNextToken)), "")
	var page2 []snapshotJSON
	r.json(t, &page2)
	if len(page2) != 1 || page2[0].SnapshotID == snaps[0].SnapshotID || r.header.Get(HeaderNextToken) != "" {
		t.Fatalf("second page %s", r.body)
	}
	if r := e.ctl("DELETE", "/templates/"+url.PathEscape(snap.SnapshotID), ""); r.status != 204 {
		t.Fatalf("delete snapshot %d %s", r.status, r.body)
	}
	e.ctl("DELETE", "/templates/"+url.PathEscape(snap.SnapshotID), "").wantError(t, 404)

	var ms []map[string]any
	now := time.Now().Unix()
	r = e.ctl("GET", fmt.Sprintf("/sandboxes/%s/metrics?start=%d&end=%d", sb.ID, now-60, now+60), "")
	r.json(t, &ms)
	if len(ms) != 1 {
		t.Fatalf("metrics in range: %s", r.body)
	}
	var none []map[string]any
	e.ctl("GET", fmt.Sprintf("/sandboxes/%s/metrics?start=%d&end=%d", sb.ID, now-600, now-300), "").json(t, &none)
	if len(none) != 0 {
		t.Fatalf("metrics outside the range: %v", none)
	}
	for _, f := range []string{"timestamp", "timestampUnix", "cpuCount", "cpuUsedPct", "memUsed", "memTotal", "memCache", "diskUsed", "diskTotal"} {
		if _, ok := ms[0][f]; !ok {
			t.Fatalf("metric lacks %q: %s", f, r.body)
		}
	}
	e.ctl("GET", "/sandboxes/nosuch/metrics", "").wantError(t, 404)

	var ts []templateJSON
	e.ctl("GET", "/templates", "").json(t, &ts)
	if len(ts) == 0 || ts[0].TemplateID != "base" || ts[0].BuildStatus != "ready" || ts[0].Aliases == nil {
		t.Fatalf("templates %+v", ts)
	}
}

func TestBuildStreamsNDJSON(t *testing.T) {
	e := newEnv(t)
	e.fake.build = func(ctx context.Context, req sandbox.BuildRequest, progress func(string)) (*sandbox.Template, error) {
		if req.Name == "broken" {
			progress("step 1")
			return nil, fmt.Errorf("readyCmd never succeeded: %w", errdefs.ErrInvalid)
		}
		if req.From != "debian:bookworm" || req.StartCmd != "sleep inf" || req.CPUCount != 2 || req.MemoryMB != 1024 {
			t.Errorf("build request %+v", req)
		}
		progress("step 1")
		progress("step 2")
		return &sandbox.Template{ID: req.Name, Ready: true, Aliases: []string{req.Name}}, nil
	}
	r := e.ctl("POST", "/ember/templates/mytmpl/build", `{"from":"debian:bookworm","startCmd":"sleep inf","force":true,"cpuCount":2,"memoryMB":1024}`)
	if r.status != 200 || r.header.Get("Content-Type") != "application/x-ndjson" {
		t.Fatalf("build %d %q", r.status, r.header.Get("Content-Type"))
	}
	lines := ndjson(t, r.body)
	if len(lines) != 3 || lines[0].Line != "step 1" || lines[1].Line != "step 2" || lines[2].Template == nil || lines[2].Template.TemplateID != "mytmpl" {
		t.Fatalf("build stream %s", r.body)
	}
	r = e.ctl("POST", "/ember/templates/broken/build", ``)
	lines = ndjson(t, r.body)
	if len(lines) != 2 || lines[1].Error == nil || lines[1].Error.Code != 400 || !strings.Contains(lines[1].Error.Message, "readyCmd") {
		t.Fatalf("failed build stream %s", r.body)
	}
}

func ndjson(t *testing.T, b []byte) []buildLine {
	t.Helper()
	var out []buildLine
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		var l buildLine
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			t.Fatalf("line %q: %v", sc.Text(), err)
		}
		out = append(out, l)
	}
	return out
}

func TestAPIKeys(t *testing.T) {
	e := newEnv(t)
	r := e.ctl("POST", "/api-keys", `{"name":"ci"}`)
	if r.status != 201 {
		t.Fatalf("create key %d %s", r.status, r.body)
	}
	var k apiKeyJSON
	r.json(t, &k)
	if !strings.HasPrefix(k.Key, "e2b_") || k.Name != "ci" || k.ID == "" || !strings.Contains(k.Mask, "…") || k.CreatedAt.IsZero() {
		t.Fatalf("created key %s", r.body)
	}
	if r := e.do("GET", "/v2/sandboxes", "", "X-API-Key", k.Key); r.status != 200 {
		t.Fatalf("new key rejected: %d", r.status)
	}
	r = e.ctl("GET", "/api-keys", "")
	if strings.Contains(string(r.body), k.Key) || strings.Contains(string(r.body), "hash") {
		t.Fatalf("list leaks secrets: %s", r.body)
	}
	var list []apiKeyJSON
	r.json(t, &list)
	if len(list) != 2 {
		t.Fatalf("list %s", r.body)
	}
	if r := e.ctl("DELETE", "/api-keys/"+k.ID, ""); r.status != 204 {
		t.Fatalf("revoke %d %s", r.status, r.body)
	}
	e.ctl("DELETE", "/api-keys/"+k.ID, "").wantError(t, 404)
	e.do("GET", "/v2/sandboxes", "", "X-API-Key", k.Key).wantError(t, 401)
	// The last key cannot be revoked: that would lock everyone out.
	e.ctl("GET", "/api-keys", "").json(t, &list)
	e.ctl("DELETE", "/api-keys/"+list[0].ID, "").wantError(t, 409)
}

func TestPanicIsJSON500(t *testing.T) {
	e := newEnv(t)
	sb := e.fake.add(sandbox.StateRunning, nil)
	e.fake.fork = func(context.Context, string, int, time.Duration) ([]sandbox.ForkResult, error) {
		panic("boom")
	}
	e.ctl("POST", "/sandboxes/"+sb.ID+"/fork", `{}`).wantError(t, 500)
	e.fake.fork = func(context.Context, string, int, time.Duration) ([]sandbox.ForkResult, error) {
		return nil, errors.New("disk on fire")
	}
	r := e.ctl("POST", "/sandboxes/"+sb.ID+"/fork", `{}`)
	r.wantError(t, 500)
	if strings.Contains(string(r.body), "fire") {
		t.Fatalf("500 leaks the internal error: %s", r.body)
	}
}

func TestRetryAfterOn429(t *testing.T) {
	e := newEnv(t)
	sb := e.fake.add(sandbox.StateRunning, nil)
	e.fake.fork = func(context.Context, string, int, time.Duration) ([]sandbox.ForkResult, error) {
		return nil, fmt.Errorf("no free slots: %w", errdefs.ErrExhausted)
	}
	r := e.ctl("POST", "/sandboxes/"+sb.ID+"/fork", `{}`)
	r.wantError(t, 429)
	if r.header.Get("Retry-After") != "1" {
		t.Fatalf("Retry-After %q", r.header.Get("Retry-After"))
	}
}
