package network

import (
	"errors"
	"testing"

	"github.com/vishvananda/netlink"
)

// A link dump that a change on the host interrupted is made again; a lasting error is returned.
func TestLinkNamesRetriesInterruptedDump(t *testing.T) {
	calls := 0
	list := func() ([]netlink.Link, error) {
		calls++
		if calls < 3 {
			// What netlink returns then: partial results and ErrDumpInterrupted.
			return []netlink.Link{&netlink.Dummy{LinkAttrs: netlink.LinkAttrs{Name: "partial"}}}, netlink.ErrDumpInterrupted
		}
		return []netlink.Link{&netlink.Dummy{LinkAttrs: netlink.LinkAttrs{Name: "lo"}}, &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "emb-1"}}}, nil
	}
	names, err := linkNames(list)
	if err != nil || len(names) != 2 || names[1] != "emb-1" || calls != 3 {
		t.Fatalf("linkNames = %v, %v after %d dumps; want [lo emb-1] after 3", names, err, calls)
	}
	calls = 0
	if _, err := linkNames(func() ([]netlink.Link, error) { calls++; return nil, netlink.ErrDumpInterrupted }); !errors.Is(err, netlink.ErrDumpInterrupted) || calls != dumpAttempts {
		t.Fatalf("always interrupted: %v after %d dumps, want ErrDumpInterrupted after %d", err, calls, dumpAttempts)
	}
}
