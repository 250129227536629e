package image

import (
	"context"
	"fmt"
	"github.com/ember-sandbox/ember/internal/testutil"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/overlayfs"
)

// TestFromUpperOfARealOverlay deletes, replaces and re-creates entries through a real overlayfs
// mount, then stacks its upper dir on the lower with Compose and mounts the stack: the merged
// tree is what the first mount showed (deleted files gone, a re-created directory without its
// old contents), and no overlay xattr but the opaque mark is left in the layer.
func TestFromUpperOfARealOverlay(t *testing.T) {
	testutil.RequireRoot(t)
	dir := t.TempDir()
	lower, upper, work, merged := filepath.Join(dir, "lower"), filepath.Join(dir, "upper"), filepath.Join(dir, "work"), filepath.Join(dir, "merged")
	for _, d := range []string{lower, upper, work, merged, filepath.Join(lower, "d"), filepath.Join(lower, "keep")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, f := range []string{"gone", "d/old", "keep/a", "changed"} {
		if err := os.WriteFile(filepath.Join(lower, f), []byte("lower "+f), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	err := unix.Mount("overlay", merged, "overlay", 0, "lowerdir="+lower+",upperdir="+upper+",workdir="+work)
	testutil.Need(t, err == nil, fmt.Sprintf("overlay mount: %v", err))
	mounted := true
	defer func() {
		if mounted {
			unix.Unmount(merged, 0)
		}
	}()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.Remove(filepath.Join(merged, "gone")))
	must(os.RemoveAll(filepath.Join(merged, "d")))
	must(os.Mkdir(filepath.Join(merged, "d"), 0o750))
	must(os.WriteFile(filepath.Join(merged, "d/new"), []byte("upper"), 0o600))
	must(os.WriteFile(filepath.Join(merged, "changed"), []byte("upper changed"), 0o644))
	must(os.WriteFile(filepath.Join(merged, "keep/b"), []byte("b"), 0o644))
	must(unix.Unmount(merged, 0))
	mounted = false

	m, err := FromUpper(upper)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(m.Whiteouts, ",") != "gone" || strings.Join(m.Opaque, ",") != "d" {
		t.Fatalf("whiteouts %v opaque %v", m.Whiteouts, m.Opaque)
	}
	must(filepath.Walk(upper, func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		buf := make([]byte, 256)
		n, _ := unix.Llistxattr(p, buf)
		for _, x := range strings.Split(strings.TrimRight(string(buf[:max(n, 0)]), "\x00"), "\x00") {
			if strings.Contains(x, "overlay") && x != overlayOpaque {
				t.Errorf("%s keeps overlay xattr %q", p, x)
			}
		}
		return nil
	}))
	top := filepath.Join(dir, "top")
	must(os.Mkdir(top, 0o755))
	stack, _, err := Compose(context.Background(), top, []LayerDir{{Digest: "lower", Root: lower}, {Digest: "upper", Root: upper, Meta: m}})
	must(err)
	dest := filepath.Join(dir, "dest")
	must(os.Mkdir(dest, 0o755))
	must(overlayfs.Mount(dest, stack.Dirs(), "", ""))
	defer overlayfs.Unmount(dest)
	var got []string
	must(filepath.Walk(dest, func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dest, p)
		if fi.Mode()&os.ModeDevice != 0 {
			t.Errorf("device node %s in the merged tree", rel)
		}
		if !fi.IsDir() {
			b, _ := os.ReadFile(p)
			rel += "=" + string(b)
		}
		got = append(got, rel)
		return nil
	}))
	sort.Strings(got)
	want := ".,changed=upper changed,d,d/new=upper,keep,keep/a=lower keep/a,keep/b=b"
	if strings.Join(got, ",") != want {
		t.Fatalf("merged tree\n got %s\nwant %s", strings.Join(got, ","), want)
	}
}

// A metacopy file (data still in the lower layer) or a redirected directory cannot be stacked
// elsewhere: FromUpper refuses the layer instead of composing an empty file.
func TestFromUpperRefusesLowerDependentEntries(t *testing.T) {
	testutil.RequireRoot(t)
	for _, x := range []string{overlayMetacopy, overlayRedirect} {
		upper := t.TempDir()
		f := filepath.Join(upper, "f")
		if err := os.WriteFile(f, nil, 0o644); err != nil {
			t.Fatal(err)
		}
		err := unix.Lsetxattr(f, x, []byte("x"), 0)
		testutil.Need(t, err == nil, fmt.Sprintf("trusted xattrs: %v", err))
		if _, err := FromUpper(upper); err == nil || !strings.Contains(err.Error(), x) {
			t.Errorf("%s: err = %v, want a refusal naming it", x, err)
		}
	}
}
