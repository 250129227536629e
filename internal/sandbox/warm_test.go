package sandbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

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
	eventually(t, 5*time.Second, "pool filled", func() bool { return ready() == 1 })
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
