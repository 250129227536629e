package sandbox_test

import (
	"context"
	"github.com/ember-sandbox/ember/internal/testutil"
	"maps"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/envdclient"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// A pool instance has run a command through envd (as the template's default user, with the
// template's token) before it is handed out, so the user's first command is not the restored
// sandbox's first; a warm-up that fails (this fake envd runs none) does not cost the instance.
func TestPoolInstancesRunACommandBeforeTheyAreHandedOut(t *testing.T) {
	n := newNode(t, func(c *sandbox.Config) { c.PoolSize = 1 })
	tpl := n.build("base")
	ready := func() int {
		for _, p := range n.m.Pools(context.Background()) {
			if p.TemplateID == tpl.ID {
				return p.Ready
			}
		}
		return 0
	}
	testutil.Eventually(t, 5*time.Second, "pool filled", func() bool { return ready() == 1 })
	running := n.rig.Driver.Running()
	if len(running) != 1 {
		t.Fatalf("running instances %v; want the pool's one", running)
	}
	starts := n.rig.Driver.Starts(running[0])
	if len(starts) != 1 || !strings.Contains(starts[0], "/bin/true") || !strings.HasSuffix(starts[0], " token="+tpl.InitToken) {
		t.Fatalf("pool instance's envd saw %q; want one Start of /bin/true with the template's token", starts)
	}
	sb := n.create(sandbox.CreateRequest{})
	if sb.Runtime.InstanceID != running[0] {
		t.Fatalf("create took instance %s, not the warmed pool instance %s", sb.Runtime.InstanceID, running[0])
	}
}

// The connection a launch used for envd's /health and /init (for a pool instance: its warm-up
// command) carries the sandbox's first request. Create and the first command dial the sandbox
// once in all for a restore, and not at all for a pool instance, instead of a connection per
// step plus a warm-up connection that the SDK's first command raced against.
func TestFirstRequestReusesTheLaunchConnection(t *testing.T) {
	for _, tc := range []struct {
		name  string
		pool  int
		dials int
	}{{"pool instance", 1, 0}, {"restored", 0, 1}} {
		t.Run(tc.name, func(t *testing.T) {
			var mu sync.Mutex
			dials := map[string]int{} // by guest address
			n := newNode(t, func(c *sandbox.Config) {
				c.PoolSize = tc.pool
				dial := c.Dial
				c.Dial = func(ctx context.Context, network, addr string) (net.Conn, error) {
					mu.Lock()
					dials[addr]++
					mu.Unlock()
					return dial(ctx, network, addr)
				}
			})
			tpl := n.build("base")
			if tc.pool > 0 {
				testutil.Eventually(t, 5*time.Second, "pool filled", func() bool {
					for _, p := range n.m.Pools(context.Background()) {
						if p.TemplateID == tpl.ID {
							return p.Ready == tc.pool
						}
					}
					return false
				})
			}
			mu.Lock()
			before := maps.Clone(dials)
			mu.Unlock()
			sb := n.create(sandbox.CreateRequest{})
			addr := net.JoinHostPort(sb.Runtime.GuestIP, strconv.Itoa(envdclient.Port))
			if code, body := n.guest(sb.ID, http.MethodGet, "/health", ""); code/100 != 2 {
				t.Fatalf("first request: %d %s", code, body)
			}
			time.Sleep(50 * time.Millisecond) // room for a stray warm-up connection
			mu.Lock()
			defer mu.Unlock()
			if got := dials[addr] - before[addr]; got != tc.dials {
				t.Fatalf("create and the first request dialed the sandbox %d times; want %d", got, tc.dials)
			}
		})
	}
}
