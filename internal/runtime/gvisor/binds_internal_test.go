package gvisor

import (
	"log/slog"
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
