// Package e2e tests ember end to end: the real `ember serve` binary as a subprocess (real runsc,
// real network namespaces, the real base template built by debootstrap), driven through its
// HTTP API, the envd protocol and the CLI, as a user would.
package e2e

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/ember-sandbox/ember/api/gen/process"
	"github.com/ember-sandbox/ember/api/gen/process/processconnect"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// daemon is one `ember serve` process on a data directory.
type daemon struct {
	bin, envd, runsc, dataDir, addr, key string
	cmd                                  *exec.Cmd
	log                                  *bytes.Buffer
	logMu                                sync.Mutex
}

var (
	shared     *daemon
	sharedErr  error
	sharedOnce sync.Once
	buildDir   string
)

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "ember-e2e-")
	if err != nil {
		panic(err)
	}
	buildDir = dir
	code := m.Run()
	if shared != nil {
		shared.stop()
		exec.Command("umount", filepath.Join(shared.dataDir, "runsc", "null-netns")).Run()
	}
	os.RemoveAll(dir)
	os.Exit(code)
}

// need returns the shared daemon (base template built), starting it on first use.
func need(t *testing.T) *daemon {
	t.Helper()
	testutil.RequireRoot(t)
	runsc := testutil.Runsc(t)
	sharedOnce.Do(func() {
		var d *daemon
		d, sharedErr = newDaemon(runsc, filepath.Join(buildDir, "data"))
		if sharedErr == nil {
			sharedErr = d.start()
		}
		shared = d
	})
	if sharedErr != nil {
		t.Fatalf("starting ember: %v\n%s", sharedErr, shared.logs())
	}
	return shared
}

func newDaemon(runsc, dataDir string) (*daemon, error) {
	root := testutil.RepoRoot()
	bin := filepath.Join(buildDir, "ember")
	envd := filepath.Join(buildDir, "envd")
	if _, err := os.Stat(bin); err != nil {
		for _, b := range []struct {
			out, pkg string
			env      []string
		}{{bin, "./cmd/ember", nil}, {envd, "./cmd/envd", []string{"CGO_ENABLED=0"}}} {
			cmd := exec.Command("go", "build", "-o", b.out, b.pkg)
			cmd.Dir = root
			cmd.Env = append(os.Environ(), b.env...)
			if out, err := cmd.CombinedOutput(); err != nil {
				return nil, fmt.Errorf("go build %s: %v\n%s", b.pkg, err, out)
			}
		}
	}
	return &daemon{bin: bin, envd: envd, runsc: runsc, dataDir: dataDir, log: &bytes.Buffer{}}, nil
}

func freePort() string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	defer l.Close()
	return l.Addr().String()
}

type lockedWriter struct{ d *daemon }

func (w lockedWriter) Write(p []byte) (int, error) {
	w.d.logMu.Lock()
	defer w.d.logMu.Unlock()
	return w.d.log.Write(p)
}

func (d *daemon) logs() string {
	if d == nil {
		return ""
	}
	d.logMu.Lock()
	defer d.logMu.Unlock()
	s := d.log.String()
	if len(s) > 8000 {
		s = "...\n" + s[len(s)-8000:]
	}
	return s
}

// start runs `ember serve` and waits until its API answers.
func (d *daemon) start() error {
	if d.addr == "" {
		d.addr = freePort()
	}
	cache := os.Getenv("EMBER_CACHE_DIR")
	if cache == "" {
		cache = filepath.Join(testutil.RepoRoot(), ".cache")
	}
	d.cmd = exec.Command(d.bin, "serve", "--listen", d.addr, "--data-dir", d.dataDir, "--cache-dir", cache,
		"--runsc", d.runsc, "--envd", d.envd, "--templates", "base", "--pool-size", "0", "--slot-pool-size", "0", "--verbose")
	d.cmd.Stdout = lockedWriter{d}
	d.cmd.Stderr = lockedWriter{d}
	d.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := d.cmd.Start(); err != nil {
		return err
	}
	exited := make(chan error, 1)
	go func() { exited <- d.cmd.Wait() }()
	deadline := time.Now().Add(15 * time.Minute) // first start builds the base template
	for time.Now().Before(deadline) {
		select {
		case err := <-exited:
			return fmt.Errorf("ember serve exited: %v", err)
		default:
		}
		if resp, err := http.Get("http://" + d.addr + "/health"); err == nil {
			resp.Body.Close()
			key, err := os.ReadFile(filepath.Join(d.dataDir, "api-key"))
			if err != nil {
				return err
			}
			d.key = strings.TrimSpace(string(key))
			go func() { <-exited }()
			return nil
		}
		time.Sleep(200 * time.Millisecond)
	}
	return fmt.Errorf("ember serve did not come up")
}

// crash kills the daemon with SIGKILL (no cleanup at all).
func (d *daemon) crash() {
	d.cmd.Process.Kill()
	time.Sleep(200 * time.Millisecond)
}

func (d *daemon) stop() {
	if d.cmd == nil || d.cmd.Process == nil {
		return
	}
	d.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { d.cmd.Process.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(15 * time.Second):
		d.cmd.Process.Kill()
	}
}

// api calls the control plane and decodes the JSON answer into out; returns the status.
func (d *daemon) api(t *testing.T, method, path string, in, out any) int {
	t.Helper()
	code, _ := d.apiBody(t, method, path, in, out)
	return code
}

