package gvisor

import (
	"log/slog"
	"slices"
	"testing"

	"github.com/ember-sandbox/ember/internal/runtime"
)

// Volumes are read-write bind mounts after the fixed mounts, so an instance without volumes
// has the same spec mounts as before (its checkpoints restore as they did).
func TestSpecBinds(t *testing.T) {
	d := &Driver{cfg: Config{Overlay: OverlayHost, IgnoreCgroups: true}, log: slog.Default()}
	s := runtime.Spec{ID: "x", RootFS: "/r", Args: []string{"/envd"}}
	plain := d.ociSpec(s)
	s.Binds = []runtime.Bind{{Source: "/host/vol", Path: "/mnt/v"}}
	sp := d.ociSpec(s)
	if len(sp.Mounts) != len(plain.Mounts)+1 {
		t.Fatalf("mounts %d, want %d", len(sp.Mounts), len(plain.Mounts)+1)
	}
	m := sp.Mounts[len(sp.Mounts)-1]
	if m.Destination != "/mnt/v" || m.Source != "/host/vol" || m.Type != "bind" {
		t.Fatalf("bind mount %+v", m)
	}
	rw := false
	for _, o := range m.Options {
		if o == "ro" {
			t.Fatalf("volume mounted read-only: %v", m.Options)
		}
		rw = rw || o == "rw"
	}
	if !rw {
		t.Fatalf("volume options %v: want rw", m.Options)
	}
}

// A volume of a filesystem shared with other hosts (Bind.Remote) gives each guest open a host
// file of its own and caches no dentry (gVisor's disable_file_handle_sharing, dcache=0); a local
// one is cached as before.
func TestSpecBindsRemote(t *testing.T) {
	d := &Driver{cfg: Config{Overlay: OverlayHost, IgnoreCgroups: true}, log: slog.Default()}
	s := runtime.Spec{ID: "x", RootFS: "/r", Args: []string{"/envd"},
		Binds: []runtime.Bind{{Source: "/host/local", Path: "/a"}, {Source: "/host/s3", Path: "/b", Remote: true}}}
	sp := d.ociSpec(s)
	has := func(m int) bool {
		o := sp.Mounts[len(sp.Mounts)-2+m].Options
		return slices.Contains(o, "disable_file_handle_sharing") && slices.Contains(o, "dcache=0")
	}
	if has(0) || !has(1) {
		t.Fatalf("options: local %v, remote %v", sp.Mounts[len(sp.Mounts)-2].Options, sp.Mounts[len(sp.Mounts)-1].Options)
	}
}
