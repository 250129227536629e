package sandbox

import (
	"errors"
	"testing"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

func TestValidateVolumeMounts(t *testing.T) {
	ok := func(p string) VolumeMount { return VolumeMount{Name: "v", Path: p, ID: "i", HostDir: "/h"} }
	if err := ValidateVolumeMounts([]VolumeMount{ok("/mnt/a"), ok("/data")}); err != nil {
		t.Fatal(err)
	}
	for _, bad := range [][]VolumeMount{
		{ok("relative")}, {ok("/")}, {ok("/a/../b")}, {ok("/a/")}, {ok("/proc")}, {ok("/dev/x")},
		{ok("/sys/fs")}, {ok("/a"), ok("/a")}, {{Path: "/a"}},
	} {
		if err := ValidateVolumeMounts(bad); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%+v: %v, want invalid", bad, err)
		}
	}
}

func TestMountsForSnapshot(t *testing.T) {
	src := []VolumeMount{{Name: "v", Path: "/mnt/v", ID: "id1", HostDir: "/h"}}
	snap := &Template{ID: "snap", Kind: "snapshot", VolumeMounts: src}
	got, err := mountsFor(snap, nil)
	if err != nil || len(got) != 1 || got[0] != src[0] {
		t.Fatalf("default mounts of a snapshot: %+v %v", got, err)
	}
	if _, err := mountsFor(snap, src); err != nil {
		t.Fatalf("the same mounts: %v", err)
	}
	other := []VolumeMount{{Name: "v", Path: "/elsewhere", ID: "id1", HostDir: "/h"}}
	if _, err := mountsFor(snap, other); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("other mounts: %v, want invalid", err)
	}
	tpl := &Template{ID: "base", Kind: "template"}
	if got, _ := mountsFor(tpl, other); len(got) != 1 {
		t.Fatalf("a template takes any mounts: %+v", got)
	}
	if got, _ := mountsFor(&Template{Kind: "snapshot"}, nil); len(got) != 0 {
		t.Fatalf("a snapshot without volumes: %+v", got)
	}
}

// A sandbox recorded on another node (a fork child, a moved paused sandbox) mounts its volumes
// at this node's directory of each, when the node says where (Config.VolumeDir).
func TestBindsOnThisNode(t *testing.T) {
	mounts := []VolumeMount{{Name: "v", Path: "/mnt/v", ID: "id1", HostDir: "/other-node/volumes/id1"}}
	if b := binds(mounts, nil); len(b) != 1 || b[0].Source != "/other-node/volumes/id1" || b[0].Path != "/mnt/v" || b[0].Remote {
		t.Fatalf("binds without VolumeDir: %+v", b)
	}
	here := func(id string) string { return "/this-node/volumes/" + id }
	if b := binds(mounts, here); len(b) != 1 || b[0].Source != "/this-node/volumes/id1" || b[0].Path != "/mnt/v" || !b[0].Remote {
		t.Fatalf("binds with VolumeDir: %+v", b)
	}
}
