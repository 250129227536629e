package api

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/base64"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/ember-sandbox/ember/api/gen/process"
	"github.com/ember-sandbox/ember/api/gen/process/processconnect"
	"github.com/ember-sandbox/ember/internal/datadir"
	"github.com/ember-sandbox/ember/internal/template/build"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// fakeProcesses is envd's process service in the guest of API tests: it records every command
// and ends it with exit 0, or 3 for a line with "exit 3"; a line with "block" waits for release.
type fakeProcesses struct {
	processconnect.UnimplementedProcessHandler
	mu      sync.Mutex
	runs    []fakeRun
	release chan struct{}
}

type fakeRun struct {
	Line, User, Cwd string
	Envs            map[string]string
}

func (f *fakeProcesses) Start(ctx context.Context, req *connect.Request[process.StartRequest], st *connect.ServerStream[process.StartResponse]) error {
	cfg := req.Msg.GetProcess()
	line := cfg.GetArgs()[len(cfg.GetArgs())-1]
	user := ""
	if v, ok := strings.CutPrefix(req.Header().Get("Authorization"), "Basic "); ok {
		b, _ := base64.StdEncoding.DecodeString(v)
		user, _, _ = strings.Cut(string(b), ":")
	}
	f.mu.Lock()
	f.runs = append(f.runs, fakeRun{Line: line, User: user, Cwd: cfg.GetCwd(), Envs: cfg.GetEnvs()})
	f.mu.Unlock()
	send := func(e *process.ProcessEvent) error { return st.Send(&process.StartResponse{Event: e}) }
	send(&process.ProcessEvent{Event: &process.ProcessEvent_Start{Start: &process.ProcessEvent_StartEvent{Pid: 7}}})
	if strings.Contains(line, "hang") { // until the caller gives up
		<-ctx.Done()
		return ctx.Err()
	}
	if strings.Contains(line, "flood") { // 8 MiB of output, then a failure
		chunk := []byte(strings.Repeat("f", 64<<10))
		for i := 0; i < 128; i++ {
			if err := send(&process.ProcessEvent{Event: &process.ProcessEvent_Data{Data: &process.ProcessEvent_DataEvent{Output: &process.ProcessEvent_DataEvent_Stdout{Stdout: chunk}}}}); err != nil {
				return err
			}
		}
		return send(&process.ProcessEvent{Event: &process.ProcessEvent_End{End: &process.ProcessEvent_EndEvent{ExitCode: 1, Exited: true}}})
	}
	if strings.Contains(line, "block") {
		select {
		case <-f.release:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	code := int32(0)
	if strings.Contains(line, "exit 3") {
		code = 3
	}
	send(&process.ProcessEvent{Event: &process.ProcessEvent_Data{Data: &process.ProcessEvent_DataEvent{Output: &process.ProcessEvent_DataEvent_Stdout{Stdout: []byte("out of " + line + "\n")}}}})
	return send(&process.ProcessEvent{Event: &process.ProcessEvent_End{End: &process.ProcessEvent_EndEvent{ExitCode: code, Exited: true}}})
}

func (f *fakeProcesses) lines() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for _, r := range f.runs {
		out = append(out, r.Line)
	}
	return out
}

func (f *fakeProcesses) find(sub string) (fakeRun, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, r := range f.runs {
		if strings.Contains(r.Line, sub) {
			return r, true
		}
	}
	return fakeRun{}, false
}

type buildInfo struct {
	Status     string `json:"status"`
	LogEntries []struct {
		Level, Message, Step string
		Timestamp            time.Time
	} `json:"logEntries"`
	Logs   []string `json:"logs"`
	Reason *struct {
		Message, Step string
	} `json:"reason"`
}

func (b buildInfo) messages() string {
	var m []string
	for _, e := range b.LogEntries {
		m = append(m, e.Step+"|"+e.Message)
	}
	return strings.Join(m, "\n")
}

// requestBuild is POST /v3/templates; it returns the template and build ids.
func (e *env) requestBuild(name string) (string, string) {
	e.t.Helper()
	r := e.ctl("POST", "/v3/templates", `{"name":"`+name+`","cpuCount":1,"memoryMB":256}`)
	if r.status != http.StatusAccepted {
		e.t.Fatalf("request build: %d %s", r.status, r.body)
	}
	var out struct {
		TemplateID, BuildID string
		Tags                []string
	}
	r.json(e.t, &out)
	return out.TemplateID, out.BuildID
}

// waitBuild polls the build's status until it is not building.
func (e *env) waitBuild(tpl, build string) buildInfo {
	e.t.Helper()
	var all buildInfo
	testutil.EventuallyOr(e.t, 10*time.Second, func() bool {
		r := e.ctl("GET", fmt.Sprintf("/templates/%s/builds/%s/status?logsOffset=%d", tpl, build, len(all.LogEntries)), "")
		if r.status != http.StatusOK {
			e.t.Fatalf("status: %d %s", r.status, r.body)
		}
		var bi buildInfo
		r.json(e.t, &bi)
		all.LogEntries = append(all.LogEntries, bi.LogEntries...)
		all.Status, all.Reason, all.Logs = bi.Status, bi.Reason, bi.Logs
		return bi.Status != "building" && bi.Status != "waiting" && len(bi.LogEntries) == 0
	}, func() string { return fmt.Sprintf("build still %s; logs:\n%s", all.Status, all.messages()) })
	return all
}

func gzTar(t *testing.T, name, body string) []byte {
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	tw := tar.NewWriter(zw)
	tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(body)), Typeflag: tar.TypeReg})
	tw.Write([]byte(body))
	tw.Close()
	zw.Close()
	return buf.Bytes()
}

