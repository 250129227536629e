package gvisor

import (
	"bytes"
	"os"
	"path/filepath"
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
	write(mem, "memory.limit_in_bytes", "268435456\n")
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
