package edge

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"

	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/template/build"
)

// TemplateSharer is what the edge needs of the cluster's templates (in cluster mode with an
// image store shared by the nodes; *cluster.Templates).
type TemplateSharer interface {
	// Ensure makes this node hold the cluster's build of template id (loading it from the
	// image store when needed); a template the cluster does not know is left to the node.
	Ensure(ctx context.Context, id string) error
	// List lists the cluster's templates.
	List() []cluster.SharedTemplate
	// Remove drops template id from the cluster's templates.
	Remove(ctx context.Context, id string) error
}

// ShareTemplates makes the cluster's templates this node's: a create loads its template from
// the image store first when this node does not have the cluster's build, the template list
// is the cluster's (the same on every node), and a delete removes the template everywhere.
func ShareTemplates(svc sandbox.Service, t TemplateSharer) sandbox.Service {
	return &sharedService{Service: svc, t: t}
}

type sharedService struct {
	sandbox.Service
	t TemplateSharer
}

func (s *sharedService) Create(ctx context.Context, req sandbox.CreateRequest) (*sandbox.Sandbox, error) {
	if err := s.t.Ensure(ctx, req.TemplateID); err != nil {
		return nil, err
	}
	return s.Service.Create(ctx, req)
}

// ListTemplates lists the cluster's templates, and this node's own that the cluster does not
// have (a snapshot still uploading, a template built before the node joined).
func (s *sharedService) ListTemplates(ctx context.Context) ([]*sandbox.Template, error) {
	local, err := s.Service.ListTemplates(ctx)
	if err != nil {
		return nil, err
	}
	shared := s.t.List()
	byID := map[string]bool{}
	out := make([]*sandbox.Template, 0, len(shared)+len(local))
	for _, st := range shared {
		t := st.Portable.Template
		t.Ready = true
		byID[t.ID] = true
		out = append(out, &t)
	}
	for _, t := range local {
		// A template loaded from the cluster and deleted there since is not listed.
		if !byID[t.ID] && !sandbox.Loaded(t) {
			out = append(out, t)
		}
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].CreatedAt.After(out[j].CreatedAt) })
	return out, nil
}

// ListSnapshots lists the cluster's named snapshots (optionally of one source sandbox), and
// this node's own that the cluster does not have yet, as ListTemplates lists templates: the
// same through every edge, wherever the snapshot was taken.
func (s *sharedService) ListSnapshots(ctx context.Context, sandboxID string) ([]*sandbox.Template, error) {
	all, err := s.ListTemplates(ctx)
	if err != nil {
		return nil, err
	}
	var out []*sandbox.Template
	for _, t := range all {
		if t.Kind == "snapshot" && (sandboxID == "" || t.SourceSandbox == sandboxID) {
			out = append(out, t)
		}
	}
	return out, nil
}

// DeleteTemplate deletes the template here and from the cluster's templates (other nodes'
// copies stay for the sandboxes that run on them; no new create finds them).
func (s *sharedService) DeleteTemplate(ctx context.Context, id string) error {
	err := s.Service.DeleteTemplate(ctx, id)
	if err != nil && !errors.Is(err, errdefs.ErrNotFound) {
		return err
	}
	known := err == nil
	for _, st := range s.t.List() {
		if st.ID == id {
			known = true
			if rerr := s.t.Remove(ctx, id); rerr != nil {
				return rerr
			}
		}
	}
	if !known {
		return err
	}
	return nil
}

// ShareBuilder makes GET /templates/{id} answer with the cluster's templates too, as the
// template list does, when svc is ShareTemplates's; else it returns b.
func ShareBuilder(b build.TemplateBuilder, svc sandbox.Service) build.TemplateBuilder {
	if ss, ok := svc.(*sharedService); ok {
		return sharedBuilder{TemplateBuilder: b, t: ss.t}
	}
	return b
}

type sharedBuilder struct {
	build.TemplateBuilder
	t TemplateSharer
}

func (b sharedBuilder) GetTemplate(ctx context.Context, id string) (*sandbox.Template, error) {
	for _, st := range b.t.List() {
		if st.ID == id || slices.Contains(st.Aliases, id) {
			t := st.Portable.Template
			t.Ready = true
			return &t, nil
		}
	}
	t, err := b.TemplateBuilder.GetTemplate(ctx, id)
	if err == nil && sandbox.Loaded(t) {
		// Loaded from the cluster, and deleted there since.
		return nil, fmt.Errorf("template %q: %w", id, errdefs.ErrNotFound)
	}
	return t, err
}
