// Package envdclient is the host side of envd's protocol, shared by everything in ember that
// talks to envd from outside a sandbox: the sandbox Manager (health, /init, template start and
// ready commands, build steps, pool warm-up), the CLI's `sandbox exec` and `sandbox shell`, the end-to-end tests and
// the benchmarks. It owns envd's port, the /init body, and the consumption of a process Start
// stream, and knows nothing of how the caller reaches envd (directly at a slot's address, or
// through the daemon's sandbox plane): that is the http.Client it is given.
package envdclient

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"

	"github.com/ember-sandbox/ember/api/gen/process"
	"github.com/ember-sandbox/ember/api/gen/process/processconnect"
)

// Port is where envd listens inside every sandbox, its one definition: envd's own default
// (cmd/envd), the network, the Manager, the API's sandbox plane, the CLI and the tests use it.
const Port = 49983

// Client talks to one envd. Create it with New; it is cheap (one per call is fine).
type Client struct {
	hc    *http.Client
	base  string
	token string
	proc  processconnect.ProcessClient
}

// New returns a client of the envd at base ("http://host:port"; with a routing transport, the
// daemon's URL) reached through hc. token, when set, is sent as X-Access-Token on every request.
func New(hc *http.Client, base, token string) *Client {
	if hc == nil {
		hc = http.DefaultClient
	}
	base = strings.TrimSuffix(base, "/")
	return &Client{hc: hc, base: base, token: token, proc: processconnect.NewProcessClient(hc, base)}
}

// Processes is the generated process service client, for the calls this package does not wrap
// (List, SendSignal, Connect). It does not add the access token: set X-Access-Token yourself, or
// reach envd through a transport that does.
func (c *Client) Processes() processconnect.ProcessClient { return c.proc }

// StatusError is a non-2xx answer to one of envd's plain HTTP calls.
type StatusError struct {
	Op   string // "health", "init"
	Code int
	Body string // its first bytes
}

func (e *StatusError) Error() string {
	if e.Body == "" {
		return fmt.Sprintf("envd %s: status %d", e.Op, e.Code)
	}
	return fmt.Sprintf("envd %s: status %d: %s", e.Op, e.Code, e.Body)
}

// Health asks envd's GET /health once. nil means envd answered 2xx.
func (c *Client) Health(ctx context.Context) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.base+"/health", nil)
	if err != nil {
		return err
	}
	return c.do(req, "health")
}

// InitRequest is the body of envd's POST /init: the identity a sandbox gets when it is created,
// restored or forked. Every field is sent (an empty DefaultWorkdir means the user's home).
type InitRequest struct {
	EnvVars        map[string]string `json:"envVars"`
	AccessToken    string            `json:"accessToken"`
	DefaultUser    string            `json:"defaultUser"`
	DefaultWorkdir string            `json:"defaultWorkdir"`
	Hostname       string            `json:"hostname"`
	Timestamp      time.Time         `json:"timestamp"`
}

// Init sends POST /init once, authenticated with the client's token (the one envd holds now,
// if any). A transport error is returned wrapped (errors.As finds the transport's own error);
// a refusal is a *StatusError.
func (c *Client) Init(ctx context.Context, body InitRequest) error { return c.postInit(ctx, body) }

// SetEnvVars merges env into envd's default environment (POST /init with nothing else: the
// token, user and workdir stay as they are).
func (c *Client) SetEnvVars(ctx context.Context, env map[string]string) error {
	return c.postInit(ctx, map[string]any{"envVars": env})
}

func (c *Client) postInit(ctx context.Context, body any) error {
	b, err := json.Marshal(body)
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.base+"/init", bytes.NewReader(b))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	return c.do(req, "init")
}

