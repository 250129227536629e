package cli

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/ember-sandbox/ember/internal/envdclient"
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
	// The transport carries the access token with the routing headers.
	ec := envdclient.New(hc, c.base, "")

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
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	p, err := ec.Start(sctx, envdclient.Command{Argv: []string{"/bin/bash", "-i", "-l"}, User: user, Cwd: cwd,
		Envs:      map[string]string{"TERM": termName, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"},
		Pty:       &envdclient.PtySize{Cols: uint32(cols), Rows: uint32(rows)},
		KeepAlive: 50 * time.Second})
	if err != nil {
		if errors.Is(err, envdclient.ErrNoEnd) {
			return -1, fmt.Errorf("the shell did not start")
		}
		return -1, err
	}

	if isTerm {
		old, err := term.MakeRaw(in)
		if err != nil {
			p.Close()
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
					_ = ec.Resize(sctx, p.Pid, envdclient.PtySize{Cols: uint32(w), Rows: uint32(h)})
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
				if serr := ec.SendInput(sctx, p.Pid, true, append([]byte(nil), buf[:n]...)); serr != nil {
					return
				}
			}
			if err != nil {
				return // EOF: the shell goes on until it exits by itself
			}
		}
	}()
	res, err := p.Wait(envdclient.Output{Stdout: func(b []byte) { os.Stdout.Write(b) }, Stderr: func(b []byte) { os.Stderr.Write(b) }})
	if errors.Is(err, envdclient.ErrNoEnd) {
		return -1, fmt.Errorf("the connection to the shell ended before it exited")
	}
	if err != nil {
		return -1, err
	}
	return res.ExitCode, nil
}