const helloHash = "1111111111111111111111111111111111111111111111111111111111111111"

// upload asks for the upload URL of a files hash and PUTs the tarball there.
func (e *env) upload(tpl, hash string, tarball []byte) {
	e.t.Helper()
	r := e.ctl("GET", "/templates/"+tpl+"/files/"+hash, "")
	var fu struct {
		Present bool
		URL     string
	}
	r.json(e.t, &fu)
	if r.status != http.StatusCreated || fu.Present || !strings.HasPrefix(fu.URL, e.api.URL+uploadPrefix) {
		e.t.Fatalf("files: %d %s", r.status, r.body)
	}
	req, _ := http.NewRequest("PUT", fu.URL, bytes.NewReader(tarball))
	res, err := http.DefaultClient.Do(req)
	if err != nil || res.StatusCode != http.StatusOK {
		e.t.Fatalf("upload: %v %v", err, res.Status)
	}
	res.Body.Close()
	// The link is single-use.
	req, _ = http.NewRequest("PUT", fu.URL, bytes.NewReader(tarball))
	if res, err = http.DefaultClient.Do(req); err != nil || res.StatusCode != http.StatusForbidden {
		e.t.Fatalf("second upload to one link: %v %v", err, res.Status)
	}
	res.Body.Close()
	r = e.ctl("GET", "/templates/"+tpl+"/files/"+hash, "")
	fu.URL = ""
	r.json(e.t, &fu)
	if !fu.Present || fu.URL != "" {
		e.t.Fatalf("after the upload: %s", r.body)
	}
}

func buildBody(steps string) string {
	return `{"fromTemplate":"base","startCmd":"start-it","readyCmd":"ready-check","steps":[` + steps + `]}`
}

const appSteps = `{"type":"RUN","args":["echo one"]},
	{"type":"ENV","args":["GREETING","hi","OTHER","x"]},
	{"type":"WORKDIR","args":["app"]},
	{"type":"COPY","args":["hello.txt","./","",""],"filesHash":"` + helloHash + `","forceUpload":null},
	{"type":"RUN","args":["make it","root"]}`

