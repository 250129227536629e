package e2e

import (
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/testutil"
)

// forkLayers lists the fork layers (the sources' layers captured read-only) in d's data dir.
func (d *daemon) forkLayers() map[string]bool {
	dirs, _ := filepath.Glob(filepath.Join(d.dataDir, "forks", "*"))
	out := map[string]bool{}
	for _, dir := range dirs {
		out[dir] = true
	}
	return out
}

// A fork's children stack a fresh writable layer each over the source's layer captured at the
// fork: they see the source's files (and its deletes) as they were then, the source's later
// writes reach none of them, a child's deletes of a captured file are its own (whiteouts), a
// child pauses and resumes on that stack, and the captured layer is gone (unmounted and removed)
// once the last sandbox stacking it is killed.
func TestForkChildrenShareTheCapturedLayer(t *testing.T) {
	d := need(t)
	before := d.forkLayers()
	parent := d.create(t, nil)
	d.run(t, parent, "echo at-fork > /home/user/x && echo shared > /home/user/del")
	if r, err := d.tryRun(parent, "rm /etc/debian_version && sync", "root"); err != nil || r.exitCode != 0 {
		t.Fatalf("prepare the parent: %+v %v", r, err)
	}
	// A write through a shared mapping, never synced: the sentry may hold it in its own memory
	// until the checkpoint flushes it, so the layer must be captured after that flush.
	mm := `import mmap,time
f=open("/home/user/m","w+b"); f.truncate(4096); m=mmap.mmap(f.fileno(),4096); m[:6]=b"mapped"
time.sleep(600)`
	d.run(t, parent, "setsid nohup python3 -c '"+mm+"' >/dev/null 2>&1 & for i in $(seq 100); do [ \"$(head -c 6 /home/user/m 2>/dev/null)\" = mapped ] && break; sleep 0.05; done")
	var items []forkItem
	if code := d.api(t, "POST", "/sandboxes/"+parent.SandboxID+"/fork", map[string]any{"count": 4, "timeout": 120}, &items); code != 201 || len(items) != 4 {
		t.Fatalf("fork: %d, %d items\n%s", code, len(items), d.logs())
	}
	var kids []sbx
	for i, it := range items {
		if it.Sandbox == nil {
			t.Fatalf("child %d failed: %+v", i, it.Error)
		}
		kids = append(kids, *it.Sandbox)
	}
	var layer string
	for l := range d.forkLayers() {
		if !before[l] {
			layer = l
		}
	}
	if layer == "" {
		t.Fatalf("no fork layer in %s after the fork", filepath.Join(d.dataDir, "forks"))
	}
	// The source writes after the fork, and overwrites a file the children share.
	d.run(t, parent, "echo later > /home/user/later && echo parent-changed > /home/user/x")
	for i, k := range kids {
		script := "cat /home/user/x; test -e /home/user/later && echo LATER; test -e /etc/debian_version && echo UNDELETED; head -c 6 /home/user/m; true"
		if r := d.run(t, k, script); r.stdout != "at-fork\nmapped" {
			t.Errorf("child %d sees %q, want only the file as it was at the fork", i, r.stdout)
		}
	}
	// Child 0 deletes captured files, child 1 overwrites one; neither reaches the others.
	if r, err := d.tryRun(kids[0], "rm /home/user/del /home/user/x && test ! -e /home/user/del && test ! -e /home/user/x", ""); err != nil || r.exitCode != 0 {
		t.Fatalf("child 0 deletes captured files: %+v %v", r, err)
	}
	d.run(t, kids[1], "echo child-1 > /home/user/x")
	want := []string{"", "child-1\nshared\n", "at-fork\nshared\n", "at-fork\nshared\n"}
	for i, k := range kids {
		r := d.run(t, k, "cat /home/user/x /home/user/del 2>/dev/null; true")
		if r.stdout != want[i] {
			t.Errorf("child %d: x and del read %q, want %q", i, r.stdout, want[i])
		}
	}
	if r := d.run(t, parent, "cat /home/user/x /home/user/del"); r.stdout != "parent-changed\nshared\n" {
		t.Errorf("parent reads %q after its children's writes", r.stdout)
	}
	// A child pauses and resumes on its stack (the captured layer under its own).
	if code := d.api(t, "POST", "/sandboxes/"+kids[2].SandboxID+"/pause", map[string]any{}, nil); code != 204 {
		t.Fatalf("pause child 2: %d", code)
	}
	var again sbx
	if code := d.api(t, "POST", "/v2/sandboxes/"+kids[2].SandboxID+"/connect", map[string]any{"timeout": 120}, &again); code != 201 {
		t.Fatalf("resume child 2: %d\n%s", code, d.logs())
	}
	d.run(t, again, "echo mine > /home/user/own")
	if r := d.run(t, again, "cat /home/user/x /home/user/own"); r.stdout != "at-fork\nmine\n" {
		t.Errorf("child 2 after pause and resume reads %q", r.stdout)
	}
	// The layer lives while a child does; the parent's end changes nothing.
	if code := d.api(t, "DELETE", "/sandboxes/"+parent.SandboxID, nil, nil); code != 204 {
		t.Fatalf("kill parent: %d", code)
	}
	for _, k := range kids[:3] {
		d.api(t, "DELETE", "/sandboxes/"+k.SandboxID, nil, nil)
	}
	time.Sleep(time.Second)
	if !d.forkLayers()[layer] {
		t.Fatalf("fork layer %s removed while child 3 still stacks it", layer)
	}
	if r := d.run(t, kids[3], "cat /home/user/x"); r.stdout != "at-fork\n" {
		t.Errorf("the last child reads %q", r.stdout)
	}
	d.api(t, "DELETE", "/sandboxes/"+kids[3].SandboxID, nil, nil)
	testutil.EventuallyOr(t, 15*time.Second, func() bool { return !d.forkLayers()[layer] && !mountedUnder(d, layer) }, func() string {
		return fmt.Sprintf("fork layer %s still there (mounted: %v) after its last child was killed\n%s", layer, mountedUnder(d, layer), d.logs())
	})
}

// mountedUnder reports whether anything is mounted at or below dir.
func mountedUnder(d *daemon, dir string) bool {
	for _, m := range d.mountsUnder() {
		if m == dir || strings.HasPrefix(m, dir+"/") {
			return true
		}
	}
	return false
}
