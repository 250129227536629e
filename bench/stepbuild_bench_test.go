package bench

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"testing"
	"time"
)

// stepBuild runs one build through E2B's template API (request, start, poll) and returns how
// long it took from the request to status ready.
func (n *node) stepBuild(b *testing.B, name string, body map[string]any) time.Duration {
	b.Helper()
	call := func(method, path string, in, out any) int {
		var rd *bytes.Reader
		if in != nil {
			data, _ := json.Marshal(in)
			rd = bytes.NewReader(data)
		} else {
			rd = bytes.NewReader(nil)
		}
		req, _ := http.NewRequest(method, n.url+path, rd)
		req.Header.Set("X-API-Key", n.key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			b.Fatal(err)
		}
		defer resp.Body.Close()
		if out != nil {
			json.NewDecoder(resp.Body).Decode(out)
		}
		return resp.StatusCode
	}
	start := time.Now()
	var r struct{ TemplateID, BuildID string }
	if code := call("POST", "/v3/templates", map[string]any{"name": name}, &r); code != 202 {
		b.Fatalf("request build: %d", code)
	}
	if code := call("POST", "/v2/templates/"+r.TemplateID+"/builds/"+r.BuildID, body, nil); code != 202 {
		b.Fatalf("start build: %d", code)
	}
	for {
		var st struct {
			Status string
			Reason *struct{ Message string }
		}
		call("GET", "/templates/"+r.TemplateID+"/builds/"+r.BuildID+"/status?limit=0", nil, &st)
		switch st.Status {
		case "ready":
			return time.Since(start)
		case "error":
			b.Fatalf("build failed: %+v", st.Reason)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// BenchmarkStepBuild: E2B's Template.build from base with four steps (two RUN, ENV, WORKDIR),
// from the request to a checkpointed template: every step new, the same steps again (cached),
// and one step appended to cached steps.
func BenchmarkStepBuild(b *testing.B) {
	n := getNode(b, 0)
	steps := func(nonce string, extra ...map[string]any) map[string]any {
		s := []map[string]any{
			{"type": "RUN", "args": []string{"echo " + nonce + " > /home/user/nonce && seq 1 100000 > /home/user/numbers"}},
			{"type": "ENV", "args": []string{"MODE", "bench"}},
			{"type": "WORKDIR", "args": []string{"/home/user/app"}},
			{"type": "RUN", "args": []string{"echo \"$MODE\" > mode.txt"}},
		}
		return map[string]any{"fromTemplate": "base", "steps": append(s, extra...), "startCmd": "sleep infinity"}
	}
	var cold, cached, appended dist
	for i := 0; i < 5; i++ {
		nonce := fmt.Sprintf("%d-%d", time.Now().UnixNano(), i)
		name := fmt.Sprintf("bench-steps-%d", i)
		cold = append(cold, n.stepBuild(b, name, steps(nonce)))
		cached = append(cached, n.stepBuild(b, name, steps(nonce)))
		appended = append(appended, n.stepBuild(b, name, steps(nonce, map[string]any{"type": "RUN", "args": []string{"echo more > more.txt"}})))
	}
	fmt.Printf("\n== step builds (E2B template API, from base, 4 steps) ==\n")
	report(b, "step build: every step new", cold)
	report(b, "step build: unchanged (cached)", cached)
	report(b, "step build: one step appended", appended)
}
