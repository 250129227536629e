package api

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// Teams (auth): every request of a key acts for the key's team (auth.TeamOf of its context).
// The team checks live here, in the object lookup: lookupSandbox and lookupTemplate find an
// object for the caller, and another team's answers exactly as a missing one (404 with E2B's
// wording). The router runs them before every /sandboxes/{id}… and /templates/{id}… route
// (guard), and scoped — the sandbox.Service the handlers call — filters lists and stamps what
// a create, a snapshot or a build makes with the caller's team. A context without a caller (the
// sandbox plane, a signed URL, a node's internal call) is not scoped.

// scoped is the node's (or the cluster's) sandbox.Service as the request's team sees it.
type scoped struct {
	sandbox.Service
	s *server
}

// errForeign marks the lookup's miss for an object of another team (a 404 like any miss).
var errForeign = fmt.Errorf("of another team: %w", errdefs.ErrNotFound)

// errSandboxNotFound is the lookup's miss for another team's sandbox; the route gives it
// E2B's wording.
func errSandboxNotFound(id string) error {
	return fmt.Errorf("sandbox %q: %w", id, errForeign)
}

// errTemplateNotFound is the template lookup's miss, in E2B's wording.
func errTemplateNotFound(id string) error {
	return &httpError{status: http.StatusNotFound, msg: "template " + quoteTemplate(id) + " not found"}
}

// sees reports whether the caller of ctx may see an object of team (every caller sees
// everything when ctx has none: an internal call).
func sees(ctx context.Context, team string) bool {
	c, ok := auth.CallerOf(ctx)
	return !ok || auth.Owner(team) == c.Team
}

// publicTemplate reports whether every team may read and use t: made public, or one of the
// node's own templates (built-in ones, base) made before any team asked.
func (s *server) publicTemplate(t *sandbox.Template) bool {
	if t.Public {
		return true
	}
	if t.Team != "" || t.Kind == "snapshot" {
		return false
	}
	if t.ID == "base" {
		return true
	}
	// The build manager knows the built-in templates (the Manager only builds them through it).
	for _, x := range []any{s.cfg.Builds, s.node} {
		if b, ok := x.(interface{ IsBuiltin(string) bool }); ok && b.IsBuiltin(t.ID) {
			return true
		}
	}
	return false
}

// visibleTemplate reports whether the caller of ctx may read and use t.
func (s *server) visibleTemplate(ctx context.Context, t *sandbox.Template) bool {
	return sees(ctx, t.Team) || s.publicTemplate(t)
}

// lookupSandbox is the object lookup of a sandbox: the sandbox, or a miss for one of another
// team.
func (s *server) lookupSandbox(ctx context.Context, id string) (*sandbox.Sandbox, error) {
	sb, err := s.node.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	if !sees(ctx, sb.Team) {
		return nil, errSandboxNotFound(id)
	}
	return sb, nil
}

// lookupTemplate is the object lookup of a template (or snapshot) by id or name: the
// template, or a miss for one the caller may not see; write, for a change to it, also refuses
// another team's public one.
func (s *server) lookupTemplate(ctx context.Context, id string, write bool) (*sandbox.Template, error) {
	t, err := s.findTemplate(ctx, id)
	if err != nil {
		return nil, err
	}
	if !s.visibleTemplate(ctx, t) {
		return nil, errTemplateNotFound(id)
	}
	if write && !sees(ctx, t.Team) {
		return nil, &httpError{status: http.StatusForbidden, msg: "template " + quoteTemplate(id) + " is public but belongs to another team"}
	}
	return t, nil
}

// checkTemplate refuses, as lookupTemplate does, a template the caller may not see (or, with
// write, change); one this node does not have is left to the caller.
func (s *server) checkTemplate(ctx context.Context, id string, write bool) error {
	if _, err := s.findTemplate(ctx, id); err != nil {
		return nil
	}
	_, err := s.lookupTemplate(ctx, id, write)
	return err
}

// findTemplate finds a template by id or name (unscoped).
func (s *server) findTemplate(ctx context.Context, id string) (*sandbox.Template, error) {
	if b, err := s.builder(); err == nil {
		if t, err := b.GetTemplate(ctx, id); err == nil {
			return t, nil
		}
	}
	name, _ := sandbox.SplitTemplateName(id)
	ts, err := s.shared.ListTemplates(ctx)
	if err != nil {
		return nil, err
	}
	for _, t := range ts {
		if templateHasName(t, name) {
			return t, nil
		}
	}
	return nil, errTemplateNotFound(id)
}

