package sandbox_test

import (
	"context"
	"errors"
	"fmt"
	"github.com/ember-sandbox/ember/internal/datadir"
	"github.com/ember-sandbox/ember/internal/testutil"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/envdclient"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/sandbox/sandboxtest"
	"github.com/ember-sandbox/ember/internal/snapshot"
	"github.com/ember-sandbox/ember/internal/snapshot/local"
	"github.com/ember-sandbox/ember/internal/store"
	"github.com/ember-sandbox/ember/internal/template/build"
)

// node is a Manager over the fakes, with what a test needs to restart it on the same state.
type node struct {
	t     *testing.T
	rig   *sandboxtest.Rig
	store *store.Store
	dir   string
	cfg   sandbox.Config
	m     *sandbox.Manager
	b     *build.Manager // template builds on m
}

func newNode(t *testing.T, mod func(*sandbox.Config)) *node {
	t.Helper()
	dir := t.TempDir()
	st, err := store.Open(filepath.Join(dir, "ember.db"))
	if err != nil {
		t.Fatal(err)
	}
	rig := sandboxtest.NewRig(64)
	n := &node{t: t, rig: rig, store: st, dir: dir}
	n.cfg = sandbox.Config{
		DataDir:      filepath.Join(dir, "data"),
		Driver:       rig.Driver,
		Network:      rig.Network,
		Store:        st,
		Builder:      sandboxtest.Builder{},
		Dial:         rig.Dial,
		EnvdTimeout:  2 * time.Second,
		DrainTimeout: 2 * time.Second,
		Logger:       slog.New(slog.DiscardHandler),
	}
	if mod != nil {
		mod(&n.cfg)
	}
	n.start()
	t.Cleanup(func() {
		if n.m != nil {
			n.m.Close()
		}
		rig.Driver.Close()
		st.Close()
	})
	return n
}

func (n *node) start() {
	n.t.Helper()
	m, err := sandbox.New(context.Background(), n.cfg)
	if err != nil {
		n.t.Fatalf("new manager: %v", err)
	}
	n.m = m
	b, err := build.New(build.Config{DataDir: n.cfg.DataDir, Driver: n.cfg.Driver, Store: n.cfg.Store, Builder: n.cfg.Builder, Logger: n.cfg.Logger}, m.BuildHost())
	if err != nil {
		n.t.Fatalf("new build manager: %v", err)
	}
	n.b = b
}

// restart closes the Manager gracefully and starts a new one on the same state.
func (n *node) restart() {
	n.t.Helper()
	n.m.Close()
	n.start()
}

func (n *node) build(name string) *sandbox.Template {
	n.t.Helper()
	tpl, err := n.b.BuildTemplate(context.Background(), sandbox.BuildRequest{Name: name}, nil)
	if err != nil {
		n.t.Fatalf("build %s: %v", name, err)
	}
	return tpl
}

func (n *node) create(req sandbox.CreateRequest) *sandbox.Sandbox {
	n.t.Helper()
	if req.TemplateID == "" {
		req.TemplateID = "base"
	}
	sb, err := n.m.Create(context.Background(), req)
	if err != nil {
		n.t.Fatalf("create: %v", err)
	}
	return sb
}

// guest calls the fake envd of a running sandbox through the Manager's guest transport.
func (n *node) guest(id, method, path, body string) (int, string) {
	n.t.Helper()
	base, err := n.m.GuestURL(context.Background(), id, envdclient.Port)
	if err != nil {
		return 0, err.Error()
	}
	sb, err := n.m.Get(context.Background(), id)
	if err != nil {
		return 0, err.Error()
	}
	req, _ := http.NewRequest(method, base+path, strings.NewReader(body))
	req.Header.Set("X-Access-Token", sb.AccessToken)
	resp, err := (&http.Client{Transport: n.m.GuestTransport(), Timeout: 5 * time.Second}).Do(req)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func (n *node) write(id, path, data string) {
	n.t.Helper()
	if code, msg := n.guest(id, http.MethodPut, "/fake/files?path="+path, data); code != http.StatusNoContent {
		n.t.Fatalf("write %s in %s: %d %s", path, id, code, msg)
	}
}

func (n *node) read(id, path string) (string, error) {
	n.t.Helper()
	code, body := n.guest(id, http.MethodGet, "/fake/files?path="+path, "")
	if code != http.StatusOK {
		return "", fmt.Errorf("read %s: %d %s", path, code, body)
	}
	return body, nil
}

// assertClean checks that nothing but the given sandboxes' instances and slots exists.
func (n *node) assertHolds(want int) {
	n.t.Helper()
	if got := n.rig.Driver.Running(); len(got) != want {
		n.t.Errorf("running instances: %d %v, want %d", len(got), got, want)
	}
	if got := n.rig.Network.InUse(); len(got) != want {
		n.t.Errorf("slots in use: %v, want %d", got, want)
	}
}

func (n *node) sandboxDirs() []string {
	ents, _ := os.ReadDir(datadir.Sandboxes(n.cfg.DataDir))
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

func TestCreateFromCheckpointRunsAndKillReleases(t *testing.T) {
	n := newNode(t, nil)
	n.build("base")
	sb := n.create(sandbox.CreateRequest{Metadata: map[string]string{"k": "v"}})
	if sb.State != sandbox.StateRunning || sb.Runtime.InstanceID == "" {
		t.Fatalf("created %+v", sb)
	}
	// The sandbox's envd got its own token through /init.
	if got := n.rig.Driver.Token(sb.Runtime.InstanceID); got != sb.AccessToken {
		t.Fatalf("envd token %q, want the sandbox's %q", got, sb.AccessToken)
	}
	n.write(sb.ID, "/a", "1")
	n.assertHolds(1)
	if err := n.m.Kill(context.Background(), sb.ID); err != nil {
		t.Fatal(err)
	}
	n.assertHolds(0)
	if dirs := n.sandboxDirs(); len(dirs) != 0 {
		t.Fatalf("sandbox dirs left: %v", dirs)
	}
	_, err := n.m.Get(context.Background(), sb.ID)
	if !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), "killed") {
		t.Fatalf("get after kill: %v", err)
	}
	if err := n.m.Kill(context.Background(), sb.ID); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("second kill: %v", err)
	}
}

