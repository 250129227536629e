package sandbox_test

import (
	"context"
	"errors"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/datadir"
	"github.com/ember-sandbox/ember/internal/envdclient"

	"github.com/ember-sandbox/ember/internal/sandbox"
)

// A snapshot does not carry the live sandbox's envd token: its image's envd holds a token of
// the snapshot's own (its InitToken), the source sandbox keeps its own token afterwards, and
// sandboxes from the snapshot start (their /init authenticates with the snapshot's token).
func TestSnapshotHasItsOwnToken(t *testing.T) {
	n := newNode(t, nil)
	n.build("base")
	src := n.create(sandbox.CreateRequest{})
	n.write(src.ID, "/x", "before")
	var imageToken string
	n.rig.Driver.Fail = func(op, id string) error {
		if op == "Checkpoint" {
			imageToken = n.rig.Driver.Token(id)
		}
		return nil
	}
	snap, err := n.m.Snapshot(context.Background(), src.ID, "own-token")
	if err != nil {
		t.Fatal(err)
	}
	n.rig.Driver.Fail = nil
	if snap.InitToken == "" || snap.InitToken == src.AccessToken {
		t.Fatalf("snapshot init token %q, source's %q: want a token of its own", snap.InitToken, src.AccessToken)
	}
	if imageToken != snap.InitToken {
		t.Fatalf("envd held %q at the checkpoint, want the snapshot's %q", imageToken, snap.InitToken)
	}
	// The source answers with its own token again.
	if v, err := n.read(src.ID, "/x"); err != nil || v != "before" {
		t.Fatalf("source after the snapshot: %q %v", v, err)
	}
	got, err := n.m.Get(context.Background(), src.ID)
	if err != nil || got.AccessToken != src.AccessToken {
		t.Fatalf("source token changed: %v", err)
	}
	from := n.create(sandbox.CreateRequest{TemplateID: snap.ID})
	if v, err := n.read(from.ID, "/x"); err != nil || v != "before" {
		t.Fatalf("sandbox from the snapshot reads %q %v", v, err)
	}
	if from.AccessToken == snap.InitToken || from.AccessToken == src.AccessToken {
		t.Fatal("the sandbox from the snapshot shares a token")
	}
}

