package gvisor

import (
	"fmt"
	"net"
	"runtime"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/testutil"
)

// TestScrapeRefusesTheHostsNetwork: the pre-start's network set-up takes the addresses off the
// links of the namespace it reads; pointed at the host's own namespace it refuses and the host
// keeps every address.
func TestScrapeRefusesTheHostsNetwork(t *testing.T) {
	testutil.RequireRoot(t)
	before := hostAddrs(t)
	runtime.LockOSThread() // this thread's namespace is the host's (the test's)
	defer runtime.UnlockOSThread()
	self := fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid())
	if _, err := scrapeNetwork(self); err == nil || !strings.Contains(err.Error(), "host's network namespace") {
		t.Fatalf("scrapeNetwork of the host's namespace = %v, want a refusal", err)
	}
	if after := hostAddrs(t); after != before {
		t.Errorf("the host's addresses changed:\nbefore %s\nafter  %s", before, after)
	}
}

func hostAddrs(t *testing.T) string {
	t.Helper()
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	for _, a := range addrs {
		b.WriteString(a.String() + " ")
	}
	return b.String()
}
