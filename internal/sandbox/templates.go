package sandbox

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

// BuildTemplate builds a template: its rootfs, then a boot with envd up and the optional start
// command running and ready command succeeding, then a checkpoint that sandboxes restore from.
func (m *Manager) BuildTemplate(ctx context.Context, req BuildRequest, progress func(string)) (*Template, error) {
	if progress == nil {
		progress = func(string) {}
	}
	if !nameRe.MatchString(req.Name) {
		return nil, fmt.Errorf("template name %q: must match %s: %w", req.Name, nameRe, errdefs.ErrInvalid)
	}
	if req.From != "" && req.From != "debian:bookworm" {
		return nil, fmt.Errorf("from %q: only debian:bookworm is supported: %w", req.From, errdefs.ErrInvalid)
	}
	if old, err := m.cfg.Store.GetTemplate(ctx, req.Name); err == nil && old.Kind == "snapshot" {
		return nil, fmt.Errorf("%q is a snapshot: %w", req.Name, errdefs.ErrConflict)
	}
	start := time.Now()
	buildID := randomHex(4)
	dir := filepath.Join(m.cfg.DataDir, "templates", req.Name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	rootfs := filepath.Join(dir, "rootfs-"+buildID)
	progress(fmt.Sprintf("[1/3] rootfs for %q (build %s)", req.Name, buildID))
	if err := m.cfg.Builder.BuildRootFS(ctx, rootfs, progress); err != nil {
		return nil, err
	}
	tpl := &Template{
		ID:        req.Name,
		Kind:      "template",
		RootFS:    rootfs,
		CreatedAt: time.Now().UTC(),
		CPUCount:  req.CPUCount,
		MemoryMB:  req.MemoryMB,
		BuildID:   buildID,
	}
	progress("[2/3] booting the template with envd")
	image := filepath.Join(dir, "image-"+buildID)
	if err := m.warm(ctx, tpl, req, image, progress); err != nil {
		os.RemoveAll(rootfs)
		os.RemoveAll(image)
		return nil, fmt.Errorf("warm template: %w", err)
	}
	tpl.Image = image
	tpl.Ready = true
	if err := m.cfg.Store.PutTemplate(ctx, tpl); err != nil {
		return nil, err
	}
	m.pool.templateChanged(tpl)
	progress(fmt.Sprintf("template %q ready in %s", tpl.ID, time.Since(start).Round(time.Millisecond)))
	return tpl, nil
}

// warm boots tpl's rootfs, waits for envd, runs the start and ready commands and checkpoints
// the sandbox into image.
func (m *Manager) warm(ctx context.Context, tpl *Template, req BuildRequest, image string, progress func(string)) error {
	sb := &Sandbox{ID: "t" + newID()[1:], CPUCount: orDefault(tpl.CPUCount, m.cfg.CPUCount), MemoryMB: orDefault(tpl.MemoryMB, m.cfg.MemoryMB)}
	slot, err := m.cfg.Network.Acquire(ctx, Egress{})
	if err != nil {
		return err
	}
	defer m.cfg.Network.Release(context.Background(), slot.Index)
	inst := instanceID(sb.ID)
	spec := m.spec(sb, tpl, slot, inst)
	spec.StateDir = filepath.Join(filepath.Dir(image), "build-"+tpl.BuildID)
	defer os.RemoveAll(spec.StateDir)
	if err := os.MkdirAll(spec.StateDir, 0o755); err != nil {
		return err
	}
	t0 := time.Now()
	err = m.cfg.Driver.Start(ctx, spec)
	defer m.cfg.Driver.Delete(context.Background(), inst)
	if err != nil {
		return err
	}
	base := fmt.Sprintf("http://%s", netip.AddrPortFrom(slot.GuestIP, EnvdPort))
	if err := m.waitEnvd(ctx, base); err != nil {
		return err
	}
	progress(fmt.Sprintf("envd up after %s", time.Since(t0).Round(time.Millisecond)))
	if req.StartCmd != "" {
		progress("start command: " + req.StartCmd)
		cmd := fmt.Sprintf("exec >/tmp/ember-start.log 2>&1; exec /bin/bash -l -c %s", shellQuote(req.StartCmd))
		if _, _, err := m.envdCommand(ctx, base, cmd, false); err != nil {
			return fmt.Errorf("start command: %w", err)
		}
	}
	if req.ReadyCmd != "" {
		progress("waiting for ready command: " + req.ReadyCmd)
		deadline := time.Now().Add(2 * time.Minute)
		for {
			code, out, err := m.envdCommand(ctx, base, req.ReadyCmd, true)
			if err == nil && code == 0 {
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("ready command never succeeded: exit %d: %v: %s", code, err, out)
			}
			time.Sleep(500 * time.Millisecond)
		}
	}
	progress("[3/3] checkpointing")
	if err := os.MkdirAll(image, 0o755); err != nil {
		return err
	}
	t1 := time.Now()
	if err := m.cfg.Driver.Checkpoint(ctx, inst, image, runtime.CheckpointOptions{}); err != nil {
		return err
	}
	progress(fmt.Sprintf("checkpoint written in %s", time.Since(t1).Round(time.Millisecond)))
	return nil
}

func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

// ListTemplates lists templates and snapshots.
func (m *Manager) ListTemplates(ctx context.Context) ([]*Template, error) {
	return m.cfg.Store.ListTemplates(ctx)
}

// templateImage returns the local checkpoint image of tpl, fetching a stored snapshot into the
// node-local cache (verified) when it is not there.
func (m *Manager) templateImage(ctx context.Context, tpl *Template) (string, error) {
	if !tpl.SnapshotStored || m.cfg.Images == nil {
		return tpl.Image, nil
	}
	if _, err := os.Stat(filepath.Join(tpl.Image, ".complete")); err == nil {
		return tpl.Image, nil
	}
	os.RemoveAll(tpl.Image)
	if err := m.cfg.Images.Load(ctx, tpl.ID, tpl.Image); err != nil {
		return "", fmt.Errorf("snapshot %q: %w", tpl.ID, err)
	}
	if err := os.WriteFile(filepath.Join(tpl.Image, ".complete"), nil, 0o644); err != nil {
		return "", err
	}
	return tpl.Image, nil
}

// DeleteTemplate deletes a template or snapshot. Sandboxes that run from it keep running.
func (m *Manager) DeleteTemplate(ctx context.Context, id string) error {
	if !nameRe.MatchString(id) {
		return fmt.Errorf("template %q: %w", id, errdefs.ErrNotFound)
	}
	tpl, err := m.cfg.Store.GetTemplate(ctx, id)
	if err != nil {
		return err
	}
	if err := m.cfg.Store.DeleteTemplate(ctx, id); err != nil {
		return err
	}
	m.pool.templateChanged(&Template{ID: id})
	if tpl.Kind == "snapshot" {
		os.RemoveAll(tpl.Image)
		if tpl.SnapshotStored && m.cfg.Images != nil {
			if err := m.cfg.Images.Delete(ctx, id); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
				m.log.Warn("delete stored snapshot", "snapshot", id, "err", err)
			}
		}
	}
	// A template's rootfs may still back running or paused sandboxes: it is left in place.
	return nil
}