func TestTemplateEnvdHoldsATokenFromBoot(t *testing.T) {
	n := newNode(t, func(c *sandbox.Config) { c.PoolSize = 1 })
	tpl := n.build("base")
	if tpl.InitToken == "" {
		t.Fatal("template has no init token")
	}
	// The pool instance's envd answers only to that token until it is assigned.
	testutil.Eventually(t, 5*time.Second, "pool filled", func() bool { return len(n.rig.Driver.Running()) == 1 })
	inst := n.rig.Driver.Running()[0]
	if got := n.rig.Driver.Token(inst); got != tpl.InitToken {
		t.Fatalf("pooled envd token %q, want the template's", got)
	}
}

func TestCreateFromPoolKeepsItsDirectoryAcrossRestart(t *testing.T) {
	n := newNode(t, func(c *sandbox.Config) { c.PoolSize = 2 })
	n.build("base")
	// Ready, not only running: an instance still being restored is not the pool's yet.
	testutil.Eventually(t, 5*time.Second, "pool filled", func() bool { return poolOf(n, "base", "restored").Ready == 2 })
	pooled := n.rig.Driver.Running()
	sb := n.create(sandbox.CreateRequest{})
	if !slices.Contains(pooled, sb.Runtime.InstanceID) {
		t.Fatalf("create restored instead of taking a pool instance")
	}
	// The pool instance lived under the sandbox's own id from the start.
	if !strings.HasPrefix(sb.Runtime.StateDir, datadir.Sandbox(n.cfg.DataDir, sb.ID)+"/") {
		t.Fatalf("state dir %s is not under the sandbox's directory", sb.Runtime.StateDir)
	}
	n.write(sb.ID, "/keep.txt", "precious")
	n.restart()
	if _, err := os.Stat(sb.Runtime.StateDir); err != nil {
		t.Fatalf("restart removed the running sandbox's state: %v", err)
	}
	got, err := n.read(sb.ID, "/keep.txt")
	if err != nil || got != "precious" {
		t.Fatalf("after restart: %q %v", got, err)
	}
	n.write(sb.ID, "/new.txt", "new")
	// Graceful stop destroyed the old pool instances; the new Manager refills its own.
	testutil.Eventually(t, 5*time.Second, "pool refilled", func() bool { return len(n.rig.Driver.Running()) == 3 })
}

func TestReconcileAdoptsOnlyWhatTheStoreKnows(t *testing.T) {
	// The paused sandbox is paused by a checkpoint: it holds no instance (hot pauses across a
	// restart: hotpause_test.go).
	n := newNode(t, func(c *sandbox.Config) { c.PauseMode = sandbox.PauseCheckpoint })
	tpl := n.build("base")
	keep := n.create(sandbox.CreateRequest{})
	n.write(keep.ID, "/f", "x")
	paused := n.create(sandbox.CreateRequest{})
	if err := n.m.Pause(context.Background(), paused.ID); err != nil {
		t.Fatal(err)
	}
	gone := n.create(sandbox.CreateRequest{})
	n.m.Close()
	n.m = nil
	// While the daemon is down: one sandbox's instance dies, and an instance nobody recorded
	// (a pool instance of the crashed run) is left running with its directory.
	if err := n.rig.Driver.Crash(gone.Runtime.InstanceID, runtime.ExitKilled); err != nil {
		t.Fatal(err)
	}
	orphanDir := filepath.Join(datadir.Sandbox(n.cfg.DataDir, "orphanaaaaaaaaaaaaaa"), "run-abcd")
	os.MkdirAll(orphanDir, 0o700)
	slot, _ := n.rig.Network.Acquire(context.Background(), sandbox.Egress{AllowInternet: true})
	if err := n.rig.Driver.Start(context.Background(), runtime.Spec{ID: "orphanaaaaaaaaaaaaaa-abcd", RootFS: tpl.RootFS, StateDir: orphanDir, NetNSPath: slot.NetNSPath, Args: []string{"/usr/local/bin/envd"}}); err != nil {
		t.Fatal(err)
	}
	n.start()
	if got := n.rig.Driver.Running(); !slices.Equal(got, []string{keep.Runtime.InstanceID}) {
		t.Fatalf("running after reconcile: %v, want only %s", got, keep.Runtime.InstanceID)
	}
	if got := n.rig.Network.InUse(); !slices.Equal(got, []int{keep.Runtime.SlotIndex}) {
		t.Fatalf("slots after reconcile: %v", got)
	}
	if _, err := os.Stat(orphanDir); !os.IsNotExist(err) {
		t.Fatalf("orphan dir still there: %v", err)
	}
	if v, err := n.read(keep.ID, "/f"); err != nil || v != "x" {
		t.Fatalf("adopted sandbox: %q %v", v, err)
	}
	_, err := n.m.Get(context.Background(), gone.ID)
	if !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), "lost") {
		t.Fatalf("dead sandbox after restart: %v", err)
	}
	if _, resumed, err := n.m.Connect(context.Background(), paused.ID, 0); err != nil || !resumed {
		t.Fatalf("resume after restart: %v %v", resumed, err)
	}
}

