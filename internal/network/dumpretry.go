package network

import (
	"errors"
	"time"

	"github.com/vishvananda/netlink"
)

// dumpAttempts bounds retries of a netlink dump that the kernel interrupted.
const dumpAttempts = 10

// retryDump runs dump again while the kernel reports it interrupted (NLM_F_DUMP_INTR: the
// table changed during the dump, as it does while other processes on the host add and remove
// links), so a start-up's reconcile does not fail on a busy host. The last result is returned.
func retryDump[T any](dump func() (T, error)) (T, error) {
	var v T
	var err error
	for i := 0; i < dumpAttempts; i++ {
		if v, err = dump(); !errors.Is(err, netlink.ErrDumpInterrupted) {
			return v, err
		}
		// Backing off gives a burst of link changes (a daemon starting its slots) time to end.
		time.Sleep(time.Duration(i+1) * 5 * time.Millisecond)
	}
	return v, err
}
