package sandbox_test

import (
	"context"
	"errors"
	"github.com/ember-sandbox/ember/internal/datadir"
	"github.com/ember-sandbox/ember/internal/testutil"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

func prestartPools(m *sandbox.Manager) []sandbox.PoolState {
	var out []sandbox.PoolState
	for _, p := range m.Pools(context.Background()) {
		if p.Kind == "prestarted" {
			out = append(out, p)
		}
	}
	return out
}

// A create that finds no restored sandbox ready restores into a pre-started instance: the
// sandbox takes the instance's id, slot and directory, gets its own identity and files, and the
// pool makes another.
func TestPrestartedInstancesServePoolMisses(t *testing.T) {
	n := newNode(t, func(c *sandbox.Config) { c.PrestartSize = 2; c.PrestartMax = 4 })
	n.build("base")
	testutil.Eventually(t, 5*time.Second, "two pre-started instances", func() bool { return len(n.rig.Driver.Prestarted()) == 2 })
	if got := n.rig.Driver.Running(); len(got) != 0 {
		t.Fatalf("instances running before any create: %v", got)
	}
	if st := prestartPools(n.m); len(st) != 1 || st[0].Ready != 2 || st[0].Min != 2 || st[0].Max != 4 {
		t.Fatalf("GET /ember/pools for pre-started instances: %+v", st)
	}
	pre := n.rig.Driver.Prestarted()
	restores := n.rig.Driver.Calls("Restore")
	a, b := n.create(sandbox.CreateRequest{}), n.create(sandbox.CreateRequest{})
	for _, sb := range []*sandbox.Sandbox{a, b} {
		if !slices.Contains(pre, sb.Runtime.InstanceID) {
			t.Fatalf("sandbox %s runs on %s, not on a pre-started instance %v", sb.ID, sb.Runtime.InstanceID, pre)
		}
		if !strings.HasPrefix(sb.Runtime.StateDir, datadir.Sandbox(n.cfg.DataDir, sb.ID)+"/") {
			t.Fatalf("state dir %s is not under the sandbox's directory", sb.Runtime.StateDir)
		}
		if got := n.rig.Driver.Token(sb.Runtime.InstanceID); got != sb.AccessToken {
			t.Fatalf("envd token %q, want the sandbox's own", got)
		}
	}
	if got := n.rig.Driver.Calls("Restore") - restores; got != 0 {
		t.Fatalf("%d plain restores for creates that had pre-started instances", got)
	}
	if a.Runtime.SlotIndex == b.Runtime.SlotIndex || a.Runtime.GuestIP == b.Runtime.GuestIP {
		t.Fatalf("two sandboxes on one slot: %+v %+v", a.Runtime, b.Runtime)
	}
	n.write(a.ID, "/f", "a")
	if _, err := n.read(b.ID, "/f"); err == nil {
		t.Fatal("a file written in one sandbox shows in the other")
	}
	testutil.Eventually(t, 5*time.Second, "pre-started pool refilled", func() bool { return len(n.rig.Driver.Prestarted()) >= 2 })
	if st := prestartPools(n.m); st[0].Hits != 2 {
		t.Fatalf("pool state after two creates: %+v", st)
	}
	for _, sb := range []*sandbox.Sandbox{a, b} {
		if err := n.m.Kill(context.Background(), sb.ID); err != nil {
			t.Fatal(err)
		}
	}
	// A graceful stop discards the pre-started instances with their slots and directories.
	n.m.Close()
	n.m = nil
	if ids, _ := n.rig.Driver.List(context.Background()); len(ids) != 0 {
		t.Fatalf("instances left after close: %v", ids)
	}
	if got := n.rig.Network.InUse(); len(got) != 0 {
		t.Fatalf("slots left after close: %v", got)
	}
	if dirs := n.sandboxDirs(); len(dirs) != 0 {
		t.Fatalf("directories left after close: %v", dirs)
	}
}

// With the restored pool on, pre-started instances serve what it misses; a burst of creates
// grows the pre-started pool past its minimum, within the memory budget the two pools share.
func TestPrestartedPoolFollowsMissesWithinBudget(t *testing.T) {
	n := newNode(t, func(c *sandbox.Config) {
		c.PoolSize = 1
		c.PoolMax = 1
		c.PrestartSize = 1
		c.PrestartMax = 6
		c.PoolMemoryMB = 32 + 4*16
	})
	n.build("base")
	testutil.Eventually(t, 5*time.Second, "both pools at their minimum", func() bool {
		return len(n.rig.Driver.Running()) == 1 && len(n.rig.Driver.Prestarted()) == 1
	})
	var ids []string
	for i := 0; i < 20; i++ {
		ids = append(ids, n.create(sandbox.CreateRequest{}).ID)
	}
	st := prestartPools(n.m)
	if len(st) != 1 || st[0].Hits == 0 || st[0].Target <= st[0].Min {
		t.Fatalf("pre-started pool after a burst: %+v", st)
	}
	for _, id := range ids {
		n.m.Kill(context.Background(), id)
	}
	testutil.Eventually(t, 5*time.Second, "pre-started pool grew", func() bool { return len(n.rig.Driver.Prestarted()) > 1 })
	time.Sleep(1500 * time.Millisecond)
	// The two pools share the budget: 4 pre-started beside a full restored pool, more while the
	// restored pool is empty (a create took it and its refill waits for room).
	restored := 0
	for _, p := range n.m.Pools(context.Background()) {
		if p.Kind == "restored" {
			restored += p.Ready
		}
	}
	if got := len(n.rig.Driver.Prestarted()); got*16+restored*32 > 32+4*16 {
		t.Fatalf("%d pre-started instances (16 MiB each) beside %d restored (32 MiB each): over the budget of %d MiB", got, restored, 32+4*16)
	}
}

// A restore into a pre-started instance that fails costs the create nothing but time: the
// instance is torn down and a plain restore runs; nothing is left of it.
func TestFailedRestoreIntoFallsBack(t *testing.T) {
	var mu sync.Mutex
	failing := true
	n := newNode(t, func(c *sandbox.Config) { c.PrestartSize = 1; c.PrestartMax = 1 })
	n.rig.Driver.Fail = func(op, id string) error {
		mu.Lock()
		defer mu.Unlock()
		if op == "RestoreInto" && failing {
			return errors.New("boom")
		}
		return nil
	}
	n.build("base")
	testutil.Eventually(t, 5*time.Second, "pre-started", func() bool { return len(n.rig.Driver.Prestarted()) == 1 })
	pre := n.rig.Driver.Prestarted()[0]
	sb := n.create(sandbox.CreateRequest{})
	if sb.Runtime.InstanceID == pre || strings.HasPrefix(pre, sb.ID) {
		t.Fatalf("sandbox %s on the failed instance %s", sb.ID, pre)
	}
	if _, err := n.rig.Driver.State(context.Background(), pre); err == nil {
		t.Fatalf("the failed pre-started instance %s is still known", pre)
	}
	n.write(sb.ID, "/f", "ok")
	if dirs := n.sandboxDirs(); slices.Contains(dirs, pre[:len(pre)-5]) {
		t.Fatalf("the failed instance's directory is left: %v", dirs)
	}
}

// plainDriver hides the fake's runtime.Prestarter, as a driver without support.
type plainDriver struct{ runtime.Driver }

func TestDriverWithoutPrestartRestores(t *testing.T) {
	n := newNode(t, func(c *sandbox.Config) { c.PrestartSize = 2; c.PrestartMax = 2 })
	n.m.Close()
	n.cfg.Driver = plainDriver{n.rig.Driver}
	n.start()
	n.build("base")
	sb := n.create(sandbox.CreateRequest{})
	n.write(sb.ID, "/f", "ok")
	if st := prestartPools(n.m); len(st) != 0 {
		t.Fatalf("pre-started pools on a driver without support: %+v", st)
	}
	if got := n.rig.Driver.Calls("Prestart"); got != 0 {
		t.Fatalf("%d Prestart calls", got)
	}
}

// A pre-start cut at any point leaves nothing: no instance, slot or directory.
func TestFailedPrestartReleasesEverything(t *testing.T) {
	for _, point := range []string{"launch.prestart"} {
		t.Run(point, func(t *testing.T) {
			n := newNode(t, func(c *sandbox.Config) {
				c.PrestartSize, c.PrestartMax = 1, 1
				c.Fail = func(p string) error {
					if p == point {
						return errors.New("boom")
					}
					return nil
				}
			})
			n.build("base")
			testutil.Eventually(t, 5*time.Second, "a refill tried", func() bool { return n.rig.Driver.Calls("Prestart") > 0 })
			time.Sleep(1200 * time.Millisecond) // the ticker's retry, too
			if ids, _ := n.rig.Driver.List(context.Background()); len(ids) != 0 {
				t.Fatalf("instances left: %v", ids)
			}
			if got := n.rig.Network.InUse(); len(got) != 0 {
				t.Fatalf("slots left: %v", got)
			}
			if dirs := n.sandboxDirs(); len(dirs) != 0 {
				t.Fatalf("directories left: %v", dirs)
			}
		})
	}
}

// After a memory pause the sandbox gets an instance pre-started with its layer: the resume
// restores into it (same id, token and files), a kill of the paused sandbox discards it with
// everything it holds, and a filesystem-only resume (reboot) boots on the files it gives back.
func TestResumeRestoresIntoPrestarted(t *testing.T) {
	n := newNode(t, func(c *sandbox.Config) { c.PrestartMax = 1; c.PauseMode = sandbox.PauseCheckpoint })
	n.build("base")
	sb := n.create(sandbox.CreateRequest{})
	n.write(sb.ID, "/f", "kept")
	if err := n.m.Pause(context.Background(), sb.ID); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 5*time.Second, "an instance pre-started for the resume", func() bool { return len(preFor(n, sb.ID)) == 1 })
	pre := preFor(n, sb.ID)[0]
	found := false
	for _, p := range n.m.Pools(context.Background()) {
		found = found || (p.Kind == "resume" && p.Ready == 1 && slices.Equal(p.SandboxIDs, []string{sb.ID}))
	}
	if !found {
		t.Fatalf("GET /ember/pools does not show the resume instance: %+v", n.m.Pools(context.Background()))
	}
	got, resumed, err := n.m.Connect(context.Background(), sb.ID, time.Minute)
	if err != nil || !resumed {
		t.Fatalf("resume: %v %v", resumed, err)
	}
	if got.Runtime.InstanceID != pre {
		t.Fatalf("resumed on %s, not on the pre-started %s", got.Runtime.InstanceID, pre)
	}
	if v, err := n.read(sb.ID, "/f"); err != nil || v != "kept" {
		t.Fatalf("file after resume: %q %v", v, err)
	}
	if tok := n.rig.Driver.Token(pre); tok != sb.AccessToken {
		t.Fatalf("token after resume %q, want the sandbox's", tok)
	}

	// Paused with a pre-started instance, then killed: nothing is left.
	if err := n.m.Pause(context.Background(), sb.ID); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 5*time.Second, "pre-started again", func() bool { return len(preFor(n, sb.ID)) == 1 })
	if err := n.m.Kill(context.Background(), sb.ID); err != nil {
		t.Fatal(err)
	}
	if ids, _ := n.rig.Driver.List(context.Background()); slices.ContainsFunc(ids, func(id string) bool { return strings.HasPrefix(id, sb.ID) }) {
		t.Fatalf("instances of the killed paused sandbox left: %v", ids)
	}
	if dirs := n.sandboxDirs(); slices.Contains(dirs, sb.ID) {
		t.Fatalf("directory of the killed paused sandbox left: %v", dirs)
	}

	// A reboot resume discards the pre-started instance and boots on the files.
	other := n.create(sandbox.CreateRequest{})
	n.write(other.ID, "/g", "files")
	if err := n.m.Pause(context.Background(), other.ID); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 5*time.Second, "pre-started for the other", func() bool { return len(preFor(n, other.ID)) == 1 })
	if _, _, err := n.m.ConnectWith(context.Background(), other.ID, sandbox.ConnectOptions{Reboot: true}); err != nil {
		t.Fatal(err)
	}
	if v, err := n.read(other.ID, "/g"); err != nil || v != "files" {
		t.Fatalf("file after a reboot resume: %q %v", v, err)
	}
	if got := preFor(n, other.ID); len(got) != 0 {
		t.Fatalf("pre-started instances left: %v", got)
	}

	// NoPrestart: none is made.
	if err := n.m.PauseWith(context.Background(), other.ID, sandbox.PauseOptions{KeepMemory: true, NoPrestart: true}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	if got := preFor(n, other.ID); len(got) != 0 {
		t.Fatalf("pre-started despite NoPrestart: %v", got)
	}
}