func TestDeadSandboxIsNoticed(t *testing.T) {
	for _, reason := range []runtime.ExitReason{runtime.ExitKilled, runtime.ExitOOM, runtime.ExitExited} {
		t.Run(string(reason), func(t *testing.T) {
			n := newNode(t, nil)
			n.build("base")
			sb := n.create(sandbox.CreateRequest{})
			n.assertHolds(1)
			n.rig.Driver.Crash(sb.Runtime.InstanceID, reason)
			testutil.Eventually(t, 2*time.Second, "sandbox leaves running", func() bool {
				_, err := n.m.Get(context.Background(), sb.ID)
				return err != nil
			})
			_, err := n.m.Get(context.Background(), sb.ID)
			if !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), string(reason)) {
				t.Fatalf("get: %v, want not found naming %q", err, reason)
			}
			if _, err := n.m.GuestURL(context.Background(), sb.ID, envdclient.Port); !errors.Is(err, errdefs.ErrNotFound) {
				t.Fatalf("guest url of a dead sandbox: %v", err)
			}
			n.assertHolds(0)
			list, _ := n.m.List(context.Background(), sandbox.ListFilter{States: []sandbox.State{sandbox.StateKilled}})
			if len(list) != 1 || list[0].EndReason != string(reason) {
				t.Fatalf("ended sandboxes listed on request: %+v", list)
			}
			if list, _ := n.m.List(context.Background(), sandbox.ListFilter{}); len(list) != 0 {
				t.Fatalf("default listing shows the dead sandbox: %+v", list)
			}
		})
	}
}

func TestPauseResumeKeepsFiles(t *testing.T) {
	n := newNode(t, func(c *sandbox.Config) { c.PauseMode = sandbox.PauseCheckpoint })
	n.build("base")
	sb := n.create(sandbox.CreateRequest{})
	n.write(sb.ID, "/p", "kept")
	if err := n.m.Pause(context.Background(), sb.ID); err != nil {
		t.Fatal(err)
	}
	if err := n.m.Pause(context.Background(), sb.ID); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("second pause: %v", err)
	}
	testutil.Eventually(t, 2*time.Second, "paused sandbox holds nothing", func() bool {
		return len(n.rig.Driver.Running()) == 0 && len(n.rig.Network.InUse()) == 0
	})
	got, resumed, err := n.m.Connect(context.Background(), sb.ID, time.Minute)
	if err != nil || !resumed {
		t.Fatalf("resume: %v %v", resumed, err)
	}
	if got.AccessToken != sb.AccessToken || got.ID != sb.ID {
		t.Fatalf("resume changed identity")
	}
	if v, err := n.read(sb.ID, "/p"); err != nil || v != "kept" {
		t.Fatalf("after resume: %q %v", v, err)
	}
	// A resumed sandbox is watched again.
	n.rig.Driver.Crash(got.Runtime.InstanceID, runtime.ExitOOM)
	testutil.Eventually(t, 2*time.Second, "resumed sandbox's death noticed", func() bool {
		_, err := n.m.Get(context.Background(), sb.ID)
		return err != nil
	})
}

func TestForkChildrenDivergeAndSnapshotRestores(t *testing.T) {
	n := newNode(t, nil)
	n.build("base")
	parent := n.create(sandbox.CreateRequest{})
	n.write(parent.ID, "/x", "parent")
	kids, err := n.m.Fork(context.Background(), parent.ID, 3, 0)
	if err != nil {
		t.Fatal(err)
	}
	ids := map[string]bool{parent.ID: true}
	for _, k := range kids {
		if k.Err != nil {
			t.Fatal(k.Err)
		}
		if ids[k.Sandbox.ID] || k.Sandbox.AccessToken == parent.AccessToken {
			t.Fatalf("child shares identity with another sandbox")
		}
		ids[k.Sandbox.ID] = true
		if v, _ := n.read(k.Sandbox.ID, "/x"); v != "parent" {
			t.Fatalf("child %s sees %q", k.Sandbox.ID, v)
		}
	}
	n.write(kids[0].Sandbox.ID, "/x", "child")
	if v, _ := n.read(parent.ID, "/x"); v != "parent" {
		t.Fatalf("parent sees the child's write: %q", v)
	}
	if v, _ := n.read(kids[1].Sandbox.ID, "/x"); v != "parent" {
		t.Fatalf("sibling sees the child's write: %q", v)
	}
	n.assertHolds(4)
	if _, err := n.m.Fork(context.Background(), parent.ID, 0, 0); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("fork count 0: %v", err)
	}

	snap, err := n.m.Snapshot(context.Background(), parent.ID, "snap1")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := n.m.Snapshot(context.Background(), parent.ID, "snap1"); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("second snapshot of one name: %v", err)
	}
	from := n.create(sandbox.CreateRequest{TemplateID: snap.ID})
	if v, _ := n.read(from.ID, "/x"); v != "parent" {
		t.Fatalf("sandbox from snapshot sees %q", v)
	}
}

