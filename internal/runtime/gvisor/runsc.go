package gvisor

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// globalFlags are the flags every runsc invocation gets. logDir is the instance's log directory
// ("" for commands not tied to one instance: their log goes to <Root>/runsc.log).
func (d *Driver) globalFlags(logDir string) []string {
	f := []string{
		"--root=" + d.cfg.Root,
		"--platform=" + d.cfg.Platform,
		"--overlay2=" + d.cfg.Overlay,
		"--network=sandbox",
	}
	if d.cfg.IgnoreCgroups {
		f = append(f, "--ignore-cgroups")
	}
	if logDir == "" {
		f = append(f, "--log="+filepath.Join(d.cfg.Root, "runsc.log"))
	} else {
		f = append(f, "--log="+filepath.Join(logDir, "runsc.log"))
		if d.cfg.Debug {
			// A trailing slash makes runsc create one file per command (and per sandbox/gofer).
			f = append(f, "--debug", "--debug-log="+logDir+string(filepath.Separator))
		}
	}
	return append(f, d.cfg.ExtraFlags...)
}

// run runs a short-lived runsc command that hands no stdio to a sandbox (state, kill, delete,
// checkpoint, list, events) and returns its stdout. Errors carry runsc's stderr and are
// classified into errdefs categories.
func (d *Driver) run(ctx context.Context, logDir string, args ...string) ([]byte, error) {
	// A wedged runsc (one stopped by a signal, holding a container lock) must not hang the
	// daemon forever, start-up's reconcile included: every command is bounded.
	if _, ok := ctx.Deadline(); !ok {
		bound := time.Minute
		if len(args) > 0 && args[0] == "checkpoint" {
			bound = 10 * time.Minute
		}
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, bound)
		defer cancel()
	}
	full := append(d.globalFlags(logDir), args...)
	cmd := exec.CommandContext(ctx, d.cfg.Runsc, full...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Run(); err != nil {
		return stdout.Bytes(), runscError(args, stderr.String(), err)
	}
	return stdout.Bytes(), nil
}

// runscError turns a failed runsc invocation into an error wrapping an errdefs category.
func runscError(args []string, stderr string, err error) error {
	msg := strings.TrimSpace(stderr)
	if len(msg) > 2048 {
		msg = "..." + msg[len(msg)-2048:]
	}
	what := "runsc " + strings.Join(args, " ")
	if len(what) > 200 {
		what = what[:200] + "..."
	}
	cat := classify(msg)
	if cat == nil {
		return fmt.Errorf("gvisor: %s: %v: %s", what, err, msg)
	}
	return fmt.Errorf("gvisor: %s: %s: %w", what, msg, cat)
}

// classify maps runsc's error text to an errdefs category, or nil.
func classify(msg string) error {
	l := strings.ToLower(msg)
	switch {
	case strings.Contains(l, "loading container") &&
		(strings.Contains(l, "does not exist") || strings.Contains(l, "not found") || strings.Contains(l, "no such file")):
		return errdefs.ErrNotFound
	case strings.Contains(l, "already exists"):
		return errdefs.ErrConflict
	case strings.Contains(l, "multiple containers"):
		return errdefs.ErrConflict
	case strings.Contains(l, "is not running"),
		strings.Contains(l, "cannot") && strings.Contains(l, "in state"):
		return errdefs.ErrConflict
	}
	return nil
}
