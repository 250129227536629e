package envdclient_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/ember-sandbox/ember/api/gen/process"
	"github.com/ember-sandbox/ember/api/gen/process/processconnect"
	"github.com/ember-sandbox/ember/internal/envd"
	"github.com/ember-sandbox/ember/internal/envdclient"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// testUser is a throwaway account the in-process envd runs commands as (with root, as envd
// runs in a sandbox; a login shell of the host's root would read the host's profile).
var testUser string

func TestMain(m *testing.M) {
	code := func() int {
		if os.Geteuid() == 0 {
			name := fmt.Sprintf("envdc%d", os.Getpid())
			if out, err := exec.Command("useradd", "-m", "-s", "/bin/bash", name).CombinedOutput(); err != nil {
				fmt.Fprintf(os.Stderr, "useradd %s: %v: %s\n", name, err, out)
				return 1
			}
			defer exec.Command("userdel", "-r", "-f", name).Run()
			testUser = name
		}
		return m.Run()
	}()
	os.Exit(code)
}

// realEnvd serves an in-process envd (the one sandboxes run) on a loopback httptest server and
// returns its URL. Its processes run as testUser.
func realEnvd(t *testing.T, cfg envd.Config) string {
	t.Helper()
	testutil.RequireRoot(t)
	if cfg.DefaultUser == "" {
		cfg.DefaultUser = testUser
	}
	srv := envd.New(cfg)
	ts := httptest.NewServer(srv.Handler())
	t.Cleanup(func() {
		ts.Close()
		srv.Close()
	})
	return ts.URL
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return c
}

func TestHealth(t *testing.T) {
	url := realEnvd(t, envd.Config{AccessToken: "secret"})
	// /health needs no token.
	if err := envdclient.New(nil, url, "").Health(ctx(t)); err != nil {
		t.Fatal(err)
	}
	down := httptest.NewServer(http.NotFoundHandler())
	t.Cleanup(down.Close)
	var se *envdclient.StatusError
	if err := envdclient.New(nil, down.URL, "").Health(ctx(t)); !errors.As(err, &se) || se.Code != 404 || se.Op != "health" {
		t.Fatalf("health of a 404 server: %v", err)
	}
	down.Close()
	if err := envdclient.New(nil, down.URL, "").Health(ctx(t)); err == nil || errors.As(err, &se) {
		t.Fatalf("health of a closed server: %v", err)
	}
}

// Init gives envd its identity: the new token is required afterwards, the env vars, user and
// workdir are every process's defaults.
func TestInitSetsIdentity(t *testing.T) {
	url := realEnvd(t, envd.Config{AccessToken: "template"})
	err := envdclient.New(nil, url, "template").Init(ctx(t), envdclient.InitRequest{
		EnvVars:        map[string]string{"FOO": "bar"},
		AccessToken:    "sandbox",
		DefaultUser:    testUser,
		DefaultWorkdir: "/tmp",
		Timestamp:      time.Now().UTC(),
	})
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	res, err := envdclient.New(nil, url, "sandbox").Run(ctx(t), envdclient.Command{Line: `echo "$FOO $(pwd) $(id -un)"`}, envdclient.Collect(&out))
	if err != nil || res.ExitCode != 0 || out.String() != "bar /tmp "+testUser+"\n" {
		t.Fatalf("after init: %+v %v %q", res, err, out.String())
	}
	if _, err := envdclient.New(nil, url, "template").Run(ctx(t), envdclient.Command{Line: "true"}, envdclient.Output{}); connect.CodeOf(err) != connect.CodeUnauthenticated {
		t.Fatalf("the old token still works: %v", err)
	}
}

// A refused /init is a StatusError with envd's answer, and changes nothing.
func TestInitRefused(t *testing.T) {
	url := realEnvd(t, envd.Config{AccessToken: "template"})
	err := envdclient.New(nil, url, "wrong").Init(ctx(t), envdclient.InitRequest{AccessToken: "sandbox", DefaultUser: testUser})
	var se *envdclient.StatusError
	if !errors.As(err, &se) || se.Op != "init" || se.Code != http.StatusUnauthorized {
		t.Fatalf("init with a wrong token: %v", err)
	}
	if err := envdclient.New(nil, url, "template").Init(ctx(t), envdclient.InitRequest{AccessToken: "sandbox", DefaultUser: testUser}); err != nil {
		t.Fatalf("init with the right token after a refused one: %v", err)
	}
}

