package snapshot_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/snapshot"
)

// The directory a snapshot was saved from, once adopted, is a completed Fetch: Fetch into it
// loads nothing, a later Save of another id skips the marker, and adopting an id that is not
// stored fails without writing anything.
func TestAdoptMakesTheSourceAFetchedCopy(t *testing.T) {
	ctx := context.Background()
	s := snapshot.New(newLocal(t), snapshot.WithChunkSize(64*kib))
	src := filepath.Join(t.TempDir(), "capture")
	if err := os.Mkdir(src, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(src, "mem"), bytes.Repeat([]byte{7}, int(3*64*kib)), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := s.Adopt(ctx, "snap", src); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("adopt before the save: %v, want ErrNotFound", err)
	}
	if _, err := os.Stat(filepath.Join(src, snapshot.MarkerName)); err == nil {
		t.Fatal("a failed adopt wrote the marker")
	}
	if _, err := s.Save(ctx, "snap", src); err != nil {
		t.Fatal(err)
	}
	if err := s.Adopt(ctx, "snap", src); err != nil {
		t.Fatal(err)
	}
	loaded := false
	err := s.Fetch(ctx, "snap", src, snapshot.FetchImport(func(ctx context.Context, from, to string) error {
		loaded = true
		return os.Rename(from, to)
	}))
	if err != nil || loaded {
		t.Fatalf("fetch into the adopted capture: err %v, loaded %v; want nil, no load", err, loaded)
	}
	if b, err := os.ReadFile(filepath.Join(src, "mem")); err != nil || len(b) != int(3*64*kib) {
		t.Fatalf("capture changed: %d bytes, %v", len(b), err)
	}
	m, err := s.Save(ctx, "again", src)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range m.Files {
		if f.Path == snapshot.MarkerName {
			t.Fatal("a save of an adopted directory stored its marker")
		}
	}
}
