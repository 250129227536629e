package snapshot

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

func TestLoadOrCreateKey(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "sub", "snapshot-key")
	key, err := LoadOrCreateKey(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(key) != KeySize || bytes.Equal(key, make([]byte, KeySize)) {
		t.Fatalf("key = %x, want %d random bytes", key, KeySize)
	}
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("key file mode %v, want 0600", fi.Mode().Perm())
	}
	again, err := LoadOrCreateKey(path)
	if err != nil || !bytes.Equal(again, key) {
		t.Errorf("second call = %x, %v; want the same key", again, err)
	}

	// Concurrent first calls all get the one key that was linked into place.
	racePath := filepath.Join(dir, "race-key")
	keys := make(chan []byte, 8)
	for range 8 {
		go func() {
			k, err := LoadOrCreateKey(racePath)
			if err != nil {
				t.Error(err)
			}
			keys <- k
		}()
	}
	first := <-keys
	for range 7 {
		if k := <-keys; !bytes.Equal(k, first) {
			t.Errorf("concurrent callers got different keys")
		}
	}
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if e.Name() != "sub" && e.Name() != "race-key" {
			t.Errorf("left behind: %s", e.Name())
		}
	}
}

func TestLoadOrCreateKeyRefusesBadFiles(t *testing.T) {
	for _, tc := range []struct {
		name  string
		setup func(t *testing.T, path string)
	}{
		{"readable by others", func(t *testing.T, path string) {
			if err := os.WriteFile(path, bytes.Repeat([]byte{1}, 32), 0o644); err != nil {
				t.Fatal(err)
			}
			os.Chmod(path, 0o644)
		}},
		{"too short", func(t *testing.T, path string) {
			if err := os.WriteFile(path, []byte("short"), 0o600); err != nil {
				t.Fatal(err)
			}
		}},
		{"empty", func(t *testing.T, path string) {
			if err := os.WriteFile(path, nil, 0o600); err != nil {
				t.Fatal(err)
			}
		}},
		{"symlink", func(t *testing.T, path string) {
			target := filepath.Join(filepath.Dir(path), "target")
			if err := os.WriteFile(target, bytes.Repeat([]byte{1}, 32), 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(target, path); err != nil {
				t.Fatal(err)
			}
		}},
		{"directory", func(t *testing.T, path string) {
			if err := os.Mkdir(path, 0o700); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "snapshot-key")
			tc.setup(t, path)
			if _, err := LoadOrCreateKey(path); !errors.Is(err, errdefs.ErrInvalid) {
				t.Errorf("LoadOrCreateKey = %v, want ErrInvalid", err)
			}
		})
	}
}
