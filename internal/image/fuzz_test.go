package image

import (
	"archive/tar"
	"bytes"
	"context"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/ember-sandbox/ember/internal/testutil"
)

// FuzzUnpack: whatever a layer holds, nothing is written outside the unpack root.
func FuzzUnpack(f *testing.F) {
	testutil.RequireRoot(f)
	for _, ents := range [][]ent{
		{file("a", "x"), symlink("l", "/"), file("l/x", "y")},
		{dir("d"), symlink("d/up", "../.."), hardlink("h", "d/up"), file("d/up/x", "z")},
		{file(".wh.a", ""), file("a/.wh..wh..opq", ""), hardlink("b", "a")},
		{{name: "dev/zero", typ: tar.TypeChar}, {name: "p", typ: tar.TypeFifo}},
	} {
		f.Add(tarOf(f, ents...))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		base := t.TempDir()
		root := filepath.Join(base, "in", "root")
		os.MkdirAll(root, 0o755)
		sentinel := filepath.Join(base, "sentinel")
		os.WriteFile(sentinel, []byte("s"), 0o644)
		Unpack(context.Background(), bytes.NewReader(data), root, Limits{MaxBytes: 1 << 20, MaxEntries: 1000}, nil)
		entries, _ := os.ReadDir(base)
		if len(entries) != 2 {
			t.Fatalf("written beside the root: %v", entries)
		}
		if e, _ := os.ReadDir(filepath.Join(base, "in")); len(e) != 1 {
			t.Fatalf("written beside the root: %v", e)
		}
		if b, _ := os.ReadFile(sentinel); string(b) != "s" {
			t.Fatal("sentinel changed")
		}
		filepath.Walk(root, func(p string, info os.FileInfo, err error) error {
			if err == nil && info.Mode()&(os.ModeDevice|os.ModeCharDevice) != 0 {
				// The only device nodes allowed: the overlay whiteouts Unpack makes (0:0).
				if st, ok := info.Sys().(*syscall.Stat_t); !ok || info.Mode()&os.ModeCharDevice == 0 || st.Rdev != 0 {
					t.Fatalf("device node %s", p)
				}
			}
			return nil
		})
	})
}
