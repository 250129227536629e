package cluster_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/testutil"
	"github.com/ember-sandbox/ember/internal/volume"
)

// A volume recorded through one node is read, listed and deleted through another; its record
// is sealed in etcd (the token is not there in clear); a sandbox that mounts it, on any node,
// is among its users until it is released.
func TestVolumesAcrossNodes(t *testing.T) {
	e, _, a, la, b, _ := sealedPair(t)
	ctx := context.Background()

	v := &volume.Volume{ID: "vol1", Name: "data", Token: "vol_secret-token", SizeMB: 64, CreatedAt: time.Now().UTC().Round(0)}
	if err := a.Volumes().PutVolume(ctx, v); err != nil {
		t.Fatal(err)
	}
	if err := b.Volumes().PutVolume(ctx, &volume.Volume{ID: "vol2", Name: "data"}); !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "already exists") {
		t.Fatalf("a second volume named data through b: %v, want a conflict", err)
	}
	got, err := b.Volumes().GetVolume(ctx, "vol1")
	if err != nil || *got != *v {
		t.Fatalf("get through b: %+v %v, want %+v", got, err, v)
	}
	if vs, err := b.Volumes().ListVolumes(ctx); err != nil || len(vs) != 1 || vs[0].Token != v.Token {
		t.Fatalf("list through b: %+v %v", vs, err)
	}
	cli := e.Client(t)
	r, err := cli.Get(ctx, "/ember/volumes/", clientv3.WithPrefix())
	if err != nil || len(r.Kvs) != 1 || strings.Contains(string(r.Kvs[0].Value), v.Token) {
		t.Fatalf("the record in etcd: %v %v (the token must be sealed)", r, err)
	}

	s := la.add("sx")
	s.Volumes = []string{"vol1"}
	if err := a.Claim(ctx, s, ""); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 5*time.Second, "b sees a's sandbox among vol1's users", func() bool {
		u, err := b.VolumeUsers(ctx, "vol1")
		return err == nil && slices.Equal(u, []string{"sx"})
	})
	if u, err := b.VolumeUsers(ctx, "other"); err != nil || len(u) != 0 {
		t.Fatalf("users of another volume: %v", u)
	}
	a.Release(ctx, "sx")
	testutil.Eventually(t, 5*time.Second, "vol1 has no users once sx is released", func() bool {
		u, err := b.VolumeUsers(ctx, "vol1")
		return err == nil && len(u) == 0
	})

	if err := b.Volumes().DeleteVolume(ctx, "vol1"); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Volumes().GetVolume(ctx, "vol1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("get after delete: %v, want not found", err)
	}
	if err := a.Volumes().PutVolume(ctx, &volume.Volume{ID: "vol3", Name: "data"}); err != nil {
		t.Fatalf("the name again once deleted: %v", err)
	}
}

