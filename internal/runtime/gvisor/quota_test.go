package gvisor

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
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