func TestConcurrentSnapshotsOfOneNameOneWins(t *testing.T) {
	n := newNode(t, nil)
	n.build("base")
	sb := n.create(sandbox.CreateRequest{})
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			_, errs[i] = n.m.Snapshot(context.Background(), sb.ID, "same")
		}(i)
	}
	wg.Wait()
	ok := 0
	for _, err := range errs {
		if err == nil {
			ok++
		} else if !errors.Is(err, errdefs.ErrConflict) {
			t.Fatalf("snapshot: %v", err)
		}
	}
	if ok != 1 {
		t.Fatalf("%d snapshots of one name succeeded, want 1", ok)
	}
	n.create(sandbox.CreateRequest{TemplateID: "same"})
}

func TestTimeoutKillsOrPauses(t *testing.T) {
	n := newNode(t, nil)
	n.build("base")
	a := n.create(sandbox.CreateRequest{Timeout: time.Second})
	b := n.create(sandbox.CreateRequest{Timeout: time.Second, AutoPause: true})
	testutil.Eventually(t, 5*time.Second, "timeouts handled", func() bool {
		_, errA := n.m.Get(context.Background(), a.ID)
		sbB, _ := n.m.Get(context.Background(), b.ID)
		return errA != nil && sbB != nil && sbB.State == sandbox.StatePaused
	})
	if _, err := n.m.Get(context.Background(), a.ID); !strings.Contains(err.Error(), "timeout") {
		t.Fatalf("timed-out sandbox: %v", err)
	}
}

// TestLaunchFailuresReleaseEverything injects a failure at every step of a launch (and of the
// registration after it) and checks that nothing is left: no instance, no slot, no directory.
func TestLaunchFailuresReleaseEverything(t *testing.T) {
	points := []string{"launch.start", "launch.slot", "launch.runtime", "launch.envd", "register"}
	for _, point := range points {
		t.Run(point, func(t *testing.T) {
			var fail sync.Map
			n := newNode(t, func(c *sandbox.Config) {
				c.Fail = func(p string) error {
					if _, ok := fail.Load(p); ok {
						return errors.New("boom")
					}
					return nil
				}
			})
			n.build("base")
			n.assertHolds(0)
			fail.Store(point, true)
			if _, err := n.m.Create(context.Background(), sandbox.CreateRequest{TemplateID: "base"}); err == nil {
				t.Fatal("create succeeded despite the fault")
			}
			n.assertHolds(0)
			if dirs := n.sandboxDirs(); len(dirs) != 0 {
				t.Fatalf("directories left: %v", dirs)
			}
			if list, _ := n.m.List(context.Background(), sandbox.ListFilter{}); len(list) != 0 {
				t.Fatalf("sandboxes listed: %v", list)
			}
			fail.Delete(point)
			n.create(sandbox.CreateRequest{})
		})
	}
	t.Run("driver restore fails", func(t *testing.T) {
		n := newNode(t, nil)
		n.build("base")
		n.rig.Driver.Fail = func(op, id string) error {
			if op == "Restore" {
				return fmt.Errorf("restore refused: %w", errdefs.ErrUnavailable)
			}
			return nil
		}
		if _, err := n.m.Create(context.Background(), sandbox.CreateRequest{TemplateID: "base"}); !errors.Is(err, errdefs.ErrUnavailable) {
			t.Fatalf("create: %v", err)
		}
		n.assertHolds(0)
	})
	t.Run("no slot", func(t *testing.T) {
		n := newNode(t, nil)
		n.build("base")
		n.rig.Network.FailAcquire = fmt.Errorf("full: %w", errdefs.ErrUnavailable)
		if _, err := n.m.Create(context.Background(), sandbox.CreateRequest{TemplateID: "base"}); !errors.Is(err, errdefs.ErrUnavailable) {
			t.Fatalf("create: %v", err)
		}
		n.assertHolds(0)
	})
}

func TestCloseDrainsAndDestroysPool(t *testing.T) {
	n := newNode(t, func(c *sandbox.Config) { c.PoolSize = 2 })
	n.build("base")
	sb := n.create(sandbox.CreateRequest{NoPool: true})
	testutil.Eventually(t, 5*time.Second, "pool filled", func() bool { return len(n.rig.Driver.Running()) == 3 })
	n.m.Close()
	if got := n.rig.Driver.Running(); !slices.Equal(got, []string{sb.Runtime.InstanceID}) {
		t.Fatalf("after close: %v, want only the sandbox's instance", got)
	}
	if _, err := n.m.Create(context.Background(), sandbox.CreateRequest{TemplateID: "base"}); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("create after close: %v", err)
	}
	n.start()
	if _, err := n.read(sb.ID, "/nothing"); err == nil || strings.Contains(err.Error(), "not running") {
		t.Fatalf("sandbox not adopted after close+start: %v", err)
	}
}

