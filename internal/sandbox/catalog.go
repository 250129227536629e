package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

// The template catalogue as sandboxes see it: templates and snapshots by name, their images
// (fetched from the image store on first use), their deletion, and the names reserved while a
// build or a snapshot writes one. Templates are built by internal/template/build.

// ListTemplates lists templates and snapshots.
func (m *Manager) ListTemplates(ctx context.Context) ([]*Template, error) {
	return m.cfg.Store.ListTemplates(ctx)
}

// templateImage returns the local checkpoint image of tpl, fetching a stored snapshot into the
// node-local cache when it is not there: verified by the store, unpacked by the driver (which
// treats it as untrusted), complete or absent. Concurrent creates from one snapshot load it
// once: the others wait for that load.
func (m *Manager) templateImage(ctx context.Context, tpl *Template) (string, error) {
	if !tpl.SnapshotStored || m.cfg.Images == nil {
		return tpl.Image, nil
	}
	max := int64(2*(orDefault(tpl.DiskMB, m.cfg.DiskMB)+orDefault(tpl.MemoryMB, m.cfg.MemoryMB))) << 20
	err := m.cfg.Images.Fetch(ctx, tpl.ID, tpl.Image, func(ctx context.Context, src, dst string) error {
		return m.cfg.Driver.ImportImage(ctx, src, dst, runtime.ImportOptions{MaxBytes: max})
	})
	if err != nil {
		return "", fmt.Errorf("snapshot %q: %w", tpl.ID, err)
	}
	return tpl.Image, nil
}

// saveImage puts the checkpoint image in dir into the image store under id, in the driver's
// export format.
func (m *Manager) saveImage(ctx context.Context, id, dir string) error {
	stage, err := os.MkdirTemp(filepath.Dir(dir), "."+filepath.Base(dir)+".export-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(stage)
	if err := m.cfg.Driver.ExportImage(ctx, dir, stage); err != nil {
		return err
	}
	return m.cfg.Images.Save(ctx, id, stage)
}

// DeleteTemplate deletes a template or snapshot. Sandboxes that run from it keep running. A
// snapshot's upload in flight is cancelled first.
func (m *Manager) DeleteTemplate(ctx context.Context, id string) error {
	if !nameRe.MatchString(id) {
		return fmt.Errorf("template %q: %w", id, errdefs.ErrNotFound)
	}
	m.cancelUpload(id)
	m.mu.Lock()
	busy := m.names[id]
	m.mu.Unlock()
	if busy {
		// A build in flight would put the template back when it ends.
		return fmt.Errorf("%q is being built or snapshotted right now: %w", id, errdefs.ErrConflict)
	}
	tpl, err := m.cfg.Store.GetTemplate(ctx, id)
	if err != nil {
		return err
	}
	if err := m.cfg.Store.DeleteTemplate(ctx, id); err != nil {
		return err
	}
	m.pool.templateChanged(&Template{ID: id})
	m.prestarts.templateChanged(&Template{ID: id})
	m.templateEvent(EventTemplateGone, tpl)
	defer m.collectLayers(context.WithoutCancel(ctx), "template "+id+" deleted")
	if tpl.Kind == "snapshot" {
		os.RemoveAll(tpl.Image)
		if m.cfg.Images != nil {
			m.deleteStored(ctx, id)
		}
	}
	// A template's rootfs may still back running or paused sandboxes: it is left in place.
	return nil
}

// reserveName keeps a template or snapshot name for one build or snapshot at a time. With
// existingOK a name already in the store may be reserved (a rebuild); otherwise an existing
// name is an ErrConflict.
func (m *Manager) reserveName(name string, existingOK bool) (release func(), err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.names == nil {
		m.names = map[string]bool{}
	}
	if m.names[name] {
		return nil, fmt.Errorf("%q is being built or snapshotted right now: %w", name, errdefs.ErrConflict)
	}
	if !existingOK {
		if _, err := m.cfg.Store.GetTemplate(context.Background(), name); err == nil {
			return nil, fmt.Errorf("snapshot or template %q already exists: %w", name, errdefs.ErrConflict)
		}
	}
	m.names[name] = true
	return func() {
		m.mu.Lock()
		delete(m.names, name)
		m.mu.Unlock()
	}, nil
}

// SplitTemplateName splits E2B's "name[:tag]".
func SplitTemplateName(s string) (name, tag string) {
	name, tag, _ = strings.Cut(s, ":")
	return name, tag
}

// GetTemplate returns a template or snapshot by id or name.
func (m *Manager) GetTemplate(ctx context.Context, id string) (*Template, error) {
	name, _ := SplitTemplateName(id)
	if !nameRe.MatchString(name) {
		return nil, fmt.Errorf("template %q: %w", id, errdefs.ErrNotFound)
	}
	if t, err := m.cfg.Store.GetTemplate(ctx, name); err == nil {
		return t, nil
	}
	ts, err := m.cfg.Store.ListTemplates(ctx)
	if err != nil {
		return nil, err
	}
	for _, t := range ts {
		for _, n := range append(append([]string(nil), t.Names...), t.Aliases...) {
			if n == name {
				return t, nil
			}
		}
	}
	return nil, fmt.Errorf("template %q: %w", name, errdefs.ErrNotFound)
}

// HasTag reports whether t has the tag.
func (t *Template) HasTag(tag string) bool {
	for _, tg := range t.Tags {
		if tg.Tag == tag {
			return true
		}
	}
	return false
}

// Builtins builds the node's built-in templates on first use (internal/template/build).
type Builtins interface {
	IsBuiltin(name string) bool
	EnsureBuiltin(ctx context.Context, name string, progress func(string)) (*Template, error)
}

// SetBuiltins makes a create that names a missing built-in template build it first.
func (m *Manager) SetBuiltins(b Builtins) { m.builtins.Store(&b) }

// resolveOrBuild resolves a template for a create; a built-in template that is missing is
// built first.
func (m *Manager) resolveOrBuild(ctx context.Context, id string) (*Template, error) {
	t, err := m.resolveTemplate(ctx, id)
	if err == nil || !errors.Is(err, errdefs.ErrNotFound) {
		return t, err
	}
	name, _ := SplitTemplateName(id)
	b := m.builtins.Load()
	if b == nil || !(*b).IsBuiltin(name) {
		return nil, err
	}
	if _, berr := (*b).EnsureBuiltin(ctx, name, nil); berr != nil {
		return nil, berr
	}
	return m.resolveTemplate(ctx, id)
}

// TemplateResources returns the vCPUs, memory and disk (MiB) a sandbox of t gets: the
// template's own, or this node's defaults where it sets none (what GET /templates shows).
func (m *Manager) TemplateResources(t *Template) (cpu, memoryMB, diskMB int) {
	return orDefault(t.CPUCount, m.cfg.CPUCount), orDefault(t.MemoryMB, m.cfg.MemoryMB), orDefault(t.DiskMB, m.cfg.DiskMB)
}