// A daemon killed between the two /init calls of a snapshot's token swap (envd holds the
// snapshot's token) gives the sandbox its own token back at its next start: its clients are
// not locked out. The state the crash leaves is made by hand: the swap marker, and envd
// re-inited with the snapshot's token.
func TestTokenSwapCutByCrashIsUndone(t *testing.T) {
	n := newNode(t, nil)
	n.build("base")
	sb := n.create(sandbox.CreateRequest{})
	n.write(sb.ID, "/x", "kept")
	const snapToken = "0123456789abcdef0123456789abcdef"
	base, err := n.m.GuestURL(context.Background(), sb.ID, envdclient.Port)
	if err != nil {
		t.Fatal(err)
	}
	req, _ := http.NewRequest(http.MethodPost, base+"/init", strings.NewReader(`{"accessToken":"`+snapToken+`"}`))
	req.Header.Set("X-Access-Token", sb.AccessToken)
	resp, err := (&http.Client{Transport: n.m.GuestTransport(), Timeout: 5 * time.Second}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode/100 != 2 || n.rig.Driver.Token(sb.Runtime.InstanceID) != snapToken {
		t.Fatalf("/init with the snapshot's token: %d", resp.StatusCode)
	}
	if _, err := n.read(sb.ID, "/x"); err == nil {
		t.Fatal("the sandbox's own token still works: the crash state was not made")
	}
	n.m.Close()
	n.m = nil
	os.WriteFile(filepath.Join(datadir.Sandbox(n.cfg.DataDir, sb.ID), ".ember-token-swap"), []byte(snapToken), 0o600)
	n.start()
	if v, err := n.read(sb.ID, "/x"); err != nil || v != "kept" {
		t.Fatalf("after the restart the sandbox answers %q %v, want its file with its own token", v, err)
	}
	if _, err := os.Stat(filepath.Join(datadir.Sandbox(n.cfg.DataDir, sb.ID), ".ember-token-swap")); !os.IsNotExist(err) {
		t.Fatalf("the swap marker is still there: %v", err)
	}
}

// A step checkpoint's image holds a token of its own too: a snapshot promoted from it carries
// no live token, and a rollback to it, its standby and a fork of it all still start (the
// sandbox answers with its own token, the children with theirs).
func TestCheckpointHasItsOwnToken(t *testing.T) {
	n := newNode(t, nil)
	n.build("base")
	ctx := context.Background()
	src := n.create(sandbox.CreateRequest{})
	n.write(src.ID, "/x", "at the checkpoint")
	ck, err := n.m.Checkpoint(ctx, src.ID)
	if err != nil {
		t.Fatal(err)
	}
	n.write(src.ID, "/x", "after")
	if v, err := n.read(src.ID, "/x"); err != nil || v != "after" {
		t.Fatalf("source after its checkpoint: %q %v", v, err)
	}
	snap, err := n.m.SnapshotCheckpoint(ctx, src.ID, ck.ID, "from-ckpt")
	if err != nil {
		t.Fatal(err)
	}
	if snap.InitToken == "" || snap.InitToken == src.AccessToken {
		t.Fatalf("promoted snapshot's init token %q, the sandbox's %q: want one of its own", snap.InitToken, src.AccessToken)
	}
	from := n.create(sandbox.CreateRequest{TemplateID: snap.ID})
	if v, err := n.read(from.ID, "/x"); err != nil || v != "at the checkpoint" {
		t.Fatalf("sandbox from the promoted snapshot reads %q %v", v, err)
	}
	kids, err := n.m.ForkCheckpoint(ctx, src.ID, ck.ID, 1, 0)
	if err != nil || len(kids) != 1 || kids[0].Err != nil {
		t.Fatalf("fork of the checkpoint: %+v %v", kids, err)
	}
	if v, err := n.read(kids[0].Sandbox.ID, "/x"); err != nil || v != "at the checkpoint" {
		t.Fatalf("child of the checkpoint reads %q %v", v, err)
	}
	for i := 0; i < 2; i++ { // the second rollback may meet the standby (restored ahead)
		if _, err := n.m.Rollback(ctx, src.ID, ck.ID); err != nil {
			t.Fatal(err)
		}
		if v, err := n.read(src.ID, "/x"); err != nil || v != "at the checkpoint" {
			t.Fatalf("rollback %d: the sandbox reads %q %v (with its own token)", i, v, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// A rollback without a standby sends the restored instance's /init alongside the sandbox's
// record (rollbackinit.go). When that /init fails, the rollback fails as a whole: the sandbox
// runs on where it was, with its files, its own token and its record (a restart of the daemon
// finds it there), and no token swap marker is left behind.
func TestRollbackInitFailureKeepsTheSandbox(t *testing.T) {
	var failInit atomic.Bool
	n := newNode(t, func(c *sandbox.Config) {
		c.Fail = func(p string) error {
			if p == "rollback.init" && failInit.Load() {
				return errors.New("boom")
			}
			return nil
		}
	})
	n.m.CheckpointStandby(false) // every rollback restores
	n.build("base")
	ctx := context.Background()
	sb := n.create(sandbox.CreateRequest{})
	n.write(sb.ID, "/x", "at the checkpoint")
	ck, err := n.m.Checkpoint(ctx, sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	n.write(sb.ID, "/x", "after")
	before, _ := n.m.Get(ctx, sb.ID)
	failInit.Store(true)
	if _, err := n.m.Rollback(ctx, sb.ID, ck.ID); err == nil {
		t.Fatal("the rollback succeeded although its /init failed")
	}
	n.settleHolds(1)
	marker := filepath.Join(n.cfg.DataDir, "sandboxes", sb.ID, ".ember-token-swap")
	if _, err := os.Stat(marker); !os.IsNotExist(err) {
		t.Fatalf("token swap marker after the failed rollback: %v", err)
	}
	n.m.Close()
	n.m = nil
	n.start()
	got, err := n.m.Get(ctx, sb.ID)
	if err != nil || got.Runtime.InstanceID != before.Runtime.InstanceID || got.State != sandbox.StateRunning {
		t.Fatalf("after the failed rollback and a restart: %+v %v, want running on %s", got, err, before.Runtime.InstanceID)
	}
	if v, err := n.read(sb.ID, "/x"); err != nil || v != "after" {
		t.Fatalf("after the failed rollback the sandbox reads %q %v", v, err)
	}
	failInit.Store(false)
	if _, err := n.m.Rollback(ctx, sb.ID, ck.ID); err != nil {
		t.Fatal(err)
	}
	if v, err := n.read(sb.ID, "/x"); err != nil || v != "at the checkpoint" {
		t.Fatalf("after the rollback the sandbox reads %q %v (with its own token)", v, err)
	}
	if _, err := os.Stat(marker); !os.IsNotExist(err) {
		t.Fatalf("token swap marker after the rollback: %v", err)
	}
}
