package sandbox_test

import (
	"context"
	"errors"
	"github.com/ember-sandbox/ember/internal/testutil"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/envdclient"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/sandbox/sandboxtest"
	"github.com/ember-sandbox/ember/internal/snapshot"
	"github.com/ember-sandbox/ember/internal/snapshot/local"
)

// recorder is a lifecycle listener that keeps what it is told.
type recorder struct {
	mu     sync.Mutex
	evs    []sandbox.Event
	refuse func(sandbox.Event) error
}

func (r *recorder) Changed(_ context.Context, ev sandbox.Event) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.evs = append(r.evs, ev)
	if r.refuse != nil {
		return r.refuse(ev)
	}
	return nil
}

// of lists the events of sandbox id as "kind" or "kind:reason".
func (r *recorder) of(id string) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, ev := range r.evs {
		if ev.Sandbox == nil || ev.Sandbox.ID != id {
			continue
		}
		s := ev.Kind.String()
		if ev.Reason != "" {
			s += ":" + ev.Reason
		}
		out = append(out, s)
	}
	return out
}

// templates lists the template events as "kind:id".
func (r *recorder) templates() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, ev := range r.evs {
		if ev.Template != nil {
			out = append(out, ev.Kind.String()+":"+ev.Template.ID)
		}
	}
	return out
}

func (r *recorder) want(t *testing.T, id string, want ...string) {
	t.Helper()
	if got := r.of(id); !slices.Equal(got, want) {
		t.Fatalf("events of %s: %v, want %v", id, got, want)
	}
}

func (r *recorder) eventually(t *testing.T, id string, want ...string) {
	t.Helper()
	testutil.Eventually(t, 5*time.Second, "events "+strings.Join(want, " "), func() bool { return slices.Equal(r.of(id), want) })
	time.Sleep(50 * time.Millisecond) // and no more
	r.want(t, id, want...)
}

