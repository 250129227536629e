package egress

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
)

// TestCAFileCutShort: a CA certificate cut short (a crash while an older version wrote it in
// place) no longer stops the next start: a new CA replaces it, written whole (atomically), and
// the start after that keeps it.
func TestCAFileCutShort(t *testing.T) {
	dir := t.TempDir()
	_, first, replaced, err := LoadOrCreateCA(dir, "n1")
	if err != nil || replaced {
		t.Fatalf("first start: replaced=%v %v", replaced, err)
	}
	certPath := filepath.Join(dir, CAFile)
	if err := os.WriteFile(certPath, first[:len(first)/2], 0o600); err != nil {
		t.Fatal(err)
	}
	ca, second, replaced, err := LoadOrCreateCA(dir, "n1")
	if err != nil || !replaced {
		t.Fatalf("start after a partial write: replaced=%v %v", replaced, err)
	}
	if bytes.Equal(first, second) || ca.Leaf == nil || !ca.Leaf.IsCA {
		t.Fatalf("not a new CA: %+v", ca.Leaf)
	}
	_, third, replaced, err := LoadOrCreateCA(dir, "n1")
	if err != nil || replaced || !bytes.Equal(second, third) {
		t.Fatalf("the start after: replaced=%v %v (same CA: %v)", replaced, err, bytes.Equal(second, third))
	}
	for _, f := range []string{CAFile, CAKeyFile} {
		if fi, err := os.Stat(filepath.Join(dir, f)); err != nil || fi.Mode().Perm() != 0o600 {
			t.Fatalf("%s: %v %v", f, fi.Mode(), err)
		}
	}
	if left, _ := filepath.Glob(filepath.Join(dir, ".*")); len(left) != 0 {
		t.Fatalf("temporary files left: %v", left)
	}
}
