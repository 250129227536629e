// Package e2e tests ember end to end: the real `ember serve` binary as a subprocess (real runsc,
// real network namespaces, the real base template built by debootstrap), driven through its
// HTTP API, the envd protocol and the CLI, as a user would.
package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/ember-sandbox/ember/api/gen/process"
	"github.com/ember-sandbox/ember/internal/envdclient"
	"github.com/ember-sandbox/ember/internal/testutil"
	testnode "github.com/ember-sandbox/ember/internal/testutil/node"
)

// daemon is one `ember serve` process on a data directory, with a node id and CIDR of its own
// (every node-local name derives from the node id, so tests never touch another daemon's
// netns, veths, nftables table or cgroups).
type daemon struct {
	bin, envd, runsc, dataDir, addr, key string
	nodeID, cidr                         string
	flags                                []string // extra `ember serve` flags
	env                                  []string // extra environment of the next start (NAME=value)
	cmd                                  *exec.Cmd
	done                                 chan struct{} // closed when cmd has exited
	exitErr                              error         // cmd's, once done is closed
	started                              bool          // came up once (templates built)
	log                                  *bytes.Buffer
	logMu                                sync.Mutex
}

// daemonOpts configures a daemon a test starts for itself (newDaemonWith).
type daemonOpts struct {
	// NodeID: "c" then up to 5 letters or digits; CIDR: inside 10.220.0.0/14. Both default to
	// a fresh pair from nextNode.
	NodeID, CIDR string
	// DataDir defaults to <buildDir>/<NodeID>; a data dir keeps its node id and CIDR for life.
	DataDir string
	// Flags are extra `ember serve` flags (e.g. "--pool-size", "0"); none = the defaults.
	Flags []string
}

var (
	shared     *daemon
	sharedErr  error
	sharedOnce sync.Once
	buildDir   string

	nodeMu   sync.Mutex
	nodeNext = 10 // c0..c9 are named by tests; automatic ones start at c10
	daemons  []*daemon
)

// nextNode returns an unused node id and a /20 of 10.220.0.0/14 for it.
func nextNode() (string, string) {
	nodeMu.Lock()
	defer nodeMu.Unlock()
	n := nodeNext
	nodeNext++
	return fmt.Sprintf("c%d", n), nodeCIDR(n)
}

// nodeCIDR is node n's slot network: 10.220.0.0/20 for c0, 10.220.16.0/20 for c1, ...
func nodeCIDR(n int) string {
	off := n * 16
	return fmt.Sprintf("10.%d.%d.0/20", 220+off/256, off%256)
}

func TestMain(m *testing.M) {
	// EMBER_E2E_DIR keeps data dirs (and their built templates) between runs; by default
	// everything lives in a temp dir removed at the end.
	dir, keep := os.Getenv("EMBER_E2E_DIR"), true
	if dir == "" {
		var err error
		if dir, err = os.MkdirTemp("", "ember-e2e-"); err != nil {
			panic(err)
		}
		keep = false
	} else if err := os.MkdirAll(dir, 0o755); err != nil {
		panic(err)
	}
	buildDir = dir
	code := m.Run()
	nodeMu.Lock()
	all := append([]*daemon(nil), daemons...)
	nodeMu.Unlock()
	clean := true
	for _, d := range all {
		d.stop()
		if left := d.purge(); len(left) > 0 {
			fmt.Fprintf(os.Stderr, "e2e: node %s: could not remove %v\n", d.nodeID, left)
			clean = false
		}
	}
	if clean && !keep {
		os.RemoveAll(dir)
	}
	os.Exit(code)
}