// The SDK's flow end to end over the Manager: request, upload, start, poll; the steps run in
// the build sandbox as E2B runs them (user, workdir, env), the template is created with the
// steps' defaults and its tag; then a rebuild is cached, an appended step runs alone, and the
// records answer GET /templates/{id} and its tags.
func TestTemplateBuildFlow(t *testing.T) {
	e := newEnv(t)
	procs := e.guest.procs
	tpl, bid := e.requestBuild("app:v1")
	if tpl != "app" {
		t.Fatalf("template id %q", tpl)
	}
	e.upload(tpl, helloHash, gzTar(t, "hello.txt", "hello"))
	if r := e.ctl("POST", "/v2/templates/app/builds/"+bid, buildBody(appSteps)); r.status != http.StatusAccepted {
		t.Fatalf("start: %d %s", r.status, r.body)
	}
	bi := e.waitBuild(tpl, bid)
	if bi.Status != "ready" {
		t.Fatalf("build %s: %+v\n%s", bi.Status, bi.Reason, bi.messages())
	}
	for _, want := range []string{"1|[builder 1/5] RUN echo one", "4|[builder 4/5] COPY hello.txt ./", "5|out of make it", "finalize|[finalize] start command: start-it"} {
		if !strings.Contains(bi.messages(), want) {
			t.Errorf("logs lack %q:\n%s", want, bi.messages())
		}
	}
	if bi.Logs == nil {
		t.Error("logs must be [] (the SDKs read it)")
	}
	run, _ := procs.find("echo one")
	if run.User != "user" || run.Cwd != "/home/user" {
		t.Errorf("RUN ran as %q in %q", run.User, run.Cwd)
	}
	run, _ = procs.find("make it")
	if run.User != "root" || run.Cwd != "/home/user/app" || run.Envs["GREETING"] != "hi" || run.Envs["OTHER"] != "x" {
		t.Errorf("RUN after ENV/WORKDIR ran as %+v", run)
	}
	if run, ok := procs.find("tar -xf"); !ok || !strings.Contains(run.Line, "'/home/user/app'") || run.User != "root" {
		t.Errorf("COPY: %+v", run)
	}
	if run, ok := procs.find("start-it"); !ok || run.User != "user" {
		t.Errorf("start command ran as %+v", run)
	}
	tm, err := e.fake.GetTemplate(context.Background(), "app")
	if err != nil || tm.Workdir != "/home/user/app" || tm.User != "user" || tm.Env["GREETING"] != "hi" || !tm.Ready || tm.BuildID != bid {
		t.Fatalf("template %+v %v", tm, err)
	}
	if r := e.ctl("GET", "/templates/aliases/app", ""); r.status != http.StatusOK {
		t.Fatalf("alias: %d", r.status)
	}
	var tags []struct{ Tag, BuildID string }
	e.ctl("GET", "/templates/app/tags", "").json(t, &tags)
	if len(tags) != 1 || tags[0].Tag != "v1" || tags[0].BuildID != bid {
		t.Fatalf("tags %+v", tags)
	}

	// The logs endpoint pages the same lines, both ways.
	var lg struct {
		Logs []struct {
			Message   string
			Timestamp time.Time
		}
	}
	e.ctl("GET", "/templates/app/builds/"+bid+"/logs?limit=2", "").json(t, &lg)
	if len(lg.Logs) != 2 || lg.Logs[0].Message != bi.LogEntries[0].Message {
		t.Fatalf("logs forward: %+v", lg.Logs)
	}
	last := bi.LogEntries[len(bi.LogEntries)-1]
	e.ctl("GET", fmt.Sprintf("/templates/app/builds/%s/logs?direction=backward&limit=1&cursor=%d", bid, last.Timestamp.UnixMilli()+1), "").json(t, &lg)
	if len(lg.Logs) != 1 || lg.Logs[0].Message != last.Message {
		t.Fatalf("logs backward: %+v, want %q", lg.Logs, last.Message)
	}

	// Sandboxes of name:tag (and name:latest) are sandboxes of the template.
	for id, want := range map[string]int{"app:v1": 201, "app:latest": 201, "app:nope": 404} {
		if r := e.ctl("POST", "/v2/sandboxes", `{"templateID":"`+id+`"}`); r.status != want {
			t.Errorf("create from %s: %d %s", id, r.status, r.body)
		} else if want == 201 {
			var sb struct{ SandboxID string }
			r.json(t, &sb)
			e.ctl("DELETE", "/sandboxes/"+sb.SandboxID, "")
		}
	}

	// The same steps again: every step CACHED, nothing runs.
	n := len(procs.lines())
	_, bid2 := e.requestBuild("app")
	e.ctl("POST", "/v2/templates/app/builds/"+bid2, buildBody(appSteps))
	bi = e.waitBuild(tpl, bid2)
	if bi.Status != "ready" || !strings.Contains(bi.messages(), "CACHED [builder 5/5] RUN make it") || len(procs.lines()) != n {
		t.Fatalf("cached rebuild: %s, %d new commands\n%s", bi.Status, len(procs.lines())-n, bi.messages())
	}

	// One step more: the cached prefix is not run again, only the new step (plus the start and
	// ready commands of the new template).
	_, bid3 := e.requestBuild("app")
	e.ctl("POST", "/v2/templates/app/builds/"+bid3, buildBody(appSteps+`,{"type":"RUN","args":["echo two"]}`))
	bi = e.waitBuild(tpl, bid3)
	if bi.Status != "ready" {
		t.Fatalf("appended step: %s %+v\n%s", bi.Status, bi.Reason, bi.messages())
	}
	newRuns := procs.lines()[n:]
	if strings.Contains(strings.Join(newRuns, "\n"), "echo one") || !strings.Contains(strings.Join(newRuns, "\n"), "echo two") {
		t.Fatalf("commands of the appended build: %q", newRuns)
	}
	if !strings.Contains(bi.messages(), "CACHED [builder 5/6]") {
		t.Fatalf("logs:\n%s", bi.messages())
	}
	// force on a step re-runs it and what follows; the steps before it stay cached.
	n = len(procs.lines())
	_, bidF := e.requestBuild("app")
	forced := strings.Replace(appSteps, `"args":["make it","root"]}`, `"args":["make it","root"],"force":true}`, 1)
	e.ctl("POST", "/v2/templates/app/builds/"+bidF, buildBody(forced))
	if bi = e.waitBuild(tpl, bidF); bi.Status != "ready" || !strings.Contains(bi.messages(), "CACHED [builder 4/5] COPY") {
		t.Fatalf("forced step: %s\n%s", bi.Status, bi.messages())
	}
	if runs := strings.Join(procs.lines()[n:], "\n"); strings.Contains(runs, "echo one") || strings.Contains(runs, "tar -xf") || !strings.Contains(runs, "make it") {
		t.Fatalf("forced step: commands %q", runs)
	}
	// The same on the appended step.
	n = len(procs.lines())
	_, bid4 := e.requestBuild("app")
	e.ctl("POST", "/v2/templates/app/builds/"+bid4, buildBody(appSteps+`,{"type":"RUN","args":["echo two"],"force":true}`))
	if bi = e.waitBuild(tpl, bid4); bi.Status != "ready" {
		t.Fatalf("forced: %s", bi.Status)
	}
	if runs := strings.Join(procs.lines()[n:], "\n"); strings.Contains(runs, "echo one") || !strings.Contains(runs, "echo two") {
		t.Fatalf("forced step: commands %q", runs)
	}
	// force on the build runs every step.
	n = len(procs.lines())
	_, bid5 := e.requestBuild("app")
	e.ctl("POST", "/v2/templates/app/builds/"+bid5, strings.Replace(buildBody(appSteps), `{"fromTemplate"`, `{"force":true,"fromTemplate"`, 1))
	if bi = e.waitBuild(tpl, bid5); bi.Status != "ready" || strings.Contains(bi.messages(), "CACHED") {
		t.Fatalf("forced build: %s\n%s", bi.Status, bi.messages())
	}
	if runs := strings.Join(procs.lines()[n:], "\n"); !strings.Contains(runs, "echo one") || !strings.Contains(runs, "make it") {
		t.Fatalf("forced build: commands %q", runs)
	}

	var tw struct {
		TemplateID string
		Builds     []struct{ BuildID, Status string }
	}
	e.ctl("GET", "/templates/app", "").json(t, &tw)
	if tw.TemplateID != "app" || len(tw.Builds) != 6 || tw.Builds[0].BuildID != bid5 || tw.Builds[0].Status != "ready" {
		t.Fatalf("GET /templates/app: %+v", tw)
	}
	var list []struct {
		TemplateID, BuildID, BuildStatus string
		Names                            []string
	}
	e.ctl("GET", "/v2/templates", "").json(t, &list)
	found := false
	for _, l := range list {
		if l.TemplateID == "app" {
			found = l.BuildID == bid5 && l.BuildStatus == "ready" && len(l.Names) == 1 && l.Names[0] == "app"
		}
	}
	if !found {
		t.Fatalf("GET /v2/templates: %+v", list)
	}
	// Tags follow the current build; removing one that is not there is a 404.
	if r := e.ctl("POST", "/templates/tags", `{"target":"app:v1","tags":["prod"]}`); r.status != http.StatusCreated {
		t.Fatalf("assign: %d %s", r.status, r.body)
	}
	if r := e.ctl("DELETE", "/templates/tags", `{"name":"app","tags":["v1"]}`); r.status != http.StatusNoContent {
		t.Fatalf("remove: %d %s", r.status, r.body)
	}
	e.ctl("DELETE", "/templates/tags", `{"name":"app","tags":["v1"]}`).wantError(t, 404)
	e.ctl("POST", "/templates/tags", `{"target":"nope:v1","tags":["prod"]}`).wantError(t, 404)
}

