package network

import (
	"errors"
	"fmt"
	"testing"

	"github.com/vishvananda/netlink"
)

// A link dump interrupted by concurrent link changes elsewhere on the host is retried (it made a
// daemon restart fail: "list links: results may be incomplete or inconsistent").
func TestRetryDumpInterrupted(t *testing.T) {
	calls := 0
	got, err := retryDump(func() ([]string, error) {
		calls++
		if calls < 3 {
			return []string{"partial"}, fmt.Errorf("wrapped: %w", netlink.ErrDumpInterrupted)
		}
		return []string{"a", "b"}, nil
	})
	if err != nil || len(got) != 2 || calls != 3 {
		t.Fatalf("retryDump = %v, %v after %d calls; want the full list after 3", got, err, calls)
	}
	other := errors.New("permission denied")
	calls = 0
	if _, err := retryDump(func() (int, error) { calls++; return 0, other }); !errors.Is(err, other) || calls != 1 {
		t.Fatalf("another error: %v after %d calls; want it at once", err, calls)
	}
	calls = 0
	if _, err := retryDump(func() (int, error) { calls++; return 0, netlink.ErrDumpInterrupted }); !errors.Is(err, netlink.ErrDumpInterrupted) || calls != dumpAttempts {
		t.Fatalf("always interrupted: %v after %d calls; want the error after %d", err, calls, dumpAttempts)
	}
}
