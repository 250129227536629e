package store

import (
	"context"
	"errors"
	"path/filepath"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// Records written before a close are there after reopening the file, as after a daemon restart.
func TestRecordsSurviveReopen(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "ember.db")
	s, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC().Truncate(time.Millisecond)
	sb := &sandbox.Sandbox{ID: "abc", TemplateID: "base", State: sandbox.StatePaused, Metadata: map[string]string{"k": "v"},
		StartedAt: now, Runtime: sandbox.Placement{Image: "/x/image", SlotIndex: -1}}
	if err := s.PutSandbox(ctx, sb); err != nil {
		t.Fatal(err)
	}
	if err := s.PutTemplate(ctx, &sandbox.Template{ID: "base", Kind: "template", Ready: true, CreatedAt: now}); err != nil {
		t.Fatal(err)
	}
	if err := s.PutKey(ctx, &auth.Key{ID: "k1", Hash: "h1", CreatedAt: now}); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}

	s, err = Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	got, err := s.GetSandbox(ctx, "abc")
	if err != nil {
		t.Fatal(err)
	}
	if got.State != sandbox.StatePaused || got.Metadata["k"] != "v" || got.Runtime.Image != "/x/image" || !got.StartedAt.Equal(now) {
		t.Fatalf("sandbox after reopen: %+v", got)
	}
	if tpl, err := s.GetTemplate(ctx, "base"); err != nil || !tpl.Ready {
		t.Fatalf("template after reopen: %+v %v", tpl, err)
	}
	if k, err := s.GetKeyByHash(ctx, "h1"); err != nil || k.ID != "k1" {
		t.Fatalf("key after reopen: %+v %v", k, err)
	}
	if err := s.DeleteSandbox(ctx, "abc"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.GetSandbox(ctx, "abc"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("deleted sandbox: %v, want ErrNotFound", err)
	}
	if err := s.DeleteSandbox(ctx, "abc"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("second delete: %v, want ErrNotFound", err)
	}
	if _, err := s.GetKeyByHash(ctx, "nope"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("unknown key: %v", err)
	}
}