func TestNodeCapacityIsEnforced(t *testing.T) {
	n := newNode(t, func(c *sandbox.Config) { c.MaxSandboxes = 2 })
	n.build("base")
	a := n.create(sandbox.CreateRequest{})
	n.create(sandbox.CreateRequest{})
	if _, err := n.m.Create(context.Background(), sandbox.CreateRequest{TemplateID: "base"}); !errors.Is(err, errdefs.ErrExhausted) {
		t.Fatalf("create over the cap: %v", err)
	}
	if _, err := n.m.Fork(context.Background(), a.ID, 1, 0); !errors.Is(err, errdefs.ErrExhausted) {
		t.Fatalf("fork over the cap: %v", err)
	}
	if err := n.m.Kill(context.Background(), a.ID); err != nil {
		t.Fatal(err)
	}
	n.create(sandbox.CreateRequest{}) // the killed sandbox's place is free again
	n.restart()                       // adopted sandboxes count after a restart
	if _, err := n.m.Create(context.Background(), sandbox.CreateRequest{TemplateID: "base"}); !errors.Is(err, errdefs.ErrExhausted) {
		t.Fatalf("create over the cap after restart: %v", err)
	}
}

func (n *node) putMem(id, key, v string) {
	n.t.Helper()
	if code, msg := n.guest(id, http.MethodPut, "/fake/mem?path="+key, v); code != http.StatusNoContent {
		n.t.Fatalf("put mem: %d %s", code, msg)
	}
}

func TestFilesystemOnlyPauseKeepsFilesNotMemory(t *testing.T) {
	n := newNode(t, nil)
	n.build("base")
	sb := n.create(sandbox.CreateRequest{})
	n.write(sb.ID, "/f", "file")
	n.putMem(sb.ID, "proc", "running")
	if err := n.m.PauseWith(context.Background(), sb.ID, sandbox.PauseOptions{KeepMemory: false}); err != nil {
		t.Fatal(err)
	}
	got, resumed, err := n.m.Connect(context.Background(), sb.ID, time.Minute)
	if err != nil || !resumed {
		t.Fatalf("resume: %v %v", resumed, err)
	}
	if got.AccessToken != sb.AccessToken {
		t.Fatal("a filesystem-only resume changed the access token")
	}
	if v, err := n.read(sb.ID, "/f"); err != nil || v != "file" {
		t.Fatalf("file after resume: %q %v", v, err)
	}
	if code, _ := n.guest(sb.ID, http.MethodGet, "/fake/mem?path=proc", ""); code != http.StatusNotFound {
		t.Fatalf("memory survived a filesystem-only pause (status %d)", code)
	}
	// A memory pause keeps both.
	n.putMem(sb.ID, "proc", "running")
	n.m.Pause(context.Background(), sb.ID)
	n.m.Connect(context.Background(), sb.ID, time.Minute)
	if code, _ := n.guest(sb.ID, http.MethodGet, "/fake/mem?path=proc", ""); code != http.StatusOK {
		t.Fatalf("memory lost by a memory pause (status %d)", code)
	}
	// Reboot drops memory even from a memory pause.
	n.m.Pause(context.Background(), sb.ID)
	if _, _, err := n.m.ConnectWith(context.Background(), sb.ID, sandbox.ConnectOptions{Reboot: true}); err != nil {
		t.Fatal(err)
	}
	if code, _ := n.guest(sb.ID, http.MethodGet, "/fake/mem?path=proc", ""); code != http.StatusNotFound {
		t.Fatalf("memory survived a reboot (status %d)", code)
	}
	if v, _ := n.read(sb.ID, "/f"); v != "file" {
		t.Fatalf("file lost by a reboot: %q", v)
	}
}

