package gvisor

import (
	"bytes"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/runtime"
)

// SetTasksPerUIDForTest lowers the in-sandbox RLIMIT_NPROC of instances started afterwards (for
// the tests of the gvisor_test package); the returned func restores it.
func SetTasksPerUIDForTest(n uint64) (restore func()) {
	old := tasksPerUID
	tasksPerUID = n
	return func() { tasksPerUID = old }
}

// InstanceCgroupFile returns the path of a control file of id's cgroups ("" if none has it).
func InstanceCgroupFile(d *Driver, id, name string) string {
	for _, dir := range d.instanceCgroups(id) {
		p := filepath.Join(dir, name)
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	return ""
}

// TestCopyImageKeepsHoles checks the image copy writes only the data of a sparse file.
func TestCopyImageKeepsHoles(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "src")
	f, err := os.Create(src)
	if err != nil {
		t.Fatal(err)
	}
	chunk := bytes.Repeat([]byte("ember"), 200000) // ~1 MB
	for _, off := range []int64{0, 24 << 20, 64<<20 - int64(len(chunk))} {
		if _, err := f.WriteAt(chunk, off); err != nil {
			t.Fatal(err)
		}
	}
	f.Close()
	dst := filepath.Join(dir, "dst")
	if err := copyImage(src, dst); err != nil {
		t.Fatal(err)
	}
	a, _ := os.ReadFile(src)
	b, _ := os.ReadFile(dst)
	if !bytes.Equal(a, b) {
		t.Fatal("copy differs from source")
	}
	var st unix.Stat_t
	if err := unix.Stat(dst, &st); err != nil {
		t.Fatal(err)
	}
	if used := st.Blocks * 512; used > 8<<20 {
		t.Errorf("copy of a 64 MiB file with 3 MB of data uses %d bytes on disk", used)
	}
	if err := copyImage(src, dst); err == nil {
		t.Error("copyImage over an existing file succeeded")
	}
}

// TestLimitExit reads the reason of a limit stop from (fake) cgroup files.
func TestLimitExit(t *testing.T) {
	root := t.TempDir()
	mem, pids := filepath.Join(root, "memory"), filepath.Join(root, "pids")
	d := &Driver{cfg: Config{CgroupParent: "ember"}, cgroupDirs: []string{mem, pids}}
	write := func(dir, name, content string) {
		t.Helper()
		p := filepath.Join(dir, "ember", "gv-x", name)
		if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(mem, "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
	write(mem, "memory.limit_in_bytes", strconv.FormatInt(hostMemoryLimit(256<<20), 10)+"\n") // raised: headroom
	write(pids, "pids.events", "max 0\n")
	if _, _, ok := d.limitExit("gv-x"); ok {
		t.Fatal("no counter moved, yet a limit exit")
	}
	write(pids, "pids.events", "max 3\n")
	if r, detail, ok := d.limitExit("gv-x"); !ok || r != runtime.ExitKilled || detail == "" {
		t.Errorf("pids: %q %q %v", r, detail, ok)
	}
	write(mem, "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
	if r, detail, ok := d.limitExit("gv-x"); !ok || r != runtime.ExitOOM || detail != "memory limit 256 MiB exceeded" {
		t.Errorf("oom: %q %q %v", r, detail, ok)
	}
}

// LimitExitForTest exposes limitExit to the gvisor_test package.
func LimitExitForTest(d *Driver, id string) (runtime.ExitReason, string, bool) {
	return d.limitExit(id)
}

// HostMemoryLimit exposes hostMemoryLimit to the gvisor_test package.
func HostMemoryLimit(guest int64) int64 { return hostMemoryLimit(guest) }

// The host limit lies above the guest's memory by the headroom, and guestMemory gives back the
// guest's memory (what GET /sandboxes and an OOM reason report) for every whole MiB size.
func TestMemoryHeadroom(t *testing.T) {
	if h := hostMemoryLimit(1 << 30); h != (1<<30)+(256<<20)+(512<<20) {
		t.Errorf("1 GiB guest: host limit %d MiB, want 1792", h>>20)
	}
	for mb := int64(1); mb <= 64<<10; mb++ {
		if g := guestMemory(uint64(hostMemoryLimit(mb << 20))); g != uint64(mb)<<20 {
			t.Fatalf("guestMemory(hostMemoryLimit(%d MiB)) = %d MiB", mb, g>>20)
		}
	}
	if g := guestMemory(128 << 20); g != 128<<20 {
		t.Errorf("a limit never raised: %d MiB, want it as it is", g>>20)
	}
}
