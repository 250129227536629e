package cluster

import (
	"context"
	"fmt"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// Events keeps the cluster in step with this node's Manager: it is the Manager's
// sandbox.Listener, told every change where it commits, whoever caused it (an API call, the
// reaper, traffic waking a sandbox, a dead instance). A sandbox that starts or resumes here is
// claimed (routed here, its stored pause image, now stale, deleted) before the operation
// answers; one that ends is released (route, stored record and pause image); a memory pause
// is recorded stored once its image is in the store; a template that becomes ready here is
// shared with the cluster.
type Events struct {
	cl  *Cluster
	mv  *Moves     // nil without an image store shared by the nodes
	tpl *Templates // nil without
}

// NewEvents returns the listener that keeps cl in step with this node's sandboxes; mv and t
// are nil without an image store shared by the nodes.
func NewEvents(cl *Cluster, mv *Moves, t *Templates) *Events {
	return &Events{cl: cl, mv: mv, tpl: t}
}

// Changed applies one change of this node (sandbox.Listener).
func (ev *Events) Changed(ctx context.Context, e sandbox.Event) error {
	switch e.Kind {
	case sandbox.EventStarted:
		return ev.cl.Claim(ctx, localOf(e.Sandbox), e.Reservation)
	case sandbox.EventResumed:
		image := ev.storedImage(ctx, e.Sandbox.ID)
		// Running here: the route stops being stored (and its stored record goes with it).
		if err := ev.cl.Claim(ctx, localOf(e.Sandbox), ""); err != nil {
			return err
		}
		if image != "" {
			ev.mv.p.DeleteStored(context.WithoutCancel(ctx), image)
		}
	case sandbox.EventStored:
		if ev.mv == nil {
			return fmt.Errorf("no image store shared by the nodes: %w", errdefs.ErrUnavailable)
		}
		return ev.mv.Stored(ctx, e.Stored)
	case sandbox.EventEnded:
		image := ev.storedImage(ctx, e.Sandbox.ID)
		ev.cl.Release(ctx, e.Sandbox.ID)
		if image != "" {
			ev.mv.p.DeleteStored(context.WithoutCancel(ctx), image)
		}
	case sandbox.EventTemplateReady:
		if ev.tpl != nil {
			if _, err := ev.tpl.Share(ctx, e.Template.ID, false); err != nil {
				return fmt.Errorf("share template %q: %w", e.Template.ID, err)
			}
		}
	}
	return nil
}

// storedImage is the store id of this node's sandbox id's stored pause image ("" if none).
func (ev *Events) storedImage(ctx context.Context, id string) string {
	if ev.mv == nil {
		return ""
	}
	if r := ev.cl.route(id); r == nil || r.Node != ev.cl.cfg.NodeID || r.Epoch != ev.cl.epoch.Load() {
		return "" // another node's (it adopted the sandbox): its image is its own
	}
	return ev.mv.StoredImage(ctx, id)
}