func TestLifecycleOptions(t *testing.T) {
	n := newNode(t, nil)
	n.build("base")
	yes, no := true, false
	for _, c := range []struct {
		name string
		req  sandbox.CreateRequest
		msg  string
	}{
		{"keepMemory with kill", sandbox.CreateRequest{AutoPauseMemory: &no}, "keepMemory is only allowed"},
		{"autoResume with kill", sandbox.CreateRequest{AutoResume: &yes}, "autoResume can only be true"},
		{"autoResume without memory", sandbox.CreateRequest{AutoPause: true, AutoPauseMemory: &no, AutoResume: &yes}, "filesystem-only snapshot cannot be auto-resumed"},
	} {
		c.req.TemplateID = "base"
		_, err := n.m.Create(context.Background(), c.req)
		if !errors.Is(err, errdefs.ErrInvalid) || !strings.Contains(err.Error(), c.msg) {
			t.Errorf("%s: %v", c.name, err)
		}
	}
	// onTimeout pause without memory: files kept, memory dropped, only connect wakes it.
	fs := n.create(sandbox.CreateRequest{Timeout: time.Second, AutoPause: true, AutoPauseMemory: &no})
	n.write(fs.ID, "/f", "kept")
	n.putMem(fs.ID, "m", "lost")
	// autoResume: traffic wakes it.
	ar := n.create(sandbox.CreateRequest{Timeout: time.Second, AutoPause: true, AutoResume: &yes})
	n.putMem(ar.ID, "m", "kept")
	// Neither: only connect wakes it.
	plain := n.create(sandbox.CreateRequest{Timeout: time.Second, AutoPause: true, AutoResume: &no})
	testutil.Eventually(t, 5*time.Second, "all three paused", func() bool {
		for _, id := range []string{fs.ID, ar.ID, plain.ID} {
			if sb, err := n.m.Get(context.Background(), id); err != nil || sb.State != sandbox.StatePaused {
				return false
			}
		}
		return true
	})
	if _, err := n.m.GuestURL(context.Background(), plain.ID, 8080); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("traffic to a paused sandbox without autoResume: %v", err)
	}
	if _, err := n.m.GuestURL(context.Background(), fs.ID, 8080); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("traffic to a filesystem-only paused sandbox: %v", err)
	}
	if _, err := n.m.GuestURL(context.Background(), ar.ID, 8080); err != nil {
		t.Fatalf("traffic did not wake the autoResume sandbox: %v", err)
	}
	if code, v := n.guest(ar.ID, http.MethodGet, "/fake/mem?path=m", ""); code != http.StatusOK || v != "kept" {
		t.Fatalf("auto-resumed sandbox lost memory: %d %q", code, v)
	}
	if _, _, err := n.m.Connect(context.Background(), fs.ID, time.Minute); err != nil {
		t.Fatal(err)
	}
	if v, _ := n.read(fs.ID, "/f"); v != "kept" {
		t.Fatalf("files after filesystem-only timeout pause: %q", v)
	}
	if code, _ := n.guest(fs.ID, http.MethodGet, "/fake/mem?path=m", ""); code != http.StatusNotFound {
		t.Fatalf("memory kept by a keepMemory:false pause")
	}
}

func TestPoolFollowsDemandWithinBudget(t *testing.T) {
	n := newNode(t, func(c *sandbox.Config) { c.PoolSize = 1; c.PoolMax = 6 })
	n.build("base")
	testutil.Eventually(t, 5*time.Second, "pool at its minimum", func() bool { return len(n.rig.Driver.Running()) == 1 })
	var ids []string
	for i := 0; i < 30; i++ {
		ids = append(ids, n.create(sandbox.CreateRequest{}).ID)
	}
	st := n.m.Pools(context.Background())
	if len(st) != 1 || st[0].Target <= st[0].Min || st[0].Misses == 0 || st[0].Hits == 0 || st[0].CreateRate <= 0 {
		t.Fatalf("pool state after a burst of creates: %+v", st)
	}
	t.Logf("after 30 creates: %+v", st[0])
	for _, id := range ids {
		n.m.Kill(context.Background(), id)
	}
	testutil.Eventually(t, 5*time.Second, "pool grew past its minimum", func() bool { return len(n.rig.Driver.Running()) > 1 })

	// The memory budget caps the pool whatever the minimum says.
	b := newNode(t, func(c *sandbox.Config) { c.PoolSize = 4; c.PoolMemoryMB = 64; c.PoolInstanceMB = 32 })
	b.build("base")
	testutil.Eventually(t, 5*time.Second, "pool filled to its budget", func() bool { return len(b.rig.Driver.Running()) == 2 })
	time.Sleep(1500 * time.Millisecond)
	if got := len(b.rig.Driver.Running()); got != 2 {
		t.Fatalf("pool of %d instances with a budget for 2", got)
	}
}

// imageStore is the daemon's adapter in small: the real snapshot store on a local backend.
type imageStore struct{ s *snapshot.Store }

func (a imageStore) Save(ctx context.Context, id, dir string) error {
	_, err := a.s.Save(ctx, id, dir)
	return err
}
func (a imageStore) Fetch(ctx context.Context, id, dir string, unpack func(ctx context.Context, src, dst string) error) error {
	return a.s.Fetch(ctx, id, dir, snapshot.FetchImport(unpack))
}
func (a imageStore) Delete(ctx context.Context, id string) error { return a.s.Delete(ctx, id) }
func (a imageStore) Exists(ctx context.Context, id string) (bool, error) {
	_, err := a.s.Stat(ctx, id)
	if errors.Is(err, errdefs.ErrNotFound) {
		return false, nil
	}
	return err == nil, err
}
func (a imageStore) Adopt(ctx context.Context, id, dir string) error { return a.s.Adopt(ctx, id, dir) }
func (a imageStore) Collect(ctx context.Context) error {
	_, err := a.s.GC(ctx)
	return err
}

