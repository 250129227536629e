package build

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/overlayfs"
	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// BuildTemplate builds a template: its rootfs, then a boot with envd up and the optional start
// command running and ready command succeeding, then a checkpoint that sandboxes restore from.
func (m *Manager) BuildTemplate(ctx context.Context, req BuildRequest, progress func(string)) (_ *Template, err error) {
	if progress == nil {
		progress = func(string) {}
	}
	req, err = m.checkBuild(req)
	if err != nil {
		return nil, err
	}
	ctx, done, err := m.op(ctx)
	if err != nil {
		return nil, err
	}
	defer done()
	select {
	case m.builds <- struct{}{}:
		defer func() { <-m.builds }()
	default:
		return nil, fmt.Errorf("%d template builds are running; try again later: %w", cap(m.builds), errdefs.ErrExhausted)
	}
	release, err := m.reserveName(req.Name, true)
	if err != nil {
		return nil, err
	}
	defer release()
	old, err := m.cfg.Store.GetTemplate(ctx, req.Name)
	if err == nil && old.Kind == "snapshot" {
		return nil, fmt.Errorf("%q is a snapshot: %w", req.Name, errdefs.ErrConflict)
	}
	ended := m.buildStarted()
	defer ended()
	if old != nil {
		// The build it replaces: its layers are collected once nothing runs on them.
		defer m.collectLayers(context.WithoutCancel(ctx), "template "+req.Name+" rebuilt")
	}
	start := time.Now()
	defer func() { m.observe(sandbox.StageTemplateBuild, start, err) }()
	buildID := randomHex(4)
	dir := m.templateDir(req.Name)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	rootfs := filepath.Join(dir, "rootfs-"+buildID)
	progress(fmt.Sprintf("[1/3] rootfs for %q (build %s)", req.Name, buildID))
	info, err := m.cfg.Builder.BuildRootFS(ctx, req, rootfs, progress)
	if err != nil {
		os.Remove(dir) // only when empty: a first build that failed leaves no directory
		return nil, err
	}
	if req.StartCmd == "" {
		req.StartCmd = info.StartCmd
	}
	tpl := &Template{
		ID:        req.Name,
		Kind:      "template",
		Team:      req.Team,
		RootFS:    rootfs,
		Lowers:    info.Lowers,
		CreatedAt: time.Now().UTC(),
		CPUCount:  req.CPUCount,
		MemoryMB:  req.MemoryMB,
		BuildID:   buildID,
		InitToken: randomHex(16),
		Env:       info.Env,
		User:      info.User,
		Workdir:   info.Workdir,
		Format:    TemplateFormat,
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
	if err := m.publish(ctx, tpl); err != nil {
		return nil, err
	}
	progress(fmt.Sprintf("template %q ready in %s", tpl.ID, time.Since(start).Round(time.Millisecond)))
	return tpl, nil
}

// warm boots tpl's rootfs, gives its envd the template's token, runs the start and ready
// commands and checkpoints the instance into image. The instance goes through the one launch
// path under a throw-away owner id; its directory is removed when warm returns.
//
// The image is restored once before warm returns, and made again if it does not restore: an
// image that cannot be restored would fail every create of the template. (CI saw one: every
// restore panicked in gVisor's netstack, "unexpected tcp state in processor: BOUND", an
// endpoint saved with segments queued while its connection was being set up or closed.)
func (m *Manager) warm(ctx context.Context, tpl *Template, req BuildRequest, image string, progress func(string)) error {
	var err error
	for attempt := 1; attempt <= warmAttempts; attempt++ {
		if err = m.warmOnce(ctx, tpl, req, image, progress); err != nil {
			return err
		}
		t0 := time.Now()
		if err = m.tryRestore(ctx, tpl, image); err == nil {
			progress(fmt.Sprintf("image restored in %s", time.Since(t0).Round(time.Millisecond)))
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		m.log.Warn("a template image did not restore", "template", tpl.ID, "attempt", attempt, "err", err)
		progress(fmt.Sprintf("the image did not restore (%v)", err))
		if rerr := overlayfs.RemoveTree(image, overlayfs.DetachMounts); rerr != nil {
			return rerr
		}
	}
	return fmt.Errorf("the template's image did not restore after %d attempts: %w", warmAttempts, err)
}

// warmAttempts bounds the warm-ups of one template build.
const warmAttempts = 2

// tryRestore restores image (an instance of tpl, envd answering /init) and tears it down.
func (m *Manager) tryRestore(ctx context.Context, tpl *Template, image string) error {
	spec := warmSpec(tpl)
	spec.Image = image
	p, err := m.launch(ctx, spec)
	if err != nil {
		return err
	}
	p.Close(context.WithoutCancel(ctx))
	return nil
}

// warmSpec is the build sandbox of tpl's warm-up: envd holds the template's token from its
// first moments, and a disk limit as a sandbox's keeps the start command from filling the
// node's disk.
func warmSpec(tpl *Template) sandbox.BuildSandboxSpec {
	return sandbox.BuildSandboxSpec{Kind: 't', Template: tpl, Token: tpl.InitToken,
		CPUCount: tpl.CPUCount, MemoryMB: tpl.MemoryMB, DiskMB: tpl.DiskMB}
}

// warmOnce is one warm-up of warm: boot, start and ready commands, checkpoint.
func (m *Manager) warmOnce(ctx context.Context, tpl *Template, req BuildRequest, image string, progress func(string)) error {
	t0 := time.Now()
	// envd holds a token from its first moments: every instance restored from this image (the
	// pool's among them) answers only to the daemon until /init gives it its sandbox's token.
	p, err := m.launch(ctx, warmSpec(tpl))
	if err != nil {
		return err
	}
	defer p.Close(context.WithoutCancel(ctx))
	base := p.EnvdURL
	progress(fmt.Sprintf("envd up after %s", time.Since(t0).Round(time.Millisecond)))
	user := req.StartUser
	if user == "" {
		user = "root"
	}
	if req.StartCmd != "" {
		progress("start command: " + req.StartCmd)
		cmd := fmt.Sprintf("exec >/tmp/ember-start.log 2>&1; exec /bin/bash -l -c %s", shellQuote(req.StartCmd))
		if _, _, err := envdCommandAs(ctx, p.Client, base, tpl.InitToken, user, cmd, false); err != nil {
			return fmt.Errorf("start command: %w", err)
		}
	}
	if req.ReadyCmd != "" {
		progress("waiting for ready command: " + req.ReadyCmd)
		deadline := time.Now().Add(ReadyTimeout)
		for {
			actx, cancel := context.WithTimeout(ctx, min(ReadyAttemptTimeout, max(time.Until(deadline), 0)))
			code, out, err := envdCommandAs(actx, p.Client, base, tpl.InitToken, user, req.ReadyCmd, true)
			cancel()
			if err == nil && code == 0 {
				break
			}
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("ready command never succeeded: exit %d: %v: %s", code, err, out)
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(500 * time.Millisecond):
			}
		}
	}
	progress("[3/3] checkpointing")
	if err := os.MkdirAll(image, 0o700); err != nil {
		return err
	}
	t1 := time.Now()
	if err := m.cfg.Driver.Checkpoint(ctx, p.InstanceID, image, runtime.CheckpointOptions{}); err != nil {
		return err
	}
	// The image keeps a plain layer (the warm-up's was disk-limited): sandboxes restored from
	// it get their own limit as before.
	if ud, ok := m.cfg.Driver.(runtime.UpperDirer); ok {
		if _, err := ud.UpperDir(image); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
			return err
		}
	}
	progress(fmt.Sprintf("checkpoint written in %s", time.Since(t1).Round(time.Millisecond)))
	return nil
}

// ReadyTimeout bounds the wait for a template's ready command to succeed, and
// ReadyAttemptTimeout each run of it (tests shorten them).
var (
	ReadyTimeout        = 2 * time.Minute
	ReadyAttemptTimeout = 30 * time.Second
)

// validFrom reports whether req names a rootfs source the builder knows.
func validFrom(req BuildRequest) bool {
	if req.FromImage != "" || req.FromArchive != "" {
		return req.From == "" || req.From == "debian:bookworm"
	}
	switch {
	case req.From == "", req.From == "debian:bookworm":
		return true
	case strings.HasPrefix(req.From, "docker://"), strings.HasPrefix(req.From, "docker+http://"), strings.HasPrefix(req.From, "archive:"):
		return true
	}
	return false
}

func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }
