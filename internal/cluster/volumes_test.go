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
		return slices.Equal(b.VolumeUsers("vol1"), []string{"sx"})
	})
	if u := b.VolumeUsers("other"); len(u) != 0 {
		t.Fatalf("users of another volume: %v", u)
	}
	a.Release(ctx, "sx")
	testutil.Eventually(t, 5*time.Second, "vol1 has no users once sx is released", func() bool {
		return len(b.VolumeUsers("vol1")) == 0
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