// A failing step fails the build with the step's name and message, and leaves no template,
// no rootfs and no layer: only the build's record.
func TestTemplateBuildFailureLeavesNothing(t *testing.T) {
	e := newEnv(t)
	layersBefore, _ := filepath.Glob(filepath.Join(datadir.Layers(e.fake.dataDir), "*"))
	tpl, bid := e.requestBuild("broken")
	e.ctl("POST", "/v2/templates/broken/builds/"+bid, buildBody(`{"type":"RUN","args":["echo fine"]},{"type":"RUN","args":["false; exit 3"]}`))
	bi := e.waitBuild(tpl, bid)
	if bi.Status != "error" || bi.Reason == nil || bi.Reason.Step != "2" || !strings.Contains(bi.Reason.Message, "exit status 3") {
		t.Fatalf("failed build: %s %+v", bi.Status, bi.Reason)
	}
	e.ctl("GET", "/templates/aliases/broken", "").wantError(t, 404)
	// Scratch trees go in the background: give them a moment.
	testutil.Eventually(t, 5*time.Second, "the failed build's directory removed", func() bool {
		_, err := os.Stat(filepath.Join(datadir.Templates(e.fake.dataDir), "broken"))
		return os.IsNotExist(err)
	})
	layers, _ := filepath.Glob(filepath.Join(datadir.Layers(e.fake.dataDir), "*"))
	if len(layers) != len(layersBefore) {
		t.Fatalf("the failed build left layers: %v", layers)
	}
	sandboxes, _ := os.ReadDir(datadir.Sandboxes(e.fake.dataDir))
	if len(sandboxes) != 0 || len(e.fake.rig.Driver.Running()) != 0 {
		t.Fatalf("the failed build left sandboxes: %v", sandboxes)
	}
}

