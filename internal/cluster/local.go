package cluster

import (
	"context"

	"github.com/ember-sandbox/ember/internal/sandbox"
)

// Manager is what ManagerLocal needs of the sandbox Manager.
type Manager interface {
	List(ctx context.Context, f sandbox.ListFilter) ([]*sandbox.Sandbox, error)
	ListTemplates(ctx context.Context) ([]*sandbox.Template, error)
	Kill(ctx context.Context, id string) error
}

// ManagerLocal is the Local view of a node's sandbox Manager.
func ManagerLocal(m Manager) Local { return managerLocal{m} }

type managerLocal struct{ m Manager }

func (l managerLocal) Sandboxes(ctx context.Context) ([]LocalSandbox, error) {
	sbxs, err := l.m.List(ctx, sandbox.ListFilter{States: []sandbox.State{sandbox.StateRunning, sandbox.StatePaused}})
	if err != nil {
		return nil, err
	}
	out := make([]LocalSandbox, 0, len(sbxs))
	for _, s := range sbxs {
		if s.State == sandbox.StateKilled {
			continue
		}
		out = append(out, localOf(s))
	}
	return out, nil
}

func localOf(s *sandbox.Sandbox) LocalSandbox {
	l := LocalSandbox{ID: s.ID, TemplateID: s.TemplateID, Running: s.State == sandbox.StateRunning, CPU: s.CPUCount, MemoryMB: s.MemoryMB}
	for _, v := range s.VolumeMounts {
		l.Volumes = append(l.Volumes, v.ID)
	}
	return l
}

func (l managerLocal) Templates(ctx context.Context) (map[string]TemplateSize, error) {
	ts, err := l.m.ListTemplates(ctx)
	if err != nil {
		return nil, err
	}
	out := map[string]TemplateSize{}
	for _, t := range ts {
		if !t.Ready {
			continue
		}
		sz := TemplateSize{CPU: t.CPUCount, MemoryMB: t.MemoryMB}
		out[t.ID] = sz
		for _, a := range t.Aliases {
			out[a] = sz
		}
	}
	return out, nil
}

func (l managerLocal) Kill(ctx context.Context, id string) error { return l.m.Kill(ctx, id) }