// Run streams stdout and stderr apart, as they come, and returns the exit code.
func TestRunStreamsOutputAndExitCode(t *testing.T) {
	url := realEnvd(t, envd.Config{})
	var stdout, stderr strings.Builder
	first := make(chan string, 1)
	out := envdclient.Output{
		Stdout: func(b []byte) {
			if stdout.Len() == 0 {
				first <- string(b)
			}
			stdout.Write(b)
		},
		Stderr: func(b []byte) { stderr.Write(b) },
	}
	// The second line is only written once the first arrived: output is streamed, not buffered
	// until the end.
	done := make(chan struct{})
	go func() {
		defer close(done)
		select {
		case <-first:
		case <-time.After(20 * time.Second):
		}
	}()
	cwd := publicDir(t)
	res, err := envdclient.New(nil, url, "").Run(ctx(t), envdclient.Command{
		Line: `echo one; while [ ! -e "$MARK" ]; do sleep 0.05; done; echo two; echo "oops in $(pwd)" >&2; exit 7`,
		Cwd:  cwd, Envs: map[string]string{"MARK": markAfter(t, done)},
	}, out)
	if err != nil {
		t.Fatal(err)
	}
	if res.ExitCode != 7 || res.Pid == 0 || stdout.String() != "one\ntwo\n" || stderr.String() != "oops in "+cwd+"\n" {
		t.Fatalf("got %+v stdout %q stderr %q", res, stdout.String(), stderr.String())
	}
}

// publicDir returns a new directory the test user can enter.
func publicDir(t *testing.T) string {
	d, err := os.MkdirTemp("", "envdclient")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	if err := os.Chmod(d, 0o755); err != nil {
		t.Fatal(err)
	}
	return d
}

// markAfter returns a file path that is created once done is closed.
func markAfter(t *testing.T, done <-chan struct{}) string {
	p := publicDir(t) + "/mark"
	go func() {
		<-done
		_ = os.WriteFile(p, nil, 0o644)
	}()
	return p
}

