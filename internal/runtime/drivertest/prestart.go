package drivertest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/overlayfs"
	rt "github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// testPrestart: instances pre-started from a checkpoint image's layer and later restored into
// run the checkpointed processes with their own identity (id, hostname), network namespace and
// layer; two restored from one image diverge; a pre-started instance is used once; one
// discarded unused leaves nothing behind. Drivers without runtime.Prestarter skip it.
func (s *suite) testPrestart(t *testing.T) {
	e := s.env(t)
	ps, ok := e.d.(rt.Prestarter)
	if !ok {
		testutil.NotApplicable(t, e.d.Name()+" does not implement runtime.Prestarter")
	}
	src := e.start()
	pid := e.spawn(src.ID, "exec sleep 1000")
	e.sh(src.ID, 0, "mkdir -p /var/app && echo source > /var/app/f")
	img := t.TempDir()
	if err := e.d.Checkpoint(ctx(t), src.ID, img, rt.CheckpointOptions{LeaveRunning: true}); err != nil {
		t.Fatalf("Checkpoint: %v", err)
	}
	e.sh(src.ID, 0, "echo source-after > /var/app/f")

	ips := []string{"10.254.7.1", "10.254.7.2"}
	kids := make([]rt.Spec, 2)
	for i := range kids {
		kids[i] = e.spec()
		kids[i].NetNSPath = NewNetNS(t, ips[i])
		if err := ps.Prestart(ctx(t), kids[i], img); err != nil {
			t.Fatalf("Prestart(%s): %v", kids[i].ID, err)
		}
		e.track(kids[i].ID)
		if got := e.state(kids[i].ID); got == rt.StateRunning {
			t.Fatalf("a pre-started instance is %s before RestoreInto", got)
		}
	}
	for _, k := range kids {
		if err := ps.RestoreInto(ctx(t), k.ID, img); err != nil {
			t.Fatalf("RestoreInto(%s): %v", k.ID, err)
		}
		if got := e.state(k.ID); got != rt.StateRunning {
			t.Fatalf("State after RestoreInto = %s", got)
		}
	}
	for i, k := range kids {
		out := e.sh(k.ID, 0, "cat /proc/"+pid+"/cmdline | tr '\\0' ' '; cat /var/app/f; hostname; ip -o -4 addr show 2>/dev/null || ifconfig")
		if !strings.Contains(out, "sleep 1000") {
			t.Errorf("instance %d does not run the checkpointed process %s: %q", i, pid, out)
		}
		if !strings.Contains(out, "source\n") || strings.Contains(out, "source-after") {
			t.Errorf("instance %d does not have the image's files: %q", i, out)
		}
		if !strings.Contains(out, k.Hostname+"\n") {
			t.Errorf("instance %d's hostname is not its own (%s): %q", i, k.Hostname, out)
		}
		if !strings.Contains(out, ips[i]) || strings.Contains(out, ips[1-i]) {
			t.Errorf("instance %d is not on its own network namespace (%s): %q", i, ips[i], out)
		}
		e.sh(k.ID, 0, fmt.Sprintf("echo kid-%d > /var/app/f", i))
	}
	for i, k := range kids {
		if got, want := e.sh(k.ID, 0, "cat /var/app/f"), fmt.Sprintf("kid-%d\n", i); got != want {
			t.Errorf("instance %d reads %q, want %q (layers shared?)", i, got, want)
		}
	}
	if got := e.sh(src.ID, 0, "cat /var/app/f"); got != "source-after\n" {
		t.Errorf("the source reads %q", got)
	}

	t.Run("used once", func(t *testing.T) {
		if err := ps.RestoreInto(ctx(t), kids[0].ID, img); !errors.Is(err, errdefs.ErrConflict) {
			t.Errorf("second RestoreInto = %v, want ErrConflict", err)
		}
		if err := ps.RestoreInto(ctx(t), src.ID, img); !errors.Is(err, errdefs.ErrConflict) {
			t.Errorf("RestoreInto of an instance that was not pre-started = %v, want ErrConflict", err)
		}
	})
	t.Run("other image", func(t *testing.T) {
		other := t.TempDir()
		if err := e.d.Checkpoint(ctx(t), src.ID, other, rt.CheckpointOptions{LeaveRunning: true}); err != nil {
			t.Fatalf("Checkpoint: %v", err)
		}
		sp := e.spec()
		if err := ps.Prestart(ctx(t), sp, img); err != nil {
			t.Fatalf("Prestart: %v", err)
		}
		e.track(sp.ID)
		if err := ps.RestoreInto(ctx(t), sp.ID, other); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("RestoreInto of another image than the layer's = %v, want ErrInvalid", err)
		}
	})
	t.Run("resume", func(t *testing.T) {
		// A pause image's layer moved into a pre-started instance (ConsumeImage): discarding the
		// instance gives it back to the image; one pre-started again and restored into resumes
		// the paused processes and files under the same id.
		sp := e.start()
		pid := e.spawn(sp.ID, "exec sleep 1000")
		e.sh(sp.ID, 0, "mkdir -p /var/app && echo paused > /var/app/p")
		pimg := t.TempDir()
		if err := e.d.Checkpoint(ctx(t), sp.ID, pimg, rt.CheckpointOptions{}); err != nil {
			t.Fatalf("Checkpoint: %v", err)
		}
		for i, discard := range []bool{true, false} {
			r := sp
			r.StateDir = filepath.Join(t.TempDir(), fmt.Sprintf("resume-%d", i))
			r.ConsumeImage = true
			if err := ps.Prestart(ctx(t), r, pimg); err != nil {
				t.Fatalf("Prestart(ConsumeImage): %v", err)
			}
			if discard {
				if err := e.d.Delete(ctx(t), r.ID); err != nil {
					t.Fatalf("Delete: %v", err)
				}
				if err := e.d.Release(ctx(t), r.StateDir); err != nil {
					t.Fatalf("Release: %v", err)
				}
				continue
			}
			t.Cleanup(func() { _ = e.d.Delete(context.Background(), r.ID) }) // before its state dir goes
			if err := ps.RestoreInto(ctx(t), r.ID, pimg); err != nil {
				t.Fatalf("RestoreInto after a discarded pre-start gave the layer back: %v", err)
			}
		}
		if got := e.sh(sp.ID, 0, "cat /var/app/p; cat /proc/"+pid+"/cmdline | tr '\\0' ' '"); !strings.Contains(got, "paused\n") || !strings.Contains(got, "sleep 1000") {
			t.Errorf("resumed into a pre-started instance: %q", got)
		}
	})
	t.Run("discard", func(t *testing.T) {
		sp := e.spec()
		sp.DiskMB = 64
		if err := ps.Prestart(ctx(t), sp, img); err != nil {
			t.Fatalf("Prestart: %v", err)
		}
		if len(processesNaming(sp.ID)) == 0 {
			t.Fatalf("no process of the pre-started instance %s runs", sp.ID)
		}
		if err := e.d.Delete(ctx(t), sp.ID); err != nil {
			t.Fatalf("Delete: %v", err)
		}
		if err := e.d.Release(ctx(t), sp.StateDir); err != nil {
			t.Fatalf("Release: %v", err)
		}
		AssertNoLeftovers(t, sp.ID)
		if m := mountsUnder(sp.StateDir); len(m) > 0 {
			t.Errorf("mounts left under the discarded instance's dir: %v", m)
		}
		if err := os.RemoveAll(sp.StateDir); err != nil {
			t.Errorf("remove the discarded instance's dir: %v", err)
		}
		if ids, err := e.d.List(ctx(t)); err != nil || contains(ids, sp.ID) {
			t.Errorf("List after discard = %v, %v", ids, err)
		}
	})
}