// guard runs the object lookup before a route on one object: /sandboxes/{id}… and
// /templates/{id}… (a build by its build record, which exists before its template does). An
// object this node does not have is left to the route, which answers as it does.
func (s *server) guard(method, pattern string, h handlerFunc) handlerFunc {
	segs := splitPath(pattern)
	if len(segs) > 0 && segs[0] == "v2" {
		segs = segs[1:]
	}
	if len(segs) < 2 || segs[1] != "{id}" {
		return h
	}
	switch {
	case segs[0] == "sandboxes":
		return func(w http.ResponseWriter, r *http.Request, p params) error {
			if id, err := sandboxIDParam(p); err == nil {
				if _, err := s.lookupSandbox(r.Context(), id); errors.Is(err, errForeign) {
					return err
				}
			}
			return h(w, r, p)
		}
	case segs[0] == "templates" && strings.Contains(pattern, "{buildID}"):
		return func(w http.ResponseWriter, r *http.Request, p params) error {
			if err := s.lookupBuild(r.Context(), p["id"], p["buildID"]); err != nil {
				return err
			}
			return h(w, r, p)
		}
	case segs[0] == "templates" && !strings.HasSuffix(pattern, "/files/{hash}"): // uploads: content-addressed, before the template exists
		write := method != http.MethodGet
		return func(w http.ResponseWriter, r *http.Request, p params) error {
			if err := s.checkTemplate(r.Context(), p["id"], write); err != nil {
				return err
			}
			return h(w, r, p)
		}
	}
	return h
}

// lookupBuild is the object lookup of a build: a miss for another team's.
func (s *server) lookupBuild(ctx context.Context, templateID, buildID string) error {
	b := s.cfg.Builds
	if b == nil {
		return nil
	}
	bld, err := b.GetBuild(ctx, templateID, buildID)
	if err != nil {
		return nil // the handler answers as it does
	}
	if !sees(ctx, bld.Team) {
		return notFound("build %s of template %s not found", quoteID(buildID), quoteTemplate(templateID))
	}
	return nil
}

// Get is the lookup: another team's sandbox is missing.
func (c scoped) Get(ctx context.Context, id string) (*sandbox.Sandbox, error) {
	sb, err := c.Service.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	if !sees(ctx, sb.Team) {
		return nil, errSandboxNotFound(id)
	}
	return sb, nil
}

// Create makes the sandbox the caller's team's, from a template the team may use.
func (c scoped) Create(ctx context.Context, req sandbox.CreateRequest) (*sandbox.Sandbox, error) {
	if _, ok := auth.CallerOf(ctx); ok {
		if t, err := c.s.findTemplate(ctx, req.TemplateID); err == nil && !c.s.visibleTemplate(ctx, t) {
			return nil, errTemplateNotFound(req.TemplateID)
		}
		req.Team = auth.TeamOf(ctx)
	}
	release, err := c.s.admit(ctx, c.s.createUsage(ctx, req.TemplateID))
	if err != nil {
		return nil, err
	}
	defer release()
	return c.Service.Create(ctx, req)
}

// List lists the caller's team's sandboxes.
func (c scoped) List(ctx context.Context, f sandbox.ListFilter) ([]*sandbox.Sandbox, error) {
	sbxs, err := c.Service.List(ctx, f)
	return keep(sbxs, func(sb *sandbox.Sandbox) bool { return sees(ctx, sb.Team) }), err
}

// ListTemplates lists the templates the caller's team may see: its own and public ones.
func (c scoped) ListTemplates(ctx context.Context) ([]*sandbox.Template, error) {
	ts, err := c.Service.ListTemplates(ctx)
	return keep(ts, func(t *sandbox.Template) bool { return c.s.visibleTemplate(ctx, t) }), err
}

// ListSnapshots lists the caller's team's snapshots.
func (c scoped) ListSnapshots(ctx context.Context, sandboxID string) ([]*sandbox.Template, error) {
	ts, err := c.Service.ListSnapshots(ctx, sandboxID)
	return keep(ts, func(t *sandbox.Template) bool { return sees(ctx, t.Team) }), err
}