// A template's ready command is bounded: each run of it is timed out (one that never ends does
// not hold the build), and what it prints is kept to its last bytes (8 MiB of output does not
// end up in the daemon's memory and the build's status).
func TestTemplateReadyCommandIsBounded(t *testing.T) {
	defer func(a, b time.Duration) { build.ReadyTimeout, build.ReadyAttemptTimeout = a, b }(build.ReadyTimeout, build.ReadyAttemptTimeout)
	build.ReadyTimeout, build.ReadyAttemptTimeout = 1500*time.Millisecond, 300*time.Millisecond
	e := newEnv(t)
	for _, ready := range []string{"hang-forever", "flood-output"} {
		tpl, bid := e.requestBuild("ready-" + ready[:4])
		body := `{"fromTemplate":"base","readyCmd":"` + ready + `","steps":[{"type":"RUN","args":["echo one"]}]}`
		if r := e.ctl("POST", "/v2/templates/"+tpl+"/builds/"+bid, body); r.status != http.StatusAccepted {
			t.Fatalf("start: %d %s", r.status, r.body)
		}
		bi := e.waitBuild(tpl, bid)
		if bi.Status != "error" || bi.Reason == nil || !strings.Contains(bi.Reason.Message, "ready command never succeeded") {
			t.Fatalf("%s: build %s: %+v", ready, bi.Status, bi.Reason)
		}
		if n := len(bi.Reason.Message); n > 80<<10 {
			t.Fatalf("%s: the failure holds %d bytes of the ready command's output", ready, n)
		}
	}
}

