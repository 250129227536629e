package build

import (
	"bytes"
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// Built-in templates: templates ember builds itself, from steps, the first time they are asked
// for (a create that names one, or the daemon's --templates at start). They are ordinary step
// builds (E2B's template build flow, cached by step), so they are listed, rebuilt and deleted
// like any template. internal/codeinterp defines code-interpreter-v1 this way.

// BuiltinTemplate is the definition of a built-in template.
type BuiltinTemplate struct {
	Build    StepBuildRequest
	CPUCount int
	MemoryMB int
	// Files are the tarballs of its COPY steps by their FilesHash, stored as a build's uploads
	// are before it starts.
	Files map[string][]byte
}

// builtinRuns makes one build at a time per built-in template; callers that arrive meanwhile
// wait for it.
type builtinRuns struct {
	mu  sync.Mutex
	run map[string]*builtinRun
}

type builtinRun struct {
	done chan struct{}
	tpl  *Template
	err  error
}

// IsBuiltin reports whether name is a built-in template of this manager.
func (m *Manager) IsBuiltin(name string) bool {
	_, ok := m.cfg.Builtins[name]
	return ok
}

// EnsureBuiltin builds the built-in template name: a step build of its definition (steps that
// are unchanged come from the cache, and an unchanged template is not rebuilt at all). The
// build goes on when ctx ends (a later call joins it); progress receives its log lines.
func (m *Manager) EnsureBuiltin(ctx context.Context, name string, progress func(string)) (*Template, error) {
	def, ok := m.cfg.Builtins[name]
	if !ok {
		return nil, fmt.Errorf("template %q is not a built-in template: %w", name, errdefs.ErrNotFound)
	}
	m.builtin.mu.Lock()
	if m.builtin.run == nil {
		m.builtin.run = map[string]*builtinRun{}
	}
	r := m.builtin.run[name]
	if r == nil {
		r = &builtinRun{done: make(chan struct{})}
		m.builtin.run[name] = r
		go func() {
			r.tpl, r.err = m.buildBuiltin(m.bg, name, def, progress)
			m.builtin.mu.Lock()
			delete(m.builtin.run, name)
			m.builtin.mu.Unlock()
			close(r.done)
		}()
	}
	m.builtin.mu.Unlock()
	select {
	case <-r.done:
		return r.tpl, r.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (m *Manager) buildBuiltin(ctx context.Context, name string, def BuiltinTemplate, progress func(string)) (*Template, error) {
	if progress == nil {
		progress = func(line string) { m.log.Debug("built-in template build", "template_id", name, "line", line) }
	}
	b, err := m.RequestBuild(ctx, BuildSpec{Name: name, CPUCount: def.CPUCount, MemoryMB: def.MemoryMB})
	if err != nil {
		return nil, err
	}
	for hash, data := range def.Files {
		if ok, err := m.HasBuildFiles(ctx, hash); err != nil {
			return nil, err
		} else if !ok {
			if err := m.PutBuildFiles(ctx, hash, bytes.NewReader(data)); err != nil {
				return nil, err
			}
		}
	}
	start := time.Now()
	m.log.Info("building the built-in template (its log: GET /templates/{id}/builds/{build}/status)", "template_id", name, "build_id", b.ID)
	defer func() {
		m.log.Info("built-in template build ended", "template_id", name, "build_id", b.ID, "took", time.Since(start).Round(time.Millisecond))
	}()
	if err := m.StartBuild(ctx, name, b.ID, def.Build); err != nil {
		return nil, err
	}
	seen := 0
	for {
		cur, err := m.GetBuild(ctx, name, b.ID)
		if err != nil {
			return nil, err
		}
		for ; seen < len(cur.Logs); seen++ {
			progress(cur.Logs[seen].Message)
		}
		switch cur.Status {
		case BuildReady:
			return m.cfg.Store.GetTemplate(ctx, name)
		case BuildError:
			msg := "unknown reason"
			if cur.Reason != nil {
				msg = cur.Reason.Message
			}
			return nil, fmt.Errorf("build of the built-in template %q failed: %s: %w", name, msg, errdefs.ErrUnavailable)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}
