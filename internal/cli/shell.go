package cli

import (
	"context"
	"encoding/base64"
	"fmt"
	"net/http"
	"os"
	"os/signal"
	"syscall"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/ember-sandbox/ember/api/gen/process"
	"github.com/ember-sandbox/ember/api/gen/process/processconnect"
)

// shellCmd is `ember sandbox shell ID`: an interactive terminal in a sandbox, a login bash on a
// pty that envd's process service runs (through the daemon's sandbox plane, as the SDK's
// sandbox.pty does). The local terminal is put in raw mode, its size follows the window
// (SIGWINCH -> Update), and the CLI exits with the shell's exit code.
func shellCmd(g *globals) *cobra.Command {
	var user, cwd string
	c := &cobra.Command{
		Use:   "shell ID",
		Short: "Open a terminal in a sandbox (a pty through envd); exits with the shell's exit code",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			code, err := g.client().shell(cmd.Context(), args[0], user, cwd)
			if err != nil {
				return err
			}
			if code != 0 {
				return &ExitError{Code: code}
			}
			return nil
		},
	}
	c.Flags().StringVarP(&user, "user", "u", "", "user to run the shell as (default: the sandbox's default user)")
	c.Flags().StringVar(&cwd, "cwd", "", "working directory")
	return c
}

// shell runs the interactive session and returns the remote shell's exit code.
func (c *client) shell(ctx context.Context, id, user, cwd string) (int, error) {
	var info struct {
		EnvdAccessToken string `json:"envdAccessToken"`
	}
	if _, err := c.do(ctx, http.MethodGet, "/sandboxes/"+id, nil, &info); err != nil {
		return -1, err
	}
	hc := &http.Client{Transport: &sandboxTransport{id: id, token: info.EnvdAccessToken, base: http.DefaultTransport}}
	pc := processconnect.NewProcessClient(hc, c.base)

	in := int(os.Stdin.Fd())
	isTerm := term.IsTerminal(in)
	cols, rows := 80, 24
	if isTerm {
		if w, h, err := term.GetSize(in); err == nil && w > 0 && h > 0 {
			cols, rows = w, h
		}
	}
	termName := os.Getenv("TERM")
	if termName == "" || termName == "dumb" {
		termName = "xterm-256color"
	}
	cfg := &process.ProcessConfig{Cmd: "/bin/bash", Args: []string{"-i", "-l"},
		Envs: map[string]string{"TERM": termName, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}}
	if cwd != "" {
		cfg.Cwd = &cwd
	}
	req := connect.NewRequest(&process.StartRequest{Process: cfg, Pty: &process.PTY{Size: &process.PTY_Size{Cols: uint32(cols), Rows: uint32(rows)}}})
	if user != "" {
		req.Header().Set("Authorization", "Basic "+basicUser(user))
	}
	req.Header().Set("Keepalive-Ping-Interval", "50")
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := pc.Start(sctx, req)
	if err != nil {
		return -1, err
	}
	defer stream.Close()

	var pid uint32
	for pid == 0 && stream.Receive() {
		if st := stream.Msg().GetEvent().GetStart(); st != nil {
			pid = st.GetPid()
		}
	}
	if pid == 0 {
		if err := stream.Err(); err != nil {
			return -1, err
		}
		return -1, fmt.Errorf("the shell did not start")
	}
	sel := &process.ProcessSelector{Selector: &process.ProcessSelector_Pid{Pid: pid}}

	if isTerm {
		old, err := term.MakeRaw(in)
		if err != nil {
			return -1, err
		}
		defer term.Restore(in, old)
		winch := make(chan os.Signal, 1)
		signal.Notify(winch, syscall.SIGWINCH)
		defer signal.Stop(winch)
		go func() {
			for {
				select {
				case <-sctx.Done():
					return
				case <-winch:
					w, h, err := term.GetSize(in)
					if err != nil {
						continue
					}
					pc.Update(sctx, connect.NewRequest(&process.UpdateRequest{Process: sel,
						Pty: &process.PTY{Size: &process.PTY_Size{Cols: uint32(w), Rows: uint32(h)}}}))
				}
			}
		}()
	}
	// Keystrokes go as they are read; the process's end ends the session (the reader is left
	// blocked on stdin, and the CLI exits).
	go func() {
		buf := make([]byte, 32<<10)
		for {
			n, err := os.Stdin.Read(buf)
			if n > 0 {
				data := append([]byte(nil), buf[:n]...)
				if _, serr := pc.SendInput(sctx, connect.NewRequest(&process.SendInputRequest{Process: sel,
					Input: &process.ProcessInput{Input: &process.ProcessInput_Pty{Pty: data}}})); serr != nil {
					return
				}
			}
			if err != nil {
				return // EOF: the shell goes on until it exits by itself
			}
		}
	}()
	for stream.Receive() {
		ev := stream.Msg().GetEvent()
		if d := ev.GetData(); d != nil {
			if b := d.GetPty(); len(b) > 0 {
				os.Stdout.Write(b)
			}
			if b := d.GetStdout(); len(b) > 0 {
				os.Stdout.Write(b)
			}
			if b := d.GetStderr(); len(b) > 0 {
				os.Stderr.Write(b)
			}
		}
		if end := ev.GetEnd(); end != nil {
			return int(end.GetExitCode()), nil
		}
	}
	if err := stream.Err(); err != nil {
		return -1, err
	}
	return -1, fmt.Errorf("the connection to the shell ended before it exited")
}

// basicUser is envd's user selection (HTTP basic auth with the user name and no password).
func basicUser(user string) string { return base64.StdEncoding.EncodeToString([]byte(user + ":")) }