// putFiles asks for the upload URL of a files hash and PUTs body there; it returns the status.
func (e *env) putFiles(tpl, hash string, body []byte) (int, string) {
	e.t.Helper()
	r := e.ctl("GET", "/templates/"+tpl+"/files/"+hash, "")
	var fu struct{ URL string }
	r.json(e.t, &fu)
	req, _ := http.NewRequest("PUT", fu.URL, bytes.NewReader(body))
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		e.t.Fatal(err)
	}
	defer res.Body.Close()
	msg, _ := io.ReadAll(res.Body)
	return res.StatusCode, string(msg)
}

// An uploaded COPY archive is decompressed on the host with a cap on its bytes and entries: a
// gzip bomb or an archive of a million entries answers 400, and nothing is stored.
func TestTemplateFilesUploadIsCapped(t *testing.T) {
	defer func(b int64, n int) { build.MaxCopyBytes, build.MaxCopyEntries = b, n }(build.MaxCopyBytes, build.MaxCopyEntries)
	build.MaxCopyBytes, build.MaxCopyEntries = 16<<20, 1000
	e := newEnv(t)
	tpl, _ := e.requestBuild("capped")
	bomb := gzTar(t, "zeros", strings.Repeat("\x00", 64<<20)) // 64 MiB in about 64 KiB
	var many bytes.Buffer
	zw := gzip.NewWriter(&many)
	tw := tar.NewWriter(zw)
	for i := 0; i < 2000; i++ {
		tw.WriteHeader(&tar.Header{Name: fmt.Sprintf("d/f%d", i), Mode: 0o644, Typeflag: tar.TypeReg})
	}
	tw.Close()
	zw.Close()
	for i, body := range [][]byte{bomb, many.Bytes()} {
		hash := strings.Repeat(fmt.Sprint(i+2), 64)
		status, msg := e.putFiles(tpl, hash, body)
		if status != http.StatusBadRequest || !strings.Contains(msg, "limit") {
			t.Fatalf("archive %d (%d bytes): %d %s; want 400 naming the limit", i, len(body), status, msg)
		}
		if r := e.ctl("GET", "/templates/"+tpl+"/files/"+hash, ""); !strings.Contains(string(r.body), `"present":false`) {
			t.Fatalf("archive %d was stored: %s", i, r.body)
		}
	}
	if status, msg := e.putFiles(tpl, helloHash, gzTar(t, "hello.txt", "hello")); status != http.StatusOK {
		t.Fatalf("a small archive: %d %s", status, msg)
	}
}

// Two builds of one template at once: the second is refused while the first runs.
func TestTemplateBuildsOfOneNameAreSerialised(t *testing.T) {
	e := newEnv(t)
	procs := e.guest.procs
	_, b1 := e.requestBuild("busy")
	_, b2 := e.requestBuild("busy")
	if r := e.ctl("POST", "/v2/templates/busy/builds/"+b1, buildBody(`{"type":"RUN","args":["block here"]}`)); r.status != http.StatusAccepted {
		t.Fatalf("first: %d %s", r.status, r.body)
	}
	e.ctl("POST", "/v2/templates/busy/builds/"+b2, buildBody(`{"type":"RUN","args":["echo"]}`)).wantError(t, 409)
	e.ctl("POST", "/v2/templates/busy/builds/"+b1, buildBody(`{"type":"RUN","args":["echo"]}`)).wantError(t, 409)
	// Nor can the template be deleted under the build (which would put it back).
	e.ctl("DELETE", "/templates/busy", "").wantError(t, 409)
	close(procs.release)
	if bi := e.waitBuild("busy", b1); bi.Status != "ready" {
		t.Fatalf("first build: %s %+v", bi.Status, bi.Reason)
	}
	if r := e.ctl("DELETE", "/templates/busy", ""); r.status != http.StatusNoContent {
		t.Fatalf("delete after the build: %d %s", r.status, r.body)
	}
	e.ctl("GET", "/templates/aliases/busy", "").wantError(t, 404)
}