// A started process keeps running when its stream is closed; a pty process takes input.
func TestStartCloseAndPtyInput(t *testing.T) {
	url := realEnvd(t, envd.Config{})
	c := envdclient.New(nil, url, "")
	p, err := c.Start(ctx(t), envdclient.Command{Line: "sleep 30", Tag: "sleeper"})
	if err != nil || p.Pid == 0 {
		t.Fatalf("start: %v", err)
	}
	p.Close()
	list, err := c.Processes().List(ctx(t), connect.NewRequest(&process.ListRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, pi := range list.Msg.GetProcesses() {
		found = found || (pi.GetPid() == p.Pid && pi.GetTag() == "sleeper")
	}
	if !found {
		t.Fatalf("pid %d not listed after its stream closed: %v", p.Pid, list.Msg.GetProcesses())
	}

	sh, err := c.Start(ctx(t), envdclient.Command{Line: "read x; echo got-$x", Pty: &envdclient.PtySize{Cols: 80, Rows: 24}})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Resize(ctx(t), sh.Pid, envdclient.PtySize{Cols: 100, Rows: 30}); err != nil {
		t.Fatal(err)
	}
	if err := c.SendInput(ctx(t), sh.Pid, true, []byte("hi\n")); err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	res, err := sh.Wait(envdclient.Collect(&out))
	if err != nil || res.ExitCode != 0 || !strings.Contains(out.String(), "got-hi") {
		t.Fatalf("pty: %+v %v %q", res, err, out.String())
	}
}

// stub answers Start with a scripted stream and records the request it got.
type stub struct {
	processconnect.UnimplementedProcessHandler
	end     bool
	gotArgs []string
	gotHdr  http.Header
}

func (s *stub) Start(ctx context.Context, req *connect.Request[process.StartRequest], st *connect.ServerStream[process.StartResponse]) error {
	s.gotArgs = append([]string{req.Msg.GetProcess().GetCmd()}, req.Msg.GetProcess().GetArgs()...)
	s.gotHdr = req.Header().Clone()
	ev := func(e *process.ProcessEvent) error { return st.Send(&process.StartResponse{Event: e}) }
	ev(&process.ProcessEvent{Event: &process.ProcessEvent_Start{Start: &process.ProcessEvent_StartEvent{Pid: 42}}})
	ev(&process.ProcessEvent{Event: &process.ProcessEvent_Data{Data: &process.ProcessEvent_DataEvent{Output: &process.ProcessEvent_DataEvent_Stdout{Stdout: []byte("out ")}}}})
	ev(&process.ProcessEvent{Event: &process.ProcessEvent_Data{Data: &process.ProcessEvent_DataEvent{Output: &process.ProcessEvent_DataEvent_Stderr{Stderr: []byte("err")}}}})
	if s.end {
		ev(&process.ProcessEvent{Event: &process.ProcessEvent_End{End: &process.ProcessEvent_EndEvent{ExitCode: 3, Exited: true}}})
	}
	return nil
}

func stubClient(t *testing.T, s *stub, token string) *envdclient.Client {
	mux := http.NewServeMux()
	mux.Handle(processconnect.NewProcessHandler(s))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return envdclient.New(srv.Client(), srv.URL, token)
}

func TestRunSendsCommandAndHeaders(t *testing.T) {
	s := &stub{end: true}
	var out strings.Builder
	res, err := stubClient(t, s, "tok").Run(context.Background(), envdclient.Command{Line: "echo hi", User: "root"}, envdclient.Collect(&out))
	if err != nil {
		t.Fatal(err)
	}
	if res.Pid != 42 || res.ExitCode != 3 || out.String() != "out err" {
		t.Fatalf("got %+v %q", res, out.String())
	}
	if strings.Join(s.gotArgs, " ") != "/bin/bash -l -c echo hi" {
		t.Fatalf("args %v", s.gotArgs)
	}
	if s.gotHdr.Get("X-Access-Token") != "tok" || s.gotHdr.Get("Authorization") != "Basic cm9vdDo=" {
		t.Fatalf("headers %v", s.gotHdr)
	}
}

func TestRunStreamWithoutEnd(t *testing.T) {
	res, err := stubClient(t, &stub{}, "").Run(context.Background(), envdclient.Command{Line: "x"}, envdclient.Output{})
	if !errors.Is(err, envdclient.ErrNoEnd) || res.ExitCode != -1 || res.Pid != 42 {
		t.Fatalf("got %+v %v", res, err)
	}
}

// Argv runs a program as it is (the CLI's interactive shell) and KeepAlive asks envd for
// keepalive events, which Wait passes over.
func TestStartArgvAndKeepAlive(t *testing.T) {
	s := &stub{end: true}
	res, err := stubClient(t, s, "").Run(context.Background(),
		envdclient.Command{Argv: []string{"/bin/bash", "-i", "-l"}, KeepAlive: 50 * time.Second}, envdclient.Output{})
	if err != nil || res.ExitCode != 3 {
		t.Fatalf("got %+v %v", res, err)
	}
	if strings.Join(s.gotArgs, " ") != "/bin/bash -i -l" {
		t.Fatalf("args %v", s.gotArgs)
	}
	if got := s.gotHdr.Get("Keepalive-Ping-Interval"); got != "50" {
		t.Fatalf("Keepalive-Ping-Interval %q, want 50", got)
	}

	url := realEnvd(t, envd.Config{})
	c := envdclient.New(nil, url, "")
	sh, err := c.Start(ctx(t), envdclient.Command{Argv: []string{"/bin/sh", "-c", "read x; sleep 1.5; echo argv-$x"},
		Pty: &envdclient.PtySize{Cols: 80, Rows: 24}, KeepAlive: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.SendInput(ctx(t), sh.Pid, true, []byte("hi\n")); err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	res, err = sh.Wait(envdclient.Collect(&out))
	if err != nil || res.ExitCode != 0 || !strings.Contains(out.String(), "argv-hi") {
		t.Fatalf("argv on a pty: %+v %v %q", res, err, out.String())
	}
}