func (c *Client) do(req *http.Request, op string) error {
	if c.token != "" {
		req.Header.Set("X-Access-Token", c.token)
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return fmt.Errorf("envd %s: %w", op, err)
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode/100 != 2 {
		return &StatusError{Op: op, Code: resp.StatusCode, Body: strings.TrimSpace(string(msg))}
	}
	return nil
}

// Command is one process to start through envd.
type Command struct {
	// Line is a bash command line, run as `bash -l -c Line` (as E2B's commands.run does).
	Line string
	// Argv, when set, is the program and its arguments, run as they are instead of Line.
	Argv []string
	User string // "" = envd's default user
	Cwd  string
	Envs map[string]string
	// Tag names the process for envd's selectors ("" = none).
	Tag string
	// Pty, when set, runs the process on a terminal of that size: its output arrives as stdout,
	// its input goes through SendInput, and Resize changes the size.
	Pty *PtySize
	// Stdin keeps the process's stdin open for SendInput (a Pty always has input).
	Stdin bool
	// KeepAlive, when set, asks envd to send an event at least that often while the process is
	// quiet, so that proxies keep an idle stream (an interactive shell's) open.
	KeepAlive time.Duration
}

// PtySize is a terminal's size.
type PtySize struct{ Cols, Rows uint32 }

// Output receives the process's output as it arrives.
type Output struct {
	Stdout, Stderr func([]byte)
}

// Collect returns an Output that appends both streams to b.
func Collect(b *strings.Builder) Output {
	w := func(p []byte) { b.Write(p) }
	return Output{Stdout: w, Stderr: w}
}

// Result is how a process ended.
type Result struct {
	Pid      uint32
	ExitCode int    // -1 when it did not end
	Status   string // envd's end status, e.g. "exit status 1", "signal: killed"
}

// ErrNoEnd: the stream ended without the process's end event.
var ErrNoEnd = errors.New("envd stream ended without a result")

// Process is a started process whose event stream the caller holds.
type Process struct {
	Pid    uint32
	stream *connect.ServerStreamForClient[process.StartResponse]
	cancel context.CancelFunc
}

// Start starts c and returns once envd reported its pid. The caller then either Waits for it or
// Closes the stream (the process keeps running: disconnecting does not stop it).
func (c *Client) Start(ctx context.Context, cmd Command) (*Process, error) {
	stdin := cmd.Stdin
	cfg := &process.ProcessConfig{Cmd: "/bin/bash", Args: []string{"-l", "-c", cmd.Line}, Envs: cmd.Envs}
	if len(cmd.Argv) > 0 {
		cfg.Cmd, cfg.Args = cmd.Argv[0], cmd.Argv[1:]
	}
	if cmd.Cwd != "" {
		cfg.Cwd = &cmd.Cwd
	}
	msg := &process.StartRequest{Process: cfg, Stdin: &stdin}
	if cmd.Tag != "" {
		msg.Tag = &cmd.Tag
	}
	if cmd.Pty != nil {
		msg.Pty = &process.PTY{Size: &process.PTY_Size{Cols: cmd.Pty.Cols, Rows: cmd.Pty.Rows}}
	}
	req := connect.NewRequest(msg)
	if cmd.User != "" {
		req.Header().Set("Authorization", "Basic "+basic(cmd.User))
	}
	if cmd.KeepAlive > 0 {
		req.Header().Set("Keepalive-Ping-Interval", strconv.Itoa(max(1, int(cmd.KeepAlive/time.Second))))
	}
	c.auth(req.Header())
	sctx, cancel := context.WithCancel(ctx)
	stream, err := c.proc.Start(sctx, req)
	if err != nil {
		cancel()
		return nil, err
	}
	p := &Process{stream: stream, cancel: cancel}
	if !stream.Receive() {
		err := stream.Err()
		p.Close()
		if err == nil {
			err = ErrNoEnd
		}
		return nil, err
	}
	st := stream.Msg().GetEvent().GetStart()
	if st == nil {
		p.Close()
		return nil, fmt.Errorf("envd start: first event is not the start")
	}
	p.Pid = st.GetPid()
	return p, nil
}

// Wait consumes the process's events, handing its output to out, until it ends, and closes the
// stream. A stream that ends without the end event is ErrNoEnd (the Result has ExitCode -1).
func (p *Process) Wait(out Output) (Result, error) {
	defer p.Close()
	res := Result{Pid: p.Pid, ExitCode: -1}
	for p.stream.Receive() {
		ev := p.stream.Msg().GetEvent()
		switch {
		case ev.GetData() != nil:
			d := ev.GetData()
			if out.Stdout != nil {
				if b := d.GetStdout(); len(b) > 0 {
					out.Stdout(b)
				}
				if b := d.GetPty(); len(b) > 0 {
					out.Stdout(b)
				}
			}
			if b := d.GetStderr(); len(b) > 0 && out.Stderr != nil {
				out.Stderr(b)
			}
		case ev.GetEnd() != nil:
			res.ExitCode = int(ev.GetEnd().GetExitCode())
			res.Status = ev.GetEnd().GetStatus()
			return res, nil
		}
	}
	if err := p.stream.Err(); err != nil {
		return res, err
	}
	return res, ErrNoEnd
}

// Close drops the event stream; the process keeps running.
func (p *Process) Close() {
	p.cancel()
	p.stream.Close()
}

// Run starts c, streams its output to out and returns how it ended.
func (c *Client) Run(ctx context.Context, cmd Command, out Output) (Result, error) {
	p, err := c.Start(ctx, cmd)
	if err != nil {
		return Result{ExitCode: -1}, err
	}
	return p.Wait(out)
}

// SendInput writes data to process pid's stdin (its terminal's, when it runs on a pty).
func (c *Client) SendInput(ctx context.Context, pid uint32, pty bool, data []byte) error {
	in := &process.ProcessInput{Input: &process.ProcessInput_Stdin{Stdin: data}}
	if pty {
		in.Input = &process.ProcessInput_Pty{Pty: data}
	}
	req := connect.NewRequest(&process.SendInputRequest{Process: selector(pid), Input: in})
	c.auth(req.Header())
	_, err := c.proc.SendInput(ctx, req)
	return err
}

// Resize changes the size of process pid's terminal.
func (c *Client) Resize(ctx context.Context, pid uint32, size PtySize) error {
	req := connect.NewRequest(&process.UpdateRequest{Process: selector(pid),
		Pty: &process.PTY{Size: &process.PTY_Size{Cols: size.Cols, Rows: size.Rows}}})
	c.auth(req.Header())
	_, err := c.proc.Update(ctx, req)
	return err
}

func selector(pid uint32) *process.ProcessSelector {
	return &process.ProcessSelector{Selector: &process.ProcessSelector_Pid{Pid: pid}}
}

func (c *Client) auth(h http.Header) {
	if c.token != "" {
		h.Set("X-Access-Token", c.token)
	}
}

func basic(user string) string { return base64.StdEncoding.EncodeToString([]byte(user + ":")) }
