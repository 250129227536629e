package gvisor_test

import (
	"context"
	"github.com/ember-sandbox/ember/internal/testutil"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/runtime/drivertest"
)

// TestImageOnHost round-trips real checkpoints through ExportImage and ImportImage and looks at
// the host side: a 16 TiB sparse file written in the sandbox stays sparse in the imported image
// and in the restored instance's layer. It logs the figures: export and import of an idle
// image, and of one whose layer has 1 GiB written.
func TestImageOnHost(t *testing.T) {
	d := newDriver(t, nil)
	rootfs := drivertest.BusyboxRootFS(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	args := []string{"/bin/sleep", "100000"}
	cases := []struct {
		name, script string
		big          bool
	}{
		{"idle", "true", false},
		{"sparse 16 TiB", "truncate -s 16T /root/sparse || truncate -s 17592186040320 /root/sparse", false},
		{"1 GiB written", "dd if=/dev/zero of=/root/big bs=1M count=1024 2>/dev/null && sync", true},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if tc.big {
				testutil.SkipShort(t, "writes 1 GiB")
			}
			id := "gv-imghost" + string(rune('a'+i))
			sp := runtime.Spec{ID: id, RootFS: rootfs, StateDir: filepath.Join(t.TempDir(), "a"), Args: args, MemoryMB: 256}
			must(t, d.Start(ctx, sp))
			t.Cleanup(func() { _ = d.Delete(context.Background(), id) })
			if out, code, err := d.Exec(ctx, id, []string{"sh", "-c", tc.script}); err != nil || code != 0 {
				t.Fatalf("%q: %d %v %s", tc.script, code, err, out)
			}
			img := t.TempDir()
			must(t, d.Checkpoint(ctx, id, img, runtime.CheckpointOptions{}))
			for _, e := range mustReadDir(t, img) {
				if fi, _ := e.Info(); e.Type().IsRegular() && fi.Mode().Perm() != 0o600 {
					t.Errorf("checkpoint file %s: mode %v, want 0600", e.Name(), fi.Mode())
				}
			}
			exp := t.TempDir()
			t0 := time.Now()
			must(t, d.ExportImage(ctx, img, exp))
			exportTime := time.Since(t0)
			var size int64
			for _, e := range mustReadDir(t, exp) {
				fi, _ := e.Info()
				size += fi.Size()
			}
			dst := filepath.Join(t.TempDir(), "imported")
			t0 = time.Now()
			must(t, d.ImportImage(ctx, exp, dst, runtime.ImportOptions{MaxBytes: 2 << 30}))
			importTime := time.Since(t0)
			t.Logf("%s: export %v, import %v, exported %.1f MiB", tc.name, exportTime, importTime, float64(size)/(1<<20))
			if strings.Contains(tc.script, "sparse") {
				p := filepath.Join(dst, "layer", "upper", "root", "sparse")
				if b := blocks(t, p); b > 64 {
					t.Errorf("imported %s: %d blocks, want sparse", p, b)
				}
			}
			resumed := sp
			resumed.StateDir = filepath.Join(t.TempDir(), "b")
			resumed.ConsumeImage = true
			must(t, d.Restore(ctx, resumed, dst))
			out, code, err := d.Exec(ctx, id, []string{"sh", "-c", "ls -l /root"})
			if err != nil || code != 0 {
				t.Fatalf("after restore: %d %v %s", code, err, out)
			}
			if strings.Contains(tc.script, "sparse") {
				p := filepath.Join(resumed.StateDir, "layer", "upper", "root", "sparse")
				if b := blocks(t, p); b > 64 {
					t.Errorf("restored instance's %s: %d blocks, want sparse", p, b)
				}
			}
			if strings.Contains(tc.script, "sparse") {
				// A fork child clones the image's layer instead of taking it: still sparse.
				dst2 := filepath.Join(t.TempDir(), "imported2")
				must(t, d.ImportImage(ctx, exp, dst2, runtime.ImportOptions{MaxBytes: 2 << 30}))
				child := runtime.Spec{ID: "gv-imgchild", RootFS: rootfs, StateDir: filepath.Join(t.TempDir(), "c"), Args: args}
				must(t, d.Restore(ctx, child, dst2))
				t.Cleanup(func() { _ = d.Delete(context.Background(), child.ID) })
				p := filepath.Join(child.StateDir, "layer", "upper", "root", "sparse")
				if b := blocks(t, p); b > 64 {
					t.Errorf("cloned layer's %s: %d blocks, want sparse", p, b)
				}
			}
			if tc.big && !strings.Contains(string(out), "1073741824") {
				t.Errorf("after restore /root: %s", out)
			}
		})
	}
}

func mustReadDir(t *testing.T, dir string) []os.DirEntry {
	t.Helper()
	ents, err := os.ReadDir(dir)
	must(t, err)
	return ents
}
