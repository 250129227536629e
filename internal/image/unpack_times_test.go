package image

import (
	"archive/tar"
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// Directory times are set last; a later entry that replaced a directory on the way with a
// symlink must not lead that to a host directory (any host file's mtime).
func TestUnpackSetsNoTimeThroughASymlink(t *testing.T) {
	host := t.TempDir()
	victim := filepath.Join(host, "sub")
	os.Mkdir(victim, 0o755)
	old := time.Date(2001, 1, 1, 0, 0, 0, 0, time.UTC)
	os.Chtimes(victim, old, old)

	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	stamp := time.Date(2020, 2, 2, 0, 0, 0, 0, time.UTC)
	tw.WriteHeader(&tar.Header{Name: "d/", Typeflag: tar.TypeDir, Mode: 0o755, ModTime: stamp})
	tw.WriteHeader(&tar.Header{Name: "d/sub/", Typeflag: tar.TypeDir, Mode: 0o755, ModTime: stamp})
	tw.WriteHeader(&tar.Header{Name: "d", Typeflag: tar.TypeSymlink, Linkname: host, ModTime: stamp})
	tw.Close()

	root := t.TempDir()
	if _, err := Unpack(context.Background(), &buf, root, Limits{}, nil); err != nil {
		t.Logf("unpack: %v", err) // refusing the layer is fine too
	}
	fi, err := os.Stat(victim)
	if err != nil {
		t.Fatal(err)
	}
	if !fi.ModTime().Equal(old) {
		t.Fatalf("a host directory's mtime was set through the layer's symlink: %s", fi.ModTime())
	}
}
