package gvisor

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Release implements runtime.Driver: the instance's overlay and disk layer are unmounted, a
// consumed layer goes back to its image, the rest of the layer is removed.
func (d *Driver) Release(ctx context.Context, stateDir string) error {
	if !d.hostLayers() || stateDir == "" {
		return nil
	}
	thawCutLayer(stateDir)
	return releaseLayer(stateDir)
}

// Sweep implements runtime.Driver. First every runsc process of this driver's root (its
// --root flag) that serves an instance outside keep is killed: a `runsc run/restore --detach`
// that an earlier daemon left in flight would otherwise finish after start-up and leave an
// instance running with no record and, once reconciliation removed it, no directory. Then every
// instance runsc lists that is not in keep is deleted.
func (d *Driver) Sweep(ctx context.Context, keep []string) ([]string, error) {
	kept := map[string]bool{}
	for _, id := range keep {
		kept[id] = true
	}
	// A layer a cut clone left frozen holds its instance's processes in uninterruptible waits
	// (no kill ends them): thaw it first.
	if out, err := d.run(ctx, "", "list", "--format", "json"); err == nil {
		var states []ociState
		if json.Unmarshal(out, &states) == nil {
			for _, st := range states {
				if st.Bundle != "" && thawCutLayer(filepath.Dir(st.Bundle)) {
					d.log.Warn("sweep: thawed a layer a cut checkpoint had left frozen", "instance", st.ID)
				}
			}
		}
	}
	var held []int
	for _, p := range d.processes() {
		if kept[p.instance] || p.pid == os.Getpid() {
			continue
		}
		fd, err := unix.PidfdOpen(p.pid, 0)
		if err != nil {
			continue // gone already
		}
		_ = unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0)
		held = append(held, fd)
		d.log.Info("sweep: killed a runsc process of no kept instance", "instance", p.instance, "pid", p.pid, "command", p.command)
	}
	for _, fd := range held {
		_ = waitPidfd(ctx, fd, 10*time.Second)
		unix.Close(fd)
	}
	ids, err := d.List(ctx)
	if err != nil {
		return nil, err
	}
	var removed []string
	for _, id := range ids {
		if kept[id] {
			continue
		}
		if err := d.Delete(ctx, id); err != nil {
			return removed, fmt.Errorf("gvisor: sweep: delete %s: %w", id, err)
		}
		removed = append(removed, id)
	}
	return removed, nil
}

// waitGone waits (up to timeout) until no runsc process of instance id is left: the gofer
// outlives the sandbox process by a moment, and it runs in a mount namespace of its own that
// holds the instance's layer filesystem until it exits.
func (d *Driver) waitGone(ctx context.Context, id string, timeout time.Duration) {
	deadline := time.Now().Add(timeout)
	for {
		left := 0
		for _, p := range d.processes() {
			if p.instance == id {
				left++
			}
		}
		if left == 0 {
			return
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			d.log.Warn("runsc processes of a stopped instance still run", "instance", id, "count", left)
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

type runscProc struct {
	pid      int
	command  string // the runsc subcommand (run, restore, boot, gofer, ...)
	instance string // the instance id (runsc's last argument)
}

// processes lists the runsc processes whose --root is this driver's.
func (d *Driver) processes() []runscProc {
	root := "--root=" + d.cfg.Root
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	var out []runscProc
	for _, dir := range dirs {
		pid, err := strconv.Atoi(filepath.Base(dir))
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, "cmdline"))
		if err != nil || len(b) == 0 {
			continue
		}
		args := strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
		hasRoot := false
		command := ""
		for _, a := range args[1:] {
			if a == root {
				hasRoot = true
			} else if command == "" && !strings.HasPrefix(a, "-") {
				command = a
			}
		}
		if !hasRoot || len(args) < 2 {
			continue
		}
		id := args[len(args)-1]
		if validateID(id) != nil {
			continue
		}
		out = append(out, runscProc{pid: pid, command: command, instance: id})
	}
	return out
}