// NewNetNS makes a network namespace (bind-mounted on a file of t's, removed at its end) with a
// veth pair (both ends inside) holding ip, so that an instance's view of its network tells which it joined.
func NewNetNS(t *testing.T, ip string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "netns")
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // the thread ends with the namespace it entered: never unlocked
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			errc <- err
			return
		}
		errc <- unix.Mount(fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid()), path, "", unix.MS_BIND, "")
	}()
	err := <-errc
	testutil.Need(t, err == nil, fmt.Sprint("network namespace: ", err))
	t.Cleanup(func() { _ = unix.Unmount(path, unix.MNT_DETACH) })
	for _, args := range [][]string{
		{"ip", "link", "add", "v0", "type", "veth", "peer", "name", "v1"},
		{"ip", "addr", "add", ip + "/24", "dev", "v0"},
		{"ip", "link", "set", "v0", "up"},
		{"ip", "link", "set", "v1", "up"},
		{"ip", "link", "set", "lo", "up"},
	} {
		out, err := exec.Command("nsenter", append([]string{"--net=" + path}, args...)...).CombinedOutput()
		testutil.Need(t, err == nil, fmt.Sprintf("%s: %v: %s", strings.Join(args, " "), err, out))
	}
	return path
}

// mountsUnder lists the mount points at or below dir.
func mountsUnder(dir string) []string {
	out := overlayfs.MountsUnder(dir)
	if overlayfs.MountedOn(dir) {
		out = append([]string{dir}, out...)
	}
	return out
}
