package gvisor

import (
	"context"
	"fmt"
	"time"

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
	t0 := time.Now()
	if err := d.ctlCall(ctx, id, "", "Usage.Reduce", &usageReduceOpts{Wait: true}, &struct{}{}); err != nil {
		return fmt.Errorf("gvisor: reduce memory of %s: %w", id, err)
	}
	d.log.Debug("sentry memory reduced", "instance", id, "ms", time.Since(t0).Milliseconds())
	return nil
}

// controlSocket is the path of instance id's sentry control socket, from runsc's state file.
func (d *Driver) controlSocket(id string) (string, error) {
	st, err := d.readState(id)
	if err != nil {
		return "", err
	}
	if st.Socket == "" {
		return "", fmt.Errorf("gvisor: instance %s: no control socket in its state file: %w", id, errdefs.ErrNotFound)
	}
	return st.Socket, nil
}
