package gvisor

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
	"gvisor.dev/gvisor/pkg/control/client"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

// Memory reduction (issue 11, lever 8). A restore leaves the sentry's Go heap holding the garbage
// of decoding the checkpoint, which Go collects only at its next GC cycle, up to two minutes
// later for an idle sandbox. The sentry's control server (the uRPC socket runsc talks to) has
// Usage.Reduce: it starts the memory file's evictions and runs the Go GC at once. No runsc
// subcommand calls it, so the driver does, over the sandbox's control socket.

var _ runtime.MemoryReducer = (*Driver)(nil)

// usageReduceOpts is the argument of the sentry's Usage.Reduce (pkg/sentry/control
// UsageReduceOpts; uRPC encodes it as JSON).
type usageReduceOpts struct {
	Wait    bool `json:"wait"`
	DoNotGC bool `json:"do_not_gc"`
}

// ReduceMemory implements runtime.MemoryReducer: the sentry of instance id runs Usage.Reduce
// (evictions waited for, then a Go GC). The instance keeps running as before.
func (d *Driver) ReduceMemory(ctx context.Context, id string) error {
	if err := validateID(id); err != nil {
		return err
	}
	path, err := d.controlSocket(id)
	if err != nil {
		return err
	}
	// Paths longer than a sockaddr_un holds are reached through an O_PATH descriptor, as runsc
	// does itself.
	if len(path) >= len(unix.RawSockaddrUnix{}.Path) {
		fd, err := unix.Open(path, unix.O_PATH|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("gvisor: reduce memory of %s: control socket: %w", id, err)
		}
		defer unix.Close(fd)
		path = "/proc/self/fd/" + strconv.Itoa(fd)
	}
	conn, err := client.ConnectTo(path)
	if err != nil {
		return fmt.Errorf("gvisor: reduce memory of %s: connect to its control socket: %v: %w", id, err, errdefs.ErrConflict)
	}
	defer conn.Close()
	done := make(chan error, 1)
	t0 := time.Now()
	go func() { done <- conn.Call("Usage.Reduce", &usageReduceOpts{Wait: true}, &struct{}{}) }()
	select {
	case err = <-done:
	case <-ctx.Done():
		conn.Close() // unblocks the call
		<-done
		err = ctx.Err()
	}
	if err != nil {
		return fmt.Errorf("gvisor: reduce memory of %s: %w", id, err)
	}
	d.log.Debug("sentry memory reduced", "instance", id, "ms", time.Since(t0).Milliseconds())
	return nil
}

// controlSocket is the path of instance id's sentry control socket, from runsc's state file.
func (d *Driver) controlSocket(id string) (string, error) {
	b, err := os.ReadFile(filepath.Join(d.cfg.Root, id+"_sandbox:"+id+".state"))
	if err != nil {
		return "", fmt.Errorf("gvisor: instance %s: %v: %w", id, err, errdefs.ErrNotFound)
	}
	var st struct {
		Sandbox struct {
			ControlSocketPath string `json:"controlSocketPath"`
		} `json:"sandbox"`
	}
	if err := json.Unmarshal(b, &st); err != nil || st.Sandbox.ControlSocketPath == "" {
		return "", fmt.Errorf("gvisor: instance %s: no control socket in its state file (%v): %w", id, err, errdefs.ErrNotFound)
	}
	return st.Sandbox.ControlSocketPath, nil
}