// Bad requests are refused before a build starts, in E2B's error shape.
func TestTemplateBuildValidation(t *testing.T) {
	e := newEnv(t)
	_, bid := e.requestBuild("val")
	for name, body := range map[string]string{
		"both sources":   `{"fromTemplate":"base","fromImage":"debian"}`,
		"no source":      `{"steps":[]}`,
		"unknown step":   `{"fromTemplate":"base","steps":[{"type":"ADD","args":["x","y"]}]}`,
		"copy no upload": `{"fromTemplate":"base","steps":[{"type":"COPY","args":["x","/y"],"filesHash":"` + strings.Repeat("2", 64) + `"}]}`,
		"odd env":        `{"fromTemplate":"base","steps":[{"type":"ENV","args":["A"]}]}`,
		"aws registry":   `{"fromImage":"x","fromImageRegistry":{"type":"aws"}}`,
	} {
		if r := e.ctl("POST", "/v2/templates/val/builds/"+bid, body); r.status != http.StatusBadRequest {
			t.Errorf("%s: %d %s", name, r.status, r.body)
		}
	}
	e.ctl("POST", "/v2/templates/val/builds/00000000-0000-4000-8000-000000000000", buildBody("")).wantError(t, 404)
	e.ctl("GET", "/templates/val/builds/"+bid+"x/status", "").wantError(t, 404)
	e.ctl("GET", "/templates/val/files/not-a-hash", "").wantError(t, 400)
	e.ctl("POST", "/v3/templates", `{"name":"Bad Name"}`).wantError(t, 400)
	r := e.ctl("GET", "/templates/val/builds/"+bid+"/status", "")
	var bi buildInfo
	r.json(t, &bi)
	if bi.Status != "waiting" {
		t.Fatalf("a requested build is waiting: %s", r.body)
	}
}

// A template's image that cannot be restored (CI saw one: gVisor panicked on every restore of
// it) is made again before the template is published: the build succeeds and its sandboxes
// start, instead of a ready template whose every create fails.
func TestTemplateImageThatDoesNotRestoreIsMadeAgain(t *testing.T) {
	e := newEnv(t)
	tplDir := datadir.Templates(e.fake.dataDir)
	var mu sync.Mutex
	checkpoints, poisoned := 0, false
	e.fake.rig.Driver.Image = func(op, dir string) error {
		if !strings.HasPrefix(dir, tplDir+string(os.PathSeparator)+"flaky") {
			return nil
		}
		mu.Lock()
		defer mu.Unlock()
		switch op {
		case "Checkpoint":
			checkpoints++
			poisoned = checkpoints == 1 // the first image made is bad
		case "Restore":
			if poisoned {
				return fmt.Errorf("fake: restore: panic: unexpected tcp state in processor: BOUND")
			}
		}
		return nil
	}
	tpl, bid := e.requestBuild("flaky")
	e.ctl("POST", "/v2/templates/flaky/builds/"+bid, buildBody(`{"type":"RUN","args":["echo fine"]}`))
	if bi := e.waitBuild(tpl, bid); bi.Status != "ready" {
		t.Fatalf("build %s: %+v\n%s", bi.Status, bi.Reason, bi.messages())
	}
	for i := 0; i < 2; i++ {
		if r := e.ctl("POST", "/sandboxes", `{"templateID":"flaky"}`); r.status != http.StatusCreated {
			t.Fatalf("create %d from the built template: %d %s", i, r.status, r.body)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if checkpoints != 2 {
		t.Fatalf("%d checkpoints of the template; want 2 (the bad image made again)", checkpoints)
	}
}