func TestStoredSnapshotsLoadOnceAndRefuseTampering(t *testing.T) {
	dir := t.TempDir()
	backend, err := local.New(filepath.Join(dir, "snapshots"))
	if err != nil {
		t.Fatal(err)
	}
	key, err := snapshot.LoadOrCreateKey(filepath.Join(dir, "key"))
	if err != nil {
		t.Fatal(err)
	}
	n := newNode(t, func(c *sandbox.Config) { c.Images = imageStore{snapshot.New(backend, snapshot.WithSigningKey(key))} })
	n.build("base")
	src := n.create(sandbox.CreateRequest{})
	n.write(src.ID, "/s", "stored")
	snap1, err := n.m.Snapshot(context.Background(), src.ID, "stored1")
	if err != nil {
		t.Fatal(err)
	}
	// The node's own capture becomes the stored snapshot's local copy; without it (another
	// node, a lost cache) the snapshot loads from the store.
	n.waitSnapshot("stored1", sandbox.SnapshotStoredState)
	os.RemoveAll(snap1.Image)
	imports := n.rig.Driver.Calls("ImportImage")
	var wg sync.WaitGroup
	sbs := make([]*sandbox.Sandbox, 4)
	for i := range sbs {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			sbs[i], _ = n.m.Create(context.Background(), sandbox.CreateRequest{TemplateID: "stored1"})
		}(i)
	}
	wg.Wait()
	for _, sb := range sbs {
		if sb == nil {
			t.Fatal("a create from the stored snapshot failed")
		}
		if v, _ := n.read(sb.ID, "/s"); v != "stored" {
			t.Fatalf("sandbox from stored snapshot sees %q", v)
		}
	}
	if got := n.rig.Driver.Calls("ImportImage") - imports; got != 1 {
		t.Fatalf("4 concurrent creates imported the stored image %d times, want 1", got)
	}

	// A second snapshot whose stored manifest is rewritten by someone with bucket access only.
	snap2, err := n.m.Snapshot(context.Background(), src.ID, "stored2")
	if err != nil {
		t.Fatal(err)
	}
	n.waitSnapshot("stored2", sandbox.SnapshotStoredState)
	os.RemoveAll(snap2.Image)
	var manifests []string
	filepath.Walk(filepath.Join(dir, "snapshots"), func(p string, fi os.FileInfo, err error) error {
		if err == nil && !fi.IsDir() && strings.Contains(p, "stored2") {
			manifests = append(manifests, p)
		}
		return nil
	})
	if len(manifests) == 0 {
		t.Fatal("no stored manifest of stored2 found")
	}
	for _, p := range manifests {
		b, _ := os.ReadFile(p)
		os.WriteFile(p, append(b, []byte("\n")...), 0o600)
	}
	if _, err := n.m.Create(context.Background(), sandbox.CreateRequest{TemplateID: "stored2"}); !errors.Is(err, errdefs.ErrCorrupt) {
		t.Fatalf("create from a tampered stored snapshot: %v", err)
	}
}

// Deleting a snapshot (or template) leaves the sandboxes made from it working: they resume,
// snapshot and fork from the rootfs they recorded.
func TestSandboxOutlivesItsDeletedSnapshot(t *testing.T) {
	n := newNode(t, nil)
	n.build("base")
	src := n.create(sandbox.CreateRequest{})
	n.write(src.ID, "/v", "1")
	if _, err := n.m.Snapshot(context.Background(), src.ID, "gone-snap"); err != nil {
		t.Fatal(err)
	}
	child := n.create(sandbox.CreateRequest{TemplateID: "gone-snap"})
	if err := n.m.DeleteTemplate(context.Background(), "gone-snap"); err != nil {
		t.Fatal(err)
	}
	if _, err := n.m.Snapshot(context.Background(), child.ID, "again"); err != nil {
		t.Fatalf("snapshot of a sandbox whose snapshot was deleted: %v", err)
	}
	if _, err := n.m.Fork(context.Background(), child.ID, 1, 0); err != nil {
		t.Fatalf("fork: %v", err)
	}
	if err := n.m.Pause(context.Background(), child.ID); err != nil {
		t.Fatal(err)
	}
	if _, _, err := n.m.Connect(context.Background(), child.ID, time.Minute); err != nil {
		t.Fatalf("resume: %v", err)
	}
	if v, _ := n.read(child.ID, "/v"); v != "1" {
		t.Fatalf("file after resume: %q", v)
	}
}

// A pause whose checkpoint completed but whose record was not written (the daemon died in
// between) is recovered as paused at the next start, with its files.
func TestPauseCutByCrashIsRecovered(t *testing.T) {
	n := newNode(t, nil)
	n.build("base")
	sb := n.create(sandbox.CreateRequest{})
	n.write(sb.ID, "/p", "kept")
	n.m.Close()
	n.m = nil
	// What pauseLocked had done when the daemon died: the checkpoint, its completion mark.
	image := filepath.Join(datadir.Sandbox(n.cfg.DataDir, sb.ID), "image-abcdef")
	os.MkdirAll(image, 0o700)
	if err := n.rig.Driver.Checkpoint(context.Background(), sb.Runtime.InstanceID, image, runtime.CheckpointOptions{}); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(image, ".ember-complete"), []byte("memory"), 0o600)
	n.start()
	got, err := n.m.Get(context.Background(), sb.ID)
	if err != nil || got.State != sandbox.StatePaused {
		t.Fatalf("after restart: %+v %v, want paused", got, err)
	}
	if _, _, err := n.m.Connect(context.Background(), sb.ID, time.Minute); err != nil {
		t.Fatal(err)
	}
	if v, _ := n.read(sb.ID, "/p"); v != "kept" {
		t.Fatalf("file after recovery: %q", v)
	}
}

