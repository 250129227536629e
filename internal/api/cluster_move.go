package api

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sort"
	"strings"

	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// TemplateSharer is what the edge needs of the cluster's templates (Config.Templates, in
// cluster mode with an image store shared by the nodes; *cluster.Templates).
type TemplateSharer interface {
	// Ensure makes this node hold the cluster's build of template id (loading it from the
	// image store when needed); a template the cluster does not know is left to the node.
	Ensure(ctx context.Context, id string) error
	// List lists the cluster's templates.
	List() []cluster.SharedTemplate
	// Remove drops template id from the cluster's templates.
	Remove(ctx context.Context, id string) error
}

// sharedService makes the cluster's templates this node's: a create loads its template from
// the image store first when this node does not have the cluster's build, the template list
// is the cluster's (the same on every node), and a delete removes the template everywhere.
type sharedService struct {
	sandbox.Service
	t TemplateSharer
}

func (s *sharedService) unwrap() sandbox.Service  { return s.Service }
func (c *clusterService) unwrap() sandbox.Service { return c.Service }

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
		if !byID[t.ID] {
			out = append(out, t)
		}
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].CreatedAt.After(out[j].CreatedAt) })
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

// unwrapped returns the Service beneath the cluster's wrappers (for the optional interfaces
// of the Manager, such as sandbox.TemplateBuilder).
func unwrapped(svc sandbox.Service) sandbox.Service {
	for {
		u, ok := svc.(interface{ unwrap() sandbox.Service })
		if !ok {
			return svc
		}
		svc = u.unwrap()
	}
}

// PausedMover moves stored paused sandboxes to this node (Config.Mover; *cluster.Moves).
type PausedMover interface {
	// Adopt makes stored sandbox id this node's (loaded from the image store, paused here).
	Adopt(ctx context.Context, id string) error
}

// moveRoutes: POST /ember/sandboxes/{id}/adopt, which an edge sends to the node it placed a
// stored paused sandbox on.
func (s *server) moveRoutes(rt *router) {
	rt.handle(http.MethodPost, "/ember/sandboxes/{id}/adopt", s.adoptSandbox)
}

func (s *server) adoptSandbox(w http.ResponseWriter, r *http.Request, p params) error {
	if s.cfg.Mover == nil {
		return errNoCluster
	}
	id := p["id"]
	if !validSandboxID(id) {
		return notFound("sandbox %s not found", quoteID(id))
	}
	if err := s.cfg.Mover.Adopt(r.Context(), id); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// relocate moves a stored paused sandbox whose node is gone or drained to a node placement
// chooses (its own node first, if it is a candidate), before its request is served there, and
// returns where the sandbox is now. Anything else is left where it is.
func (s *server) relocate(r *http.Request, id string, loc cluster.Location) (cluster.Location, error) {
	if s.cfg.Mover == nil || !loc.Stored || loc.Lost != nil {
		return loc, nil
	}
	draining := false
	if v, err := s.cl.Node(loc.Node); err == nil && v.State == cluster.StateDraining {
		draining = true
	}
	if !loc.Dead && loc.URL != "" && !draining || loc.Local && !draining {
		return loc, nil
	}
	ctx := r.Context()
	var exclude []string
	for attempt := 0; attempt < maxPlacements; attempt++ {
		resv, err := s.cl.Place(ctx, cluster.PlaceRequest{TemplateID: loc.TemplateID, Prefer: loc.Node, Exclude: exclude})
		if err != nil {
			return loc, err
		}
		err = s.adoptOn(r, resv, id)
		s.cl.Cancel(context.WithoutCancel(ctx), resv) // adopted paused: it takes room when it resumes
		if err == nil {
			s.log.Info("cluster: moved a stored paused sandbox", "sandbox_id", id, "from", loc.Node, "to", resv.Node)
			return s.cl.Locate(ctx, id, true)
		}
		if errors.Is(err, errdefs.ErrConflict) {
			// Moved meanwhile by another edge, or its node serves it after all.
			return s.cl.Locate(ctx, id, true)
		}
		s.log.Warn("cluster: adopting a stored sandbox failed: trying another node", "sandbox_id", id, "node", resv.Node, "err", err)
		exclude = append(exclude, resv.Node)
	}
	return loc, fmt.Errorf("no node could adopt paused sandbox %q: %w", id, errdefs.ErrUnavailable)
}

// adoptOn has the node of resv adopt sandbox id.
func (s *server) adoptOn(r *http.Request, resv *cluster.Reservation, id string) error {
	if resv.Local {
		return s.cfg.Mover.Adopt(r.Context(), id)
	}
	out, err := http.NewRequestWithContext(r.Context(), http.MethodPost, strings.TrimSuffix(resv.URL, "/")+"/ember/sandboxes/"+id+"/adopt", nil)
	if err != nil {
		return err
	}
	for _, h := range []string{"X-API-Key", "Authorization"} {
		if v := r.Header.Get(h); v != "" {
			out.Header.Set(h, v)
		}
	}
	out.Header.Set(HeaderForwarded, s.cl.NodeID())
	resp, err := s.nodeTransport.RoundTrip(out)
	if err != nil {
		return fmt.Errorf("node %s did not answer: %w", resv.Node, errdefs.ErrUnavailable)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
	switch {
	case resp.StatusCode == http.StatusNoContent:
		return nil
	case resp.StatusCode == http.StatusConflict:
		return fmt.Errorf("node %s: %s: %w", resv.Node, body, errdefs.ErrConflict)
	}
	return fmt.Errorf("node %s: adopt: %d %s: %w", resv.Node, resp.StatusCode, body, errdefs.ErrUnavailable)
}
