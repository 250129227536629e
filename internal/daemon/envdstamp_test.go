package daemon

import (
	"os"
	"path/filepath"
	"testing"
)

// A template built at start-up is built again when the envd binary changes (its checkpoint
// holds the old one), when the stamp is missing (built before stamps, or elsewhere) or names
// another build; not when nothing changed.
func TestEnvdStamp(t *testing.T) {
	dir := t.TempDir()
	envd := filepath.Join(dir, "envd")
	if err := os.WriteFile(envd, []byte("envd v1"), 0o755); err != nil {
		t.Fatal(err)
	}
	v1 := envdDigest(envd)
	if len(v1) != 64 {
		t.Fatalf("digest %q", v1)
	}
	if !envdChanged(dir, "base", "b1", v1) {
		t.Error("no stamp: want a rebuild")
	}
	if err := stampEnvd(dir, "base", "b1", v1); err != nil {
		t.Fatal(err)
	}
	if envdChanged(dir, "base", "b1", v1) {
		t.Error("same build, same envd: want no rebuild")
	}
	if !envdChanged(dir, "base", "b2", v1) {
		t.Error("another build than the stamped one: want a rebuild")
	}
	if err := os.WriteFile(envd, []byte("envd v2"), 0o755); err != nil {
		t.Fatal(err)
	}
	if !envdChanged(dir, "base", "b1", envdDigest(envd)) {
		t.Error("envd changed: want a rebuild")
	}
	if envdChanged(dir, "base", "b1", envdDigest(filepath.Join(dir, "missing"))) {
		t.Error("no envd binary to compare: want no rebuild")
	}
}