// apiBody is api that also returns the raw response body.
func (d *daemon) apiBody(t *testing.T, method, path string, in, out any) (int, string) {
	t.Helper()
	var body io.Reader
	if in != nil {
		b, _ := json.Marshal(in)
		body = bytes.NewReader(b)
	}
	req, _ := http.NewRequest(method, "http://"+d.addr+path, body)
	req.Header.Set("X-API-Key", d.key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	if out != nil && resp.StatusCode/100 == 2 && len(data) > 0 {
		if err := json.Unmarshal(data, out); err != nil {
			t.Fatalf("%s %s: decode %q: %v", method, path, data, err)
		}
	}
	if resp.StatusCode/100 != 2 {
		t.Logf("%s %s -> %d %s", method, path, resp.StatusCode, data)
	}
	return resp.StatusCode, string(data)
}

type sbx struct {
	SandboxID       string `json:"sandboxID"`
	TemplateID      string `json:"templateID"`
	EnvdAccessToken string `json:"envdAccessToken"`
	State           string `json:"state"`
}

// create makes a sandbox and registers its kill in t.Cleanup.
func (d *daemon) create(t *testing.T, body map[string]any) sbx {
	t.Helper()
	if body == nil {
		body = map[string]any{}
	}
	if body["templateID"] == nil {
		body["templateID"] = "base"
	}
	var s sbx
	if code := d.api(t, "POST", "/v2/sandboxes", body, &s); code != 201 {
		t.Fatalf("create: status %d\n%s", code, d.logs())
	}
	t.Cleanup(func() { d.api(t, "DELETE", "/sandboxes/"+s.SandboxID, nil, nil) })
	return s
}

type result struct {
	stdout, stderr string
	exitCode       int
	pid            uint32
}

type sandboxHeaders struct {
	id, token string
}

func (h sandboxHeaders) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("E2b-Sandbox-Id", h.id)
	r.Header.Set("E2b-Sandbox-Port", "49983")
	r.Header.Set("X-Access-Token", h.token)
	return http.DefaultTransport.RoundTrip(r)
}

func (d *daemon) processClient(s sbx) processconnect.ProcessClient {
	hc := &http.Client{Transport: sandboxHeaders{s.SandboxID, s.EnvdAccessToken}}
	return processconnect.NewProcessClient(hc, "http://"+d.addr)
}

// run runs a bash command line in the sandbox through envd (as E2B's commands.run does).
func (d *daemon) run(t *testing.T, s sbx, cmdline string) result {
	t.Helper()
	r, err := d.tryRun(s, cmdline, "")
	if err != nil {
		t.Fatalf("run %q in %s: %v", cmdline, s.SandboxID, err)
	}
	return r
}

func (d *daemon) tryRun(s sbx, cmdline, user string) (result, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	no := false
	req := connect.NewRequest(&process.StartRequest{
		Process: &process.ProcessConfig{Cmd: "/bin/bash", Args: []string{"-l", "-c", cmdline}},
		Stdin:   &no,
	})
	if user != "" {
		req.Header().Set("Authorization", "Basic "+basic(user))
	}
	stream, err := d.processClient(s).Start(ctx, req)
	if err != nil {
		return result{}, err
	}
	defer stream.Close()
	var r result
	var out, errb strings.Builder
	r.exitCode = -999
	for stream.Receive() {
		ev := stream.Msg().GetEvent()
		switch {
		case ev.GetStart() != nil:
			r.pid = ev.GetStart().GetPid()
		case ev.GetData() != nil:
			out.Write(ev.GetData().GetStdout())
			errb.Write(ev.GetData().GetStderr())
		case ev.GetEnd() != nil:
			r.exitCode = int(ev.GetEnd().GetExitCode())
		}
	}
	r.stdout, r.stderr = out.String(), errb.String()
	if err := stream.Err(); err != nil {
		return r, err
	}
	return r, nil
}

// background starts a long-running command and returns its pid without waiting.
func (d *daemon) background(t *testing.T, s sbx, cmdline string) uint32 {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	no := false
	stream, err := d.processClient(s).Start(ctx, connect.NewRequest(&process.StartRequest{
		Process: &process.ProcessConfig{Cmd: "/bin/bash", Args: []string{"-l", "-c", cmdline}},
		Stdin:   &no,
	}))
	if err != nil {
		cancel()
		t.Fatalf("start %q: %v", cmdline, err)
	}
	if !stream.Receive() || stream.Msg().GetEvent().GetStart() == nil {
		cancel()
		t.Fatalf("start %q: no start event: %v", cmdline, stream.Err())
	}
	pid := stream.Msg().GetEvent().GetStart().GetPid()
	cancel() // disconnecting does not kill the process
	return pid
}

func (d *daemon) listPids(t *testing.T, s sbx) map[uint32]string {
	t.Helper()
	resp, err := d.processClient(s).List(context.Background(), connect.NewRequest(&process.ListRequest{}))
	if err != nil {
		t.Fatalf("list processes: %v", err)
	}
	out := map[uint32]string{}
	for _, p := range resp.Msg.GetProcesses() {
		out[p.GetPid()] = strings.Join(p.GetConfig().GetArgs(), " ")
	}
	return out
}

func basic(user string) string { return base64.StdEncoding.EncodeToString([]byte(user + ":")) }

var httpClient = &http.Client{Timeout: 10 * time.Second}

func newRequest(method, url string) (*http.Request, error) { return http.NewRequest(method, url, nil) }
