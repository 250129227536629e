package cluster

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"sync"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// The cluster's templates. A template (or snapshot) that becomes ready on a node is exported
// to the image store (its layers by identity, content-addressed chunks deduplicated, and its
// checkpoint image), and only then registered under templates/<id> (no lease): every node
// lists the same templates, placement may choose a node that does not have one, and that node
// loads it from the store (verified) on its first create. A later build of the same name, on
// any node, replaces the record; nodes load the new build on their next create.
//
// `base` and the other start-up templates: the first node to build one registers it; a node
// that starts later loads the registered build instead of building its own, so every node's
// `base` is the same build and a checkpoint of a sandbox on base restores on any node.

// SharedTemplate is the value of templates/<id>.
type SharedTemplate struct {
	ID       string                   `json:"id"`
	Aliases  []string                 `json:"aliases,omitempty"`
	BuildID  string                   `json:"buildID"`
	Node     string                   `json:"node"` // where it was built
	Size     TemplateSize             `json:"size"`
	Portable sandbox.PortableTemplate `json:"portable"`
}

// Porter moves templates between this node and the image store (*sandbox.Manager).
type Porter interface {
	ExportTemplate(ctx context.Context, id string) (*sandbox.PortableTemplate, error)
	ImportTemplate(ctx context.Context, p *sandbox.PortableTemplate) (*sandbox.Template, error)
	GetTemplate(ctx context.Context, id string) (*sandbox.Template, error)
}

// applyTemplate updates the template cache; the caller holds mu. b nil: deleted.
func (cl *Cluster) applyTemplate(id string, b []byte) {
	if cl.templates == nil {
		cl.templates = map[string]*SharedTemplate{}
	}
	if b == nil {
		delete(cl.templates, id)
		return
	}
	var t SharedTemplate
	if err := cl.openJSON(cl.key("templates", id), b, &t); err == nil && t.ID == id {
		cl.templates[id] = &t
	} else if err != nil {
		cl.log.Warn("cluster: template record ignored", "template", id, "err", err)
	}
}

// sharedSize returns the size of a registered template (by id or alias); the caller holds mu.
func (cl *Cluster) sharedSize(id string) (TemplateSize, bool) {
	if t := cl.templates[id]; t != nil {
		return t.Size, true
	}
	for _, t := range cl.templates {
		for _, a := range t.Aliases {
			if a == id {
				return t.Size, true
			}
		}
	}
	return TemplateSize{}, false
}

