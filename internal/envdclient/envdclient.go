// Package envdclient is the host side of envd's process protocol, shared by everything in ember
// that runs a command in a sandbox from outside it: the sandbox Manager (template start and
// ready commands), the CLI's `sandbox exec` and the end-to-end tests. It owns the consumption
// of a process Start stream and the envd port, and knows nothing of how the caller reaches
// envd (directly at a slot's address, or through the daemon's sandbox plane).
package envdclient

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"strings"

	"connectrpc.com/connect"

	"github.com/ember-sandbox/ember/api/gen/process"
	"github.com/ember-sandbox/ember/api/gen/process/processconnect"
)

// Port is where envd listens inside every sandbox.
const Port = 49983

// Command is one process to start through envd.
type Command struct {
	// Line is a bash command line, run as `bash -l -c Line` (as E2B's commands.run does).
	Line string
	User string // "" = envd's default user
	Cwd  string
	Envs map[string]string
	// Token is envd's access token (X-Access-Token), if it has one.
	Token string
	// Wait: with false, Run returns once the process started (it keeps running).
	Wait bool
}

// Output receives the process's output as it arrives.
type Output struct {
	Stdout, Stderr func([]byte)
}

// Result is how a process ended (or started, without Wait).
type Result struct {
	Pid      uint32
	ExitCode int // -1 when it did not end (without Wait)
}

// ErrNoEnd: the stream ended without the process's end event.
var ErrNoEnd = errors.New("envd stream ended without a result")

// Run starts c through pc and consumes its event stream.
func Run(ctx context.Context, pc processconnect.ProcessClient, c Command, out Output) (Result, error) {
	no := false
	cfg := &process.ProcessConfig{Cmd: "/bin/bash", Args: []string{"-l", "-c", c.Line}, Envs: c.Envs}
	if c.Cwd != "" {
		cfg.Cwd = &c.Cwd
	}
	req := connect.NewRequest(&process.StartRequest{Process: cfg, Stdin: &no})
	if c.User != "" {
		req.Header().Set("Authorization", "Basic "+basic(c.User))
	}
	if c.Token != "" {
		req.Header().Set("X-Access-Token", c.Token)
	}
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := pc.Start(sctx, req)
	if err != nil {
		return Result{ExitCode: -1}, err
	}
	defer stream.Close()
	res := Result{ExitCode: -1}
	for stream.Receive() {
		ev := stream.Msg().GetEvent()
		switch {
		case ev.GetStart() != nil:
			res.Pid = ev.GetStart().GetPid()
			if !c.Wait {
				return res, nil // disconnecting does not stop the process
			}
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
			return res, nil
		}
	}
	if err := stream.Err(); err != nil {
		return res, err
	}
	return res, fmt.Errorf("%w", ErrNoEnd)
}

// Collect returns an Output that appends both streams to b.
func Collect(b *strings.Builder) Output {
	w := func(p []byte) { b.Write(p) }
	return Output{Stdout: w, Stderr: w}
}

func basic(user string) string { return base64.StdEncoding.EncodeToString([]byte(user + ":")) }