// preFor lists the pre-started instances of sandbox id.
func preFor(n *node, id string) []string {
	var out []string
	for _, p := range n.rig.Driver.Prestarted() {
		if strings.HasPrefix(p, id+"-") {
			out = append(out, p)
		}
	}
	return out
}

// PrestartMax 0 disables pre-started instances whatever PrestartSize says (ember serve's
// --prestart-max 0 with the default --prestart-size 1).
func TestPrestartMaxZeroDisables(t *testing.T) {
	n := newNode(t, func(c *sandbox.Config) { c.PrestartSize = 1 })
	n.build("base")
	n.create(sandbox.CreateRequest{})
	time.Sleep(1200 * time.Millisecond)
	if got := n.rig.Driver.Calls("Prestart"); got != 0 {
		t.Fatalf("%d Prestart calls with PrestartMax 0", got)
	}
}

// A create with its own egress rules restores into a pre-started instance too: its slot gets
// the rules before anything runs in it.
func TestPrestartedInstanceTakesTheCreatesEgress(t *testing.T) {
	n := newNode(t, func(c *sandbox.Config) { c.PrestartSize, c.PrestartMax = 1, 1 })
	n.build("base")
	testutil.Eventually(t, 5*time.Second, "pre-started", func() bool { return len(n.rig.Driver.Prestarted()) == 1 })
	pre := n.rig.Driver.Prestarted()[0]
	no := false
	sb := n.create(sandbox.CreateRequest{AllowInternet: &no})
	if sb.Runtime.InstanceID != pre {
		t.Fatalf("a create without internet access restored into %s, not the pre-started %s", sb.Runtime.InstanceID, pre)
	}
	if e := n.rig.Network.Egress(sb.Runtime.SlotIndex); e.AllowInternet {
		t.Fatalf("the slot of a sandbox created without internet access allows it: %+v", e)
	}
}