// Every transition raises its event exactly once, whoever made it: API calls, the reaper (a
// timeout's kill, an auto-pause), traffic waking an autoResume sandbox, a dead instance, the
// start-up reconcile; templates ready and gone.
func TestEventsReportEveryTransitionOnce(t *testing.T) {
	rec := &recorder{}
	n := newNode(t, func(c *sandbox.Config) { c.Listeners = []sandbox.Listener{rec} })
	ctx := context.Background()
	n.build("base")
	testutil.Eventually(t, 5*time.Second, "template ready reported", func() bool { return slices.Equal(rec.templates(), []string{"template-ready:base"}) })

	// API: create, pause, resume, kill.
	sb := n.create(sandbox.CreateRequest{})
	rec.want(t, sb.ID, "started:created")
	if err := n.m.Pause(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	rec.want(t, sb.ID, "started:created", "paused")
	if _, resumed, err := n.m.Connect(ctx, sb.ID, time.Minute); err != nil || !resumed {
		t.Fatalf("resume: %v %v", resumed, err)
	}
	rec.want(t, sb.ID, "started:created", "paused", "resumed")
	if _, _, err := n.m.Connect(ctx, sb.ID, time.Minute); err != nil {
		t.Fatal(err)
	}
	rec.want(t, sb.ID, "started:created", "paused", "resumed") // extending a running one changes nothing

	// A fork's children start.
	res, err := n.m.Fork(ctx, sb.ID, 2, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range res {
		rec.want(t, r.Sandbox.ID, "started:forked")
	}
	if err := n.m.Kill(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	rec.want(t, sb.ID, "started:created", "paused", "resumed", "ended:"+sandbox.EndKilled)

	// The reaper: a timeout's kill, an auto-pause that traffic undoes.
	yes := true
	killed := n.create(sandbox.CreateRequest{Timeout: time.Second})
	woken := n.create(sandbox.CreateRequest{Timeout: time.Second, AutoPause: true, AutoResume: &yes})
	rec.eventually(t, killed.ID, "started:created", "ended:"+sandbox.EndTimeout)
	rec.eventually(t, woken.ID, "started:created", "paused")
	if _, err := n.m.GuestURL(ctx, woken.ID, envdclient.Port); err != nil {
		t.Fatalf("traffic did not wake it: %v", err)
	}
	rec.want(t, woken.ID, "started:created", "paused", "resumed")
	if _, err := n.m.GuestURL(ctx, woken.ID, envdclient.Port); err != nil {
		t.Fatal(err)
	}
	rec.want(t, woken.ID, "started:created", "paused", "resumed")
	if err := n.m.SetTimeout(ctx, woken.ID, time.Hour); err != nil {
		t.Fatal(err)
	}

	// An instance that dies.
	dead := n.create(sandbox.CreateRequest{})
	if err := n.rig.Driver.Crash(dead.Runtime.InstanceID, runtime.ExitOOM); err != nil {
		t.Fatal(err)
	}
	rec.eventually(t, dead.ID, "started:created", "ended:"+string(runtime.ExitOOM))

	// The start-up reconcile: a running sandbox adopted, one whose instance died meanwhile lost.
	lost := n.create(sandbox.CreateRequest{Timeout: time.Hour})
	n.m.Close()
	n.m = nil
	if err := n.rig.Driver.Crash(lost.Runtime.InstanceID, runtime.ExitKilled); err != nil {
		t.Fatal(err)
	}
	rec2 := &recorder{}
	n.cfg.Listeners = []sandbox.Listener{rec2}
	n.start()
	rec2.want(t, woken.ID, "started:"+sandbox.StartAdopted)
	rec2.want(t, lost.ID, "ended:"+sandbox.EndLost)
	rec.want(t, lost.ID, "started:created") // the closed Manager said nothing more

	// Templates gone.
	if err := n.m.DeleteTemplate(ctx, "base"); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 5*time.Second, "template gone reported", func() bool { return slices.Equal(rec2.templates(), []string{"template-gone:base"}) })
}

// A listener that refuses a start (the cluster could not route it here) ends the sandbox and
// fails the operation: a create, and traffic waking a paused sandbox.
func TestRefusedStartEndsTheSandbox(t *testing.T) {
	refused := errors.New("not routed here")
	var refuse sync.Map // event kinds to refuse
	rec := &recorder{refuse: func(ev sandbox.Event) error {
		if _, ok := refuse.Load(ev.Kind); ok {
			return refused
		}
		return nil
	}}
	n := newNode(t, func(c *sandbox.Config) { c.Listeners = []sandbox.Listener{rec} })
	ctx := context.Background()
	n.build("base")

	refuse.Store(sandbox.EventStarted, true)
	if _, err := n.m.Create(ctx, sandbox.CreateRequest{TemplateID: "base", Reservation: "r1"}); !errors.Is(err, refused) {
		t.Fatalf("create refused by the listener: %v", err)
	}
	rec.mu.Lock()
	first := rec.evs[len(rec.evs)-2]
	rec.mu.Unlock()
	if first.Kind != sandbox.EventStarted || first.Reservation != "r1" {
		t.Fatalf("the start told: %+v", first)
	}
	rec.want(t, first.Sandbox.ID, "started:created", "ended:"+sandbox.EndKilled)
	n.assertHolds(0)
	refuse.Delete(sandbox.EventStarted)

	yes := true
	sb := n.create(sandbox.CreateRequest{AutoPause: true, AutoResume: &yes})
	if err := n.m.Pause(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	refuse.Store(sandbox.EventResumed, true)
	if _, err := n.m.GuestURL(ctx, sb.ID, envdclient.Port); !errors.Is(err, refused) {
		t.Fatalf("wake refused by the listener: %v", err)
	}
	rec.want(t, sb.ID, "started:created", "paused", "resumed", "ended:"+sandbox.EndKilled)
	if _, err := n.m.Get(ctx, sb.ID); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("the refused sandbox: %v", err)
	}
	testutil.Eventually(t, 2*time.Second, "nothing held", func() bool { return len(n.rig.Driver.Running()) == 0 })
}

// porter is the fake driver with layers that move between nodes (as archives of nothing).
type porter struct{ *sandboxtest.Driver }

func (p porter) ExportTree(_ context.Context, _, dst string) error {
	return os.WriteFile(dst, nil, 0o600)
}

func (p porter) ImportTree(_ context.Context, _, dir string, _ runtime.ImportOptions) (string, error) {
	return dir, os.MkdirAll(dir, 0o700)
}

// With StorePauses a memory pause answers once its image is in the image store, and says so.
func TestStoredPauseIsReportedBeforeThePauseAnswers(t *testing.T) {
	dir := t.TempDir()
	backend, err := local.New(filepath.Join(dir, "snapshots"))
	if err != nil {
		t.Fatal(err)
	}
	rec := &recorder{}
	n := newNode(t, func(c *sandbox.Config) {
		c.Images = imageStore{snapshot.New(backend)}
		c.StorePauses = true
		c.Listeners = []sandbox.Listener{rec}
		c.Driver = porter{c.Driver.(*sandboxtest.Driver)}
	})
	ctx := context.Background()
	n.build("base")
	sb := n.create(sandbox.CreateRequest{})
	if err := n.m.Pause(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	rec.want(t, sb.ID, "started:created", "paused", "stored")
	rec.mu.Lock()
	st := rec.evs[len(rec.evs)-1].Stored
	rec.mu.Unlock()
	if st == nil || st.ImageID == "" || st.Sandbox.ID != sb.ID {
		t.Fatalf("stored event: %+v", st)
	}
	if ok, err := n.cfg.Images.Exists(ctx, st.ImageID); err != nil || !ok {
		t.Fatalf("the stored pause image is not in the store: %v %v", ok, err)
	}
}
