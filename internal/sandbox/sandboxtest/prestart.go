package sandboxtest

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

var _ runtime.Prestarter = (*Driver)(nil)

// Prestart implements runtime.Prestarter: the instance is known (stopped, listed, deletable)
// and remembers the image it was pre-started for; nothing serves until RestoreInto.
func (d *Driver) Prestart(ctx context.Context, spec runtime.Spec, imageDir string) error {
	if err := d.fail("Prestart", spec.ID); err != nil {
		return err
	}
	if _, err := os.Stat(spec.StateDir); err != nil {
		return fmt.Errorf("fake: state dir: %w", err)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.insts[spec.ID] != nil {
		return fmt.Errorf("fake: instance %s already exists: %w", spec.ID, errdefs.ErrConflict)
	}
	os.WriteFile(filepath.Join(spec.StateDir, "instance"), []byte(spec.ID), 0o600)
	d.insts[spec.ID] = &Instance{ID: spec.ID, Spec: spec, state: runtime.StateStopped, done: make(chan struct{}),
		prestarted: true, preImage: imageDir}
	return nil
}

// RestoreInto implements runtime.Prestarter.
func (d *Driver) RestoreInto(ctx context.Context, id, imageDir string) error {
	if err := d.fail("RestoreInto", id); err != nil {
		return err
	}
	in, err := d.get(id)
	if err != nil {
		return err
	}
	in.mu.Lock()
	pre, want, spec := in.prestarted, in.preImage, in.Spec
	in.prestarted = false
	in.mu.Unlock()
	switch {
	case !pre:
		return fmt.Errorf("fake: %s is not a pre-started instance: %w", id, errdefs.ErrConflict)
	case want != imageDir:
		return fmt.Errorf("fake: %s was pre-started for %s, not %s: %w", id, want, imageDir, errdefs.ErrInvalid)
	}
	return d.restore(spec, imageDir)
}

// Prestarted returns the ids of pre-started instances not restored into yet.
func (d *Driver) Prestarted() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []string
	for id, in := range d.insts {
		in.mu.Lock()
		if in.prestarted {
			out = append(out, id)
		}
		in.mu.Unlock()
	}
	sort.Strings(out)
	return out
}