// A destroy through one node that read the volume's users before a create on another node
// wrote its route is refused (issue 22): the create claims the volume in etcd before its route
// and the destroy deletes only if nothing claimed it since it read the users. A claim held by a
// create in flight refuses a destroy on any node, and a create after the destroy is refused.
func TestVolumeDestroyRacingCreateOnAnotherNode(t *testing.T) {
	e, _, a, la, b, _ := sealedPair(t)
	ctx := context.Background()
	shared := t.TempDir()
	open := func(store volume.Store, users volume.UsersFunc) *volume.Manager {
		m, err := volume.Open(ctx, volume.Config{Dir: t.TempDir(), Store: store, Shared: shared, Users: users})
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	ma := open(a.Volumes(), a.VolumeUsers)
	var meanwhile func() // runs once right after b's destroy read the users
	mb := open(b.Volumes(), func(ctx context.Context, id string) ([]string, error) {
		u, err := b.VolumeUsers(ctx, id)
		if f := meanwhile; f != nil {
			meanwhile = nil
			f()
		}
		return u, err
	})
	if _, err := ma.Create(ctx, "", "data"); err != nil {
		t.Fatal(err)
	}

	// A sandbox is created on a (volume resolved, route written, resolve released) between b's
	// read of the users and its delete.
	meanwhile = func() {
		id, _, release, err := ma.Resolve(ctx, "", "data")
		if err != nil {
			t.Errorf("resolve on a: %v", err)
			return
		}
		s := la.add("sx")
		s.Volumes = []string{id}
		if err := a.Claim(ctx, s, ""); err != nil {
			t.Error(err)
		}
		release()
	}
	if err := mb.Destroy(ctx, "", "data"); !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "is in use") {
		t.Fatalf("destroy through b racing a create on a: %v, want in use", err)
	}
	if _, err := mb.Get(ctx, "", "data"); err != nil {
		t.Fatalf("the volume after the refused destroy: %v", err)
	}
	if err := mb.Destroy(ctx, "", "data"); !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "sandbox sx") {
		t.Fatalf("destroy through b while sx mounts it: %v", err)
	}
	a.Release(ctx, "sx")

	// A create in flight on a (resolved, no route yet) refuses a destroy through b.
	_, _, release, err := ma.Resolve(ctx, "", "data")
	if err != nil {
		t.Fatal(err)
	}
	if err := mb.Destroy(ctx, "", "data"); !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "being created") {
		t.Fatalf("destroy through b while a create on a holds the volume: %v", err)
	}
	release()

	testutil.Eventually(t, 5*time.Second, "destroy through b once nothing mounts the volume", func() bool {
		return mb.Destroy(ctx, "", "data") == nil
	})
	if _, _, _, err := ma.Resolve(ctx, "", "data"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("resolve on a after the destroy: %v, want not found", err)
	}
	if r, err := e.Client(t).Get(ctx, "/ember/volclaims/", clientv3.WithPrefix(), clientv3.WithCountOnly()); err != nil || r.Count != 0 {
		t.Fatalf("claims left in etcd: %v %v", r, err)
	}
}

// One node holds the volumes' disk limits: another is refused, and letting go (a restart
// without --volume-limit-dir) drops only a node's own registration; a volume is marked limited
// only while it exists, and the mark goes with it.
func TestVolumeLimitHolder(t *testing.T) {
	_, _, a, _, b, _ := sealedPair(t)
	ctx := context.Background()
	va, vb := a.Volumes().(volume.LimitStore), b.Volumes().(volume.LimitStore)
	if held, err := vb.LimitHeld(ctx); err != nil || held {
		t.Fatalf("held before any node holds: %v %v", held, err)
	}
	if err := va.HoldLimits(ctx); err != nil {
		t.Fatal(err)
	}
	if err := va.HoldLimits(ctx); err != nil {
		t.Fatalf("a again (a restart): %v", err)
	}
	if err := vb.HoldLimits(ctx); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("b while a holds: %v, want a conflict", err)
	}
	if err := vb.LetGoLimits(ctx); err != nil {
		t.Fatal(err)
	}
	if held, err := vb.LimitHeld(ctx); err != nil || !held {
		t.Fatalf("b's let-go dropped a's registration: %v %v", held, err)
	}
	if err := va.MarkLimited(ctx, "nope"); err != nil {
		t.Fatal(err)
	}
	if ok, _ := vb.Limited(ctx, "nope"); ok {
		t.Fatal("a missing volume marked limited")
	}
	if err := a.Volumes().PutVolume(ctx, &volume.Volume{ID: "v1", Name: "x"}); err != nil {
		t.Fatal(err)
	}
	if err := va.MarkLimited(ctx, "v1"); err != nil {
		t.Fatal(err)
	}
	if ok, _ := vb.Limited(ctx, "v1"); !ok {
		t.Fatal("v1 not limited through b")
	}
	if err := b.Volumes().DeleteVolume(ctx, "v1"); err != nil {
		t.Fatal(err)
	}
	if ok, _ := vb.Limited(ctx, "v1"); ok {
		t.Fatal("the mark outlived the volume")
	}
	if err := va.LetGoLimits(ctx); err != nil {
		t.Fatal(err)
	}
	if held, _ := vb.LimitHeld(ctx); held {
		t.Fatal("held after the holder let go")
	}
}