// scopeBuild makes an image build the caller's team's (not over another team's template name)
// and admits it against the team's build quota; release ends the admission.
func (s *server) scopeBuild(ctx context.Context, req *sandbox.BuildRequest) (release func(), err error) {
	if _, ok := auth.CallerOf(ctx); ok {
		if err := s.claimTemplateName(ctx, req.Name); err != nil {
			return nil, err
		}
		req.Team = auth.TeamOf(ctx)
	}
	return s.admit(ctx, s.buildUsage())
}

// Pools lists the pools of the templates the caller's team may use (an admin key: every
// pool), and of the sandboxes kept ready for resume only the team's.
func (c scoped) Pools(ctx context.Context) []sandbox.PoolState {
	all := c.Service.Pools(ctx)
	if _, ok := auth.CallerOf(ctx); !ok || auth.IsAdmin(ctx) {
		return all
	}
	ts, err := c.Service.ListTemplates(ctx)
	if err != nil {
		return []sandbox.PoolState{}
	}
	out := make([]sandbox.PoolState, 0, len(all))
	for _, st := range all {
		if !slices.ContainsFunc(ts, func(t *sandbox.Template) bool { return t.ID == st.TemplateID && c.s.visibleTemplate(ctx, t) }) {
			continue
		}
		if st.Kind == "resume" {
			st.SandboxIDs = slices.DeleteFunc(slices.Clone(st.SandboxIDs), func(id string) bool {
				sb, err := c.s.node.Get(ctx, id)
				return err != nil || !sees(ctx, sb.Team)
			})
		}
		out = append(out, st)
	}
	return out
}

// WarmPool warms a template the caller's team may use.
func (c scoped) WarmPool(ctx context.Context, templateID string, count int) (sandbox.PoolState, error) {
	if err := c.s.checkTemplate(ctx, templateID, false); err != nil {
		return sandbox.PoolState{}, err
	}
	return c.Service.WarmPool(ctx, templateID, count)
}

// claimTemplateName refuses a build under a name another team's template has (template names
// are one namespace on a node).
func (s *server) claimTemplateName(ctx context.Context, name string) error {
	n, _ := sandbox.SplitTemplateName(name)
	t, err := s.findTemplate(ctx, n)
	if err != nil || sees(ctx, t.Team) {
		return nil
	}
	return &httpError{status: http.StatusConflict, msg: "template name " + quoteTemplate(n) + " is taken by another team"}
}

// keep is xs without the ones ok refuses (nil for none).
func keep[T any](xs []T, ok func(T) bool) []T {
	var out []T
	for _, x := range xs {
		if ok(x) {
			out = append(out, x)
		}
	}
	return out
}

// publisher makes templates public (*sandbox.Manager).
type publisher interface {
	SetTemplatePublic(ctx context.Context, id string, public bool) (*sandbox.Template, error)
}

// clusterPublisher makes the cluster's templates public (*cluster.Templates).
type clusterPublisher interface {
	SetPublic(ctx context.Context, id string, public bool) (bool, error)
}

// updateTemplate is E2B's PATCH /templates/{id} {"public": bool}: the owner's team makes its
// template readable and usable by every team, or its own again (the guard checked the owner).
func (s *server) updateTemplate(w http.ResponseWriter, r *http.Request, p params) error {
	var req struct {
		Public *bool `json:"public"`
	}
	if err := s.decodeJSON(w, r, &req, true); err != nil {
		return err
	}
	pub, ok := s.node.(publisher)
	if !ok {
		return &httpError{status: http.StatusNotImplemented, msg: "public templates are not supported by this server"}
	}
	if req.Public == nil {
		return badRequest("public is required")
	}
	t, err := s.findTemplate(r.Context(), p["id"])
	if err != nil {
		return err
	}
	// In a cluster the flag travels with the cluster's record of the template (every node's
	// list and lookups read it); the node's own copy, if it has one, follows.
	shared := false
	if cp, ok := s.cfg.Templates.(clusterPublisher); ok {
		if shared, err = cp.SetPublic(r.Context(), t.ID, *req.Public); err != nil {
			return err
		}
	}
	if _, err := pub.SetTemplatePublic(r.Context(), t.ID, *req.Public); err != nil && !(shared && errors.Is(err, errdefs.ErrNotFound)) {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}