// need returns the shared daemon (base template built), starting it on first use. It runs
// with ember's default configuration (warm pool and slot pool on) as node c0.
func need(t *testing.T) *daemon {
	t.Helper()
	testutil.RequireRoot(t)
	runsc := testutil.Runsc(t)
	sharedOnce.Do(func() {
		var d *daemon
		d, sharedErr = newDaemonOpts(runsc, daemonOpts{NodeID: "c0", CIDR: nodeCIDR(0), DataDir: filepath.Join(buildDir, "data")})
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

// newDaemonWith starts a daemon of the test's own (node id, CIDR, data dir, flags) and stops
// and cleans it up (processes, netns, veths, nftables table, mounts, cgroups) when t ends.
// The first start on a fresh data dir builds the base template (about a minute).
func newDaemonWith(t *testing.T, o daemonOpts) *daemon {
	t.Helper()
	d := ownDaemon(t, o)
	if err := d.start(); err != nil {
		t.Fatalf("starting ember (node %s): %v\n%s", d.nodeID, err, d.logs())
	}
	return d
}

// ownDaemon is newDaemonWith without the start.
func ownDaemon(t *testing.T, o daemonOpts) *daemon {
	t.Helper()
	testutil.RequireRoot(t)
	runsc := testutil.Runsc(t)
	d, err := newDaemonOpts(runsc, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		d.stop()
		if left := d.purge(); len(left) > 0 {
			t.Errorf("node %s: could not clean up %v", d.nodeID, left)
		}
	})
	return d
}

func newDaemonOpts(runsc string, o daemonOpts) (*daemon, error) {
	if o.NodeID == "" || o.CIDR == "" {
		id, cidr := nextNode()
		if o.NodeID == "" {
			o.NodeID = id
		}
		if o.CIDR == "" {
			o.CIDR = cidr
		}
	}
	// Automatic ids too: concurrent runs with different prefixes never share a node id or CIDR.
	o.NodeID, o.CIDR = isolate(o.NodeID, o.CIDR)
	if o.DataDir == "" {
		o.DataDir = filepath.Join(buildDir, o.NodeID)
	}
	buildMu.Lock()
	defer buildMu.Unlock()
	if !built {
		bins, err := testnode.Build(buildDir, true)
		if err != nil {
			return nil, err
		}
		builtBins, built = bins, true
	}
	bin, envd := builtBins.Ember, builtBins.Envd
	d := &daemon{bin: bin, envd: envd, runsc: runsc, dataDir: o.DataDir, nodeID: o.NodeID, cidr: o.CIDR,
		flags: o.Flags, log: &bytes.Buffer{}}
	nodeMu.Lock()
	daemons = append(daemons, d)
	nodeMu.Unlock()
	return d, nil
}

var (
	buildMu   sync.Mutex
	built     bool // the binaries are built once per test process
	builtBins testnode.Binaries
)

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

// allLogs is every line the daemon (all its runs) wrote.
func (d *daemon) allLogs() string {
	d.logMu.Lock()
	defer d.logMu.Unlock()
	return d.log.String()
}

func (d *daemon) logf(format string, args ...any) {
	d.logMu.Lock()
	defer d.logMu.Unlock()
	fmt.Fprintf(d.log, "=== e2e: "+format+"\n", args...)
}

// logLines returns the daemon's log lines that mention s (at most max, the last ones).
func (d *daemon) logLines(s string, max int) string {
	var out []string
	for _, l := range strings.Split(d.allLogs(), "\n") {
		if strings.Contains(l, s) {
			out = append(out, l)
		}
	}
	if len(out) > max {
		out = out[len(out)-max:]
	}
	return strings.Join(out, "\n")
}

// netPrefix is the daemon's netns and veth name prefix ("e" + node id + "x").
func (d *daemon) netPrefix() string { return "e" + d.nodeID + "x" }

// runscRoot is the daemon's runsc --root.
func (d *daemon) runscRoot() string { return filepath.Join(d.dataDir, "runsc") }

// running reports whether the daemon process is alive.
func (d *daemon) running() bool {
	if d.done == nil {
		return false
	}
	select {
	case <-d.done:
		return false
	default:
		return true
	}
}

// launch runs `ember serve` (start waits for it to be ready).
func (d *daemon) launch() error {
	if d.addr == "" {
		d.addr = freePort()
	}
	cache := testnode.CacheDir()
	args := []string{"serve", "--listen", d.addr, "--data-dir", d.dataDir, "--cache-dir", cache,
		"--runsc", d.runsc, "--envd", d.envd, "--templates", "base", "--verbose",
		"--node-id", d.nodeID, "--cidr", d.cidr,
		"--registry-allow", "127.0.0.1"} // the image tests' own registries, on loopback
	d.cmd = exec.Command(d.bin, append(args, d.flags...)...)
	d.cmd.Env = append(append(os.Environ(), d.env...), "EMBER_NODE_ID="+d.nodeID, "EMBER_CIDR="+d.cidr)
	d.cmd.Stdout = lockedWriter{d}
	d.cmd.Stderr = lockedWriter{d}
	d.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	d.logf("start %s", strings.Join(d.cmd.Args, " "))
	if err := d.cmd.Start(); err != nil {
		return err
	}
	done := make(chan struct{})
	d.done = done
	cmd := d.cmd
	go func() { d.exitErr = cmd.Wait(); close(done) }()
	return nil
}

// start runs `ember serve` and waits until its API answers and its start-up templates are
// built. A restart keeps the data dir, node id, CIDR and port.
func (d *daemon) start() error {
	if err := d.launch(); err != nil {
		return err
	}
	done := d.done
	bound := 15 * time.Minute // the first start on a data dir builds the base template
	if d.started {
		bound = 2 * time.Minute
	}
	deadline := time.Now().Add(bound)
	for time.Now().Before(deadline) {
		select {
		case <-done:
			return fmt.Errorf("ember serve exited: %v", d.exitErr)
		default:
		}
		// 200 once the start-up templates are built (503 while they build).
		if resp, err := httpClient.Get("http://" + d.addr + "/health"); err == nil && func() bool { resp.Body.Close(); return resp.StatusCode == http.StatusOK }() {
			key, err := os.ReadFile(filepath.Join(d.dataDir, "api-key"))
			if err != nil {
				return err
			}
			d.key = strings.TrimSpace(string(key))
			d.started = true
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	d.crash()
	return fmt.Errorf("ember serve did not come up within %s", bound)
}

// crash kills the daemon with SIGKILL (no cleanup at all) and waits until it is gone.
func (d *daemon) crash() {
	if !d.running() {
		return
	}
	d.logf("kill -9")
	d.cmd.Process.Kill()
	<-d.done
}

// stop sends SIGTERM and waits (bounded: 60 s, then SIGKILL). It reports whether the daemon
// exited by itself within the bound.
func (d *daemon) stop() bool {
	if !d.running() {
		return true
	}
	d.logf("SIGTERM")
	d.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-d.done:
		return true
	case <-time.After(60 * time.Second):
		d.logf("still running 60 s after SIGTERM: kill -9")
		d.cmd.Process.Kill()
		<-d.done
		return false
	}
}

// restart stops the daemon with sig (SIGKILL = crash, SIGTERM = graceful stop) and starts it
// again on the same data dir, node id, CIDR and port.
func (d *daemon) restart(t *testing.T, sig syscall.Signal) {
	t.Helper()
	if sig == syscall.SIGKILL {
		d.crash()
	} else if !d.stop() {
		t.Errorf("node %s: daemon did not stop within 60 s of SIGTERM", d.nodeID)
	}
	if err := d.start(); err != nil {
		t.Fatalf("restart node %s: %v\n%s", d.nodeID, err, d.logs())
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
	code, data, _ := d.as(t, d.key, method, path, in)
	if out != nil && code/100 == 2 && len(data) > 0 {
		if err := json.Unmarshal([]byte(data), out); err != nil {
			t.Fatalf("%s %s: decode %q: %v", method, path, data, err)
		}
	}
	if code/100 != 2 {
		t.Logf("%s %s -> %d %s", method, path, code, data)
	}
	return code, data
}

// as calls d's API with key: status, body and headers.
func (d *daemon) as(t *testing.T, key, method, path string, in any) (int, string, http.Header) {
	t.Helper()
	var body io.Reader
	if in != nil {
		b, _ := json.Marshal(in)
		body = bytes.NewReader(b)
	}
	req, _ := http.NewRequest(method, "http://"+d.addr+path, body)
	req.Header.Set("X-API-Key", key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(data), resp.Header
}

// call is api for goroutines and tests that expect failures: bounded by timeout, no t; err is a
// transport error (connection refused or reset, timeout).
func (d *daemon) call(timeout time.Duration, method, path string, in, out any) (int, string, error) {
	var body io.Reader
	if in != nil {
		b, _ := json.Marshal(in)
		body = bytes.NewReader(b)
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, "http://"+d.addr+path, body)
	if err != nil {
		return 0, "", err
	}
	req.Header.Set("X-API-Key", d.key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return resp.StatusCode, string(data), err
	}
	if out != nil && resp.StatusCode/100 == 2 && len(data) > 0 {
		if err := json.Unmarshal(data, out); err != nil {
			return resp.StatusCode, string(data), fmt.Errorf("decode %q: %w", data, err)
		}
	}
	return resp.StatusCode, string(data), nil
}

// listAll lists every running and paused sandbox.
func (d *daemon) listAll(t *testing.T) []sbx {
	t.Helper()
	var l []sbx
	if code, body, err := d.call(30*time.Second, "GET", "/v2/sandboxes?state=running,paused&limit=100", nil, &l); err != nil || code != 200 {
		t.Fatalf("list sandboxes: %d %s %v", code, body, err)
	}
	return l
}

type sbx struct {
	SandboxID       string `json:"sandboxID"`
	TemplateID      string `json:"templateID"`
	EnvdAccessToken string `json:"envdAccessToken"`
	State           string `json:"state"`
	PausedIn        string `json:"pausedIn"`
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
	r.Header.Set("E2b-Sandbox-Port", strconv.Itoa(envdclient.Port))
	r.Header.Set("X-Access-Token", h.token)
	return http.DefaultTransport.RoundTrip(r)
}

// envdClient is a client of s's envd through the daemon's sandbox plane.
func (d *daemon) envdClient(s sbx) *envdclient.Client {
	hc := &http.Client{Transport: sandboxHeaders{s.SandboxID, s.EnvdAccessToken}}
	return envdclient.New(hc, "http://"+d.addr, "")
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
	return d.runCtx(ctx, s, cmdline, user)
}

// runFor is tryRun (as the default user) bounded by timeout.
func (d *daemon) runFor(timeout time.Duration, s sbx, cmdline string) (result, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return d.runCtx(ctx, s, cmdline, "")
}

// runCtx runs a bash command line in the sandbox through envd, bounded by ctx. A stream that
// ends without the process's end gives exit code -999 and no error.
func (d *daemon) runCtx(ctx context.Context, s sbx, cmdline, user string) (result, error) {
	var out, errb strings.Builder
	res, err := d.envdClient(s).Run(ctx, envdclient.Command{Line: cmdline, User: user},
		envdclient.Output{Stdout: func(b []byte) { out.Write(b) }, Stderr: func(b []byte) { errb.Write(b) }})
	r := result{stdout: out.String(), stderr: errb.String(), exitCode: res.ExitCode, pid: res.Pid}
	if errors.Is(err, envdclient.ErrNoEnd) {
		r.exitCode, err = -999, nil
	}
	return r, err
}

// background starts a long-running command and returns its pid without waiting.
func (d *daemon) background(t *testing.T, s sbx, cmdline string) uint32 {
	t.Helper()
	p, err := d.envdClient(s).Start(context.Background(), envdclient.Command{Line: cmdline})
	if err != nil {
		t.Fatalf("start %q: %v", cmdline, err)
	}
	p.Close() // disconnecting does not kill the process
	return p.Pid
}

func (d *daemon) listPids(t *testing.T, s sbx) map[uint32]string {
	t.Helper()
	resp, err := d.envdClient(s).Processes().List(context.Background(), connect.NewRequest(&process.ListRequest{}))
	if err != nil {
		t.Fatalf("list processes: %v", err)
	}
	out := map[uint32]string{}
	for _, p := range resp.Msg.GetProcesses() {
		out[p.GetPid()] = strings.Join(p.GetConfig().GetArgs(), " ")
	}
	return out
}

var httpClient = &http.Client{Timeout: 10 * time.Second}

func newRequest(method, url string) (*http.Request, error) { return http.NewRequest(method, url, nil) }

// isolate lets two e2e runs share one host (developers' worktrees): EMBER_E2E_NODE_PREFIX
// (one letter or digit pair, e.g. "h3") is put in front of every node id, and
// EMBER_E2E_NET_OFFSET (0..31) is added to the second octet of every CIDR. Unset, nothing
// changes.
func isolate(id, cidr string) (string, string) {
	if p := os.Getenv("EMBER_E2E_NODE_PREFIX"); p != "" && id != "" {
		id = p + id
		if len(id) > 6 {
			id = id[:6]
		}
	}
	if off, _ := strconv.Atoi(os.Getenv("EMBER_E2E_NET_OFFSET")); off > 0 && cidr != "" {
		var a, b, c, d, bits int
		if n, _ := fmt.Sscanf(cidr, "%d.%d.%d.%d/%d", &a, &b, &c, &d, &bits); n == 5 {
			cidr = fmt.Sprintf("%d.%d.%d.%d/%d", a, (b+off)%256, c, d, bits)
		}
	}
	return id, cidr
}