func TestPoolShrinksWhenDemandFalls(t *testing.T) {
	n := newNode(t, func(c *sandbox.Config) { c.PoolSize = 1; c.PoolMax = 6; c.PoolDecay = 2 * time.Second })
	n.build("base")
	testutil.Eventually(t, 5*time.Second, "pool at its minimum", func() bool { return len(n.rig.Driver.Running()) == 1 })
	for i := 0; i < 30; i++ {
		n.m.Kill(context.Background(), n.create(sandbox.CreateRequest{}).ID)
	}
	testutil.Eventually(t, 5*time.Second, "pool grew", func() bool { return len(n.rig.Driver.Running()) > 1 })
	// The rate decays with no creates: the pool returns to its minimum.
	testutil.Eventually(t, 30*time.Second, "pool shrank back to its minimum", func() bool { return len(n.rig.Driver.Running()) == 1 })
}

// Templates record the checkpoint format they were built with; one from an older ember is
// stale (the daemon rebuilds the templates it serves at start).
func TestTemplatesRecordTheirFormat(t *testing.T) {
	n := newNode(t, nil)
	tpl := n.build("base")
	if tpl.Format != sandbox.TemplateFormat || tpl.Stale() {
		t.Fatalf("new template: format %d stale %v", tpl.Format, tpl.Stale())
	}
	old := *tpl
	old.Format = 0
	if !old.Stale() {
		t.Fatal("a template without a format (an older ember's) is not stale")
	}
	snap := sandbox.Template{Kind: "snapshot"}
	if snap.Stale() {
		t.Fatal("snapshots are not rebuilt")
	}
}

// A pool refill that finishes after its template was deleted does not keep its instance (nor,
// through its mount, the template's layers): the pool destroys it.
func TestPoolDropsARefillOfADeletedTemplate(t *testing.T) {
	n := newNode(t, func(c *sandbox.Config) { c.PoolSize = 1 })
	restoring := make(chan struct{}, 1)
	release := make(chan struct{})
	var once sync.Once
	var restores atomic.Int32
	n.rig.Driver.Fail = func(op, id string) error {
		// The first restore is the build's own check of its image; the next is the pool's.
		if op == "Restore" && restores.Add(1) == 2 {
			once.Do(func() {
				restoring <- struct{}{}
				<-release
			})
		}
		return nil
	}
	n.build("t1")
	select {
	case <-restoring:
	case <-time.After(5 * time.Second):
		t.Fatal("the pool did not start a refill")
	}
	if err := n.m.DeleteTemplate(context.Background(), "t1"); err != nil {
		t.Fatal(err)
	}
	close(release)
	testutil.Eventually(t, 5*time.Second, "the late refill done", func() bool {
		for _, ps := range n.m.Pools(context.Background()) {
			if ps.Refilling {
				return false
			}
		}
		return true
	})
	testutil.Eventually(t, 10*time.Second, "the late refill's instance destroyed", func() bool { return len(n.rig.Driver.Running()) == 0 })
}

// An upload that a crash interrupted is removed at start; finished imports stay.
func TestRestartRemovesUnfinishedUploads(t *testing.T) {
	n := newNode(t, nil)
	name, _, err := n.b.ImportArchive(context.Background(), "", strings.NewReader("archive"))
	if err != nil {
		t.Fatal(err)
	}
	partial := filepath.Join(datadir.Imports(n.cfg.DataDir), ".upload-123")
	os.WriteFile(partial, []byte("half"), 0o600)
	n.restart()
	if _, err := os.Stat(partial); err == nil {
		t.Error("an unfinished upload survived the restart")
	}
	if _, err := os.Stat(filepath.Join(datadir.Imports(n.cfg.DataDir), name)); err != nil {
		t.Errorf("a finished import was removed: %v", err)
	}
}

// With MaxStarting, no more instances boot or restore at once than it says: a create waits for
// the one starting, then starts; a create that gives up while waiting leaves nothing.
func TestMaxStartingBoundsInstancesStartingAtOnce(t *testing.T) {
	n := newNode(t, func(c *sandbox.Config) { c.MaxStarting = 1 })
	n.build("base")
	entered := make(chan struct{}, 4)
	release := make(chan struct{})
	var hold atomic.Bool
	hold.Store(true)
	n.rig.Driver.Fail = func(op, id string) error {
		if (op == "Restore" || op == "Start") && hold.Load() {
			entered <- struct{}{}
			<-release
		}
		return nil
	}
	done := make(chan error, 1)
	go func() {
		_, err := n.m.Create(context.Background(), sandbox.CreateRequest{TemplateID: "base"})
		done <- err
	}()
	<-entered
	// A second create cannot reach the runtime while the first one starts; one that gives up
	// says why.
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if _, err := n.m.Create(ctx, sandbox.CreateRequest{TemplateID: "base"}); err == nil || !strings.Contains(err.Error(), "starting") {
		t.Fatalf("a second create while the first starts: %v; want it to wait and give up", err)
	}
	select {
	case <-entered:
		t.Fatal("two instances started at once with MaxStarting 1")
	default:
	}
	hold.Store(false)
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	n.create(sandbox.CreateRequest{})
	if got := len(n.rig.Driver.Running()); got != 2 {
		t.Fatalf("%d instances run; want the 2 created", got)
	}
}