// SharedTemplates lists the cluster's templates (from the watch-fed cache).
func (cl *Cluster) SharedTemplates() []SharedTemplate {
	cl.mu.RLock()
	defer cl.mu.RUnlock()
	out := make([]SharedTemplate, 0, len(cl.templates))
	for _, t := range cl.templates {
		out = append(out, *t)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// SharedTemplate returns the cluster's record of template id (by id or alias), reading etcd
// on a cache miss; nil if the cluster has none.
func (cl *Cluster) SharedTemplate(ctx context.Context, id string) (*SharedTemplate, error) {
	cl.mu.RLock()
	t := cl.templates[id]
	if t == nil {
		for _, c := range cl.templates {
			for _, a := range c.Aliases {
				if a == id {
					t = c
				}
			}
		}
	}
	cl.mu.RUnlock()
	if t != nil {
		c := *t
		return &c, nil
	}
	r, err := cl.c.Get(ctx, cl.key("templates", id))
	if err != nil {
		return nil, fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	if len(r.Kvs) == 0 {
		return nil, nil
	}
	var st SharedTemplate
	if err := cl.openJSON(string(r.Kvs[0].Key), r.Kvs[0].Value, &st); err != nil {
		return nil, fmt.Errorf("template %q: bad cluster record: %w", id, errdefs.ErrCorrupt)
	}
	return &st, nil
}

// PublishTemplate registers t. With replace false it registers t only if the cluster has no
// template of that id, and returns the record that won.
func (cl *Cluster) PublishTemplate(ctx context.Context, t SharedTemplate, replace bool) (*SharedTemplate, error) {
	k := cl.key("templates", t.ID)
	// Sealed: its init token and env (seal.go).
	v, err := cl.sealJSON(k, t)
	if err != nil {
		return nil, err
	}
	var conds []clientv3.Cmp
	if !replace {
		conds = append(conds, clientv3.Compare(clientv3.Version(k), "=", 0))
	}
	resp, err := cl.c.Txn(ctx).If(conds...).Then(clientv3.OpPut(k, v)).Else(clientv3.OpGet(k)).Commit()
	if err != nil {
		return nil, fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	if !resp.Succeeded {
		var won SharedTemplate
		if kvs := resp.Responses[0].GetResponseRange().Kvs; len(kvs) > 0 && cl.openJSON(k, kvs[0].Value, &won) == nil {
			return &won, nil
		}
	}
	_ = cl.WaitRevision(ctx, resp.Header.Revision)
	return &t, nil
}

// UnpublishTemplate removes template id from the cluster's templates.
func (cl *Cluster) UnpublishTemplate(ctx context.Context, id string) error {
	r, err := cl.c.Delete(ctx, cl.key("templates", id))
	if err != nil {
		return fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	return cl.WaitRevision(ctx, r.Header.Revision)
}

// SetTemplatePublic makes the cluster's template id (by id or alias) public or its team's
// alone again on every node (they follow templates/ in their watch); false if the cluster has
// no such template. A concurrent rebuild of the template wins: its record is read again.
func (cl *Cluster) SetTemplatePublic(ctx context.Context, id string, public bool) (bool, error) {
	ctx, done := cl.opCtx(ctx, cl.cfg.OpTimeout)
	defer done()
	for attempt := 0; attempt < 8; attempt++ {
		st, err := cl.SharedTemplate(ctx, id)
		if err != nil || st == nil {
			return false, err
		}
		k := cl.key("templates", st.ID)
		r, err := cl.c.Get(ctx, k)
		if err != nil {
			return false, fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
		}
		if len(r.Kvs) == 0 {
			return false, nil
		}
		var cur SharedTemplate
		if err := cl.openJSON(k, r.Kvs[0].Value, &cur); err != nil {
			return false, fmt.Errorf("template %q: bad cluster record: %w", id, errdefs.ErrCorrupt)
		}
		if cur.Portable.Template.Public == public {
			return true, nil
		}
		cur.Portable.Template.Public = public
		v, err := cl.sealJSON(k, cur)
		if err != nil {
			return false, err
		}
		resp, err := cl.c.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(k), "=", r.Kvs[0].ModRevision)).
			Then(clientv3.OpPut(k, v)).Commit()
		if err != nil {
			return false, fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
		}
		if resp.Succeeded {
			_ = cl.WaitRevision(ctx, resp.Header.Revision)
			return true, nil
		}
	}
	return false, fmt.Errorf("template %q kept changing: %w", id, errdefs.ErrConflict)
}

// Templates shares this node's templates with the cluster and loads the cluster's onto it.
type Templates struct {
	cl  *Cluster
	p   Porter
	log *slog.Logger

	mu      sync.Mutex
	loading map[string]*sync.Mutex // one load per template at a time
}

// NewTemplates returns the sharing of p's templates over cl.
func NewTemplates(cl *Cluster, p Porter) *Templates {
	return &Templates{cl: cl, p: p, log: cl.log, loading: map[string]*sync.Mutex{}}
}

// Share exports template id to the image store and registers it (replacing the cluster's
// record of that name, unless ifAbsent: then the cluster's record, if any, stays).
func (t *Templates) Share(ctx context.Context, id string, ifAbsent bool) (*SharedTemplate, error) {
	if ifAbsent {
		if st, err := t.cl.SharedTemplate(ctx, id); err != nil || st != nil {
			return st, err
		}
	}
	tpl, err := t.p.GetTemplate(ctx, id)
	if err != nil {
		return nil, err
	}
	pt, err := t.p.ExportTemplate(ctx, tpl.ID)
	if err != nil {
		return nil, err
	}
	st := SharedTemplate{ID: tpl.ID, Aliases: tpl.Aliases, BuildID: tpl.BuildID, Node: t.cl.NodeID(),
		Size: TemplateSize{CPU: tpl.CPUCount, MemoryMB: tpl.MemoryMB}, Portable: *pt}
	won, err := t.cl.PublishTemplate(ctx, st, !ifAbsent)
	if err != nil {
		return nil, err
	}
	t.log.Info("cluster: template shared", "template", tpl.ID, "build", won.BuildID, "node", won.Node)
	return won, nil
}

// Ensure makes this node hold the cluster's build of template id, loading it from the image
// store when it has another build or none. A template the cluster does not know is left to
// the node (its own, or not found).
func (t *Templates) Ensure(ctx context.Context, id string) error {
	st, err := t.cl.SharedTemplate(ctx, id)
	if err != nil || st == nil {
		return err
	}
	if local, err := t.p.GetTemplate(ctx, st.ID); err == nil && local.BuildID == st.BuildID && local.Ready {
		return nil
	} else if err != nil && !errors.Is(err, errdefs.ErrNotFound) {
		return err
	}
	t.mu.Lock()
	mu := t.loading[st.ID]
	if mu == nil {
		mu = &sync.Mutex{}
		t.loading[st.ID] = mu
	}
	t.mu.Unlock()
	mu.Lock()
	defer mu.Unlock()
	p := st.Portable
	if _, err := t.p.ImportTemplate(ctx, &p); err != nil {
		return fmt.Errorf("load template %q (build %s of node %s) from the image store: %w", st.ID, st.BuildID, st.Node, err)
	}
	return nil
}

// List lists the cluster's templates.
func (t *Templates) List() []SharedTemplate { return t.cl.SharedTemplates() }

// Remove drops template id from the cluster's templates.
func (t *Templates) Remove(ctx context.Context, id string) error {
	return t.cl.UnpublishTemplate(ctx, id)
}

// SetPublic makes the cluster's template id public or not everywhere (Cluster.SetTemplatePublic).
func (t *Templates) SetPublic(ctx context.Context, id string, public bool) (bool, error) {
	return t.cl.SetTemplatePublic(ctx, id, public)
}

// Shared returns the cluster's record of template id, or nil.
func (t *Templates) Shared(ctx context.Context, id string) (*SharedTemplate, error) {
	return t.cl.SharedTemplate(ctx, id)
}
