package gvisor

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/layerfs"
	"github.com/ember-sandbox/ember/internal/overlayfs"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// A disk-limited layer's loop device uses direct I/O, except where its image is on btrfs: there
// a capture clones the image, and direct I/O would make an extent item of every write.
func TestDiskImageLoopIsBufferedOnBtrfs(t *testing.T) {
	testutil.RequireRoot(t)
	host := t.TempDir()
	btrfs := filepath.Join(host, "btrfs")
	os.Mkdir(btrfs, 0o700)
	if _, err := layerfs.Setup(layerfs.Config{DataDir: btrfs, Mode: layerfs.ModeBtrfs, Size: 1 << 30}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { layerfs.Unmount(btrfs, 10*time.Second) })
	dio := func(dir string) string {
		t.Helper()
		img := filepath.Join(dir, "disk.img")
		if err := os.WriteFile(img, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(img, 64<<20); err != nil {
			t.Fatal(err)
		}
		dev, lfd, err := attachLoop(img)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(lfd) // autoclear: detached at close
		b, err := os.ReadFile("/sys/block/" + filepath.Base(dev) + "/loop/dio")
		if err != nil {
			t.Fatal(err)
		}
		return strings.TrimSpace(string(b))
	}
	if got := dio(btrfs); got != "0" {
		t.Errorf("image on btrfs: dio %s, want 0 (buffered)", got)
	}
	if !overlayfs.IsBtrfs(host) {
		// ext4 and xfs take direct I/O; tmpfs has none (the driver falls back to buffered).
		var st unix.Statfs_t
		if unix.Statfs(host, &st) == nil && uint32(st.Type) == uint32(unix.EXT4_SUPER_MAGIC) {
			if got := dio(host); got != "1" {
				t.Errorf("image on ext4: dio %s, want 1", got)
			}
		}
	}
}
