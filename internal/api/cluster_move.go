package api

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

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

// PausedMover moves stored paused sandboxes to this node (Config.Mover; *cluster.Moves).
type PausedMover interface {
	// Adopt makes stored sandbox id this node's (loaded from the image store, paused here).
	Adopt(ctx context.Context, id string) error
	// Unheld returns the stored paused sandboxes whose node is gone (of ids, or all).
	Unheld(ctx context.Context, ids ...string) ([]sandbox.Sandbox, error)
	// Forget ends stored sandbox id of a gone node without moving it (ErrConflict: it is not).
	Forget(ctx context.Context, id string) error
}

// nodesOnly refuses a request that did not come from another node of the cluster (those
// carry HeaderForwarded, whose node proof serveForwarded checked before any route).
func nodesOnly(r *http.Request) error {
	if r.Header.Get(HeaderForwarded) == "" {
		return &httpError{status: http.StatusForbidden, msg: r.URL.Path + " is for requests between the nodes of the cluster"}
	}
	return nil
}

// moveRoutes: POST /ember/sandboxes/{id}/adopt, which an edge sends to the node it placed a
// stored paused sandbox on.
func (s *server) moveRoutes(rt *router) {
	rt.handle(http.MethodPost, "/ember/sandboxes/{id}/adopt", s.adoptSandbox)
	rt.handle(http.MethodPost, "/ember/forks", s.forkHere)
}

func (s *server) adoptSandbox(w http.ResponseWriter, r *http.Request, p params) error {
	if err := nodesOnly(r); err != nil {
		return err
	}
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
	if s.cfg.Mover == nil || loc.Lost != nil {
		return loc, nil
	}
	draining := false
	if v, err := s.cl.Node(loc.Node); err == nil && v.State == cluster.StateDraining {
		draining = true
	}
	if !loc.Stored && draining && !loc.Local {
		// A draining node is storing its sandboxes: this edge's cache may not have seen the
		// stored route yet, and the node itself would resume it there.
		if fresh, err := s.cl.Locate(r.Context(), id, true); err == nil {
			loc = fresh
		}
	}
	if !loc.Stored {
		return loc, nil
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
	s.signForward(out)
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

// Forker forks across nodes (Config.Forker; *sandbox.Manager).
type Forker interface {
	ExportFork(ctx context.Context, id string) (*sandbox.PortableFork, error)
	// ForkFrom restores count children of pf here, child i consuming reservations[i].
	ForkFrom(ctx context.Context, pf *sandbox.PortableFork, count int, timeout time.Duration, reservations []string) ([]sandbox.ForkResult, error)
	DeleteStored(ctx context.Context, imageID string)
}

// forkRequest is POST /ember/forks: children of a stored fork image, on the node that holds
// their reservations.
type forkRequest struct {
	Fork         sandbox.PortableFork `json:"fork"`
	Timeout      time.Duration        `json:"timeout"`
	Reservations []string             `json:"reservations"`
}

// forkAcross forks sandbox id (held here) with its children placed by the cluster: those
// placed here are forked here, the others restored on their nodes from one fork image stored
// in the image store. It answers false to leave the fork to this node alone.
func (s *server) forkAcross(w http.ResponseWriter, r *http.Request, id string, count int, timeout time.Duration) bool {
	if s.cfg.Forker == nil || s.cl == nil {
		return false
	}
	ctx := r.Context()
	sb, err := s.svc.Get(ctx, id)
	if err != nil || sb.State != sandbox.StateRunning {
		return false // the local fork answers as it does
	}
	local := 0
	groups := map[string][]*cluster.Reservation{}
	var order, used []string
	for i := 0; i < count; i++ {
		// Spread: each child avoids the nodes its siblings went to while others have room.
		if len(used) > 0 && len(used)%max(1, len(s.cl.Nodes())) == 0 {
			used = used[:0]
		}
		resv, err := s.cl.Place(ctx, cluster.PlaceRequest{TemplateID: sb.TemplateID, Avoid: used})
		if err != nil {
			local += count - i // no room elsewhere: here, where the node admits or refuses them
			break
		}
		used = append(used, resv.Node)
		if resv.Local {
			s.cl.Cancel(context.WithoutCancel(ctx), resv) // a local child is counted once it runs
			local++
			continue
		}
		if groups[resv.Node] == nil {
			order = append(order, resv.Node)
		}
		groups[resv.Node] = append(groups[resv.Node], resv)
	}
	if len(groups) == 0 {
		return false
	}
	cancelAll := func() {
		for _, rs := range groups {
			for _, rv := range rs {
				s.cl.Cancel(context.WithoutCancel(ctx), rv)
			}
		}
	}
	pf, err := s.cfg.Forker.ExportFork(ctx, id)
	if err != nil {
		cancelAll()
		s.log.Warn("cluster: fork image not stored: forking here only", "sandbox_id", id, "err", err)
		return false
	}
	var mu sync.Mutex
	var out []forkResultJSON
	var wg sync.WaitGroup
	for _, node := range order {
		rs := groups[node]
		wg.Add(1)
		go func() {
			defer wg.Done()
			res := s.forkOn(r, rs, pf, timeout)
			mu.Lock()
			out = append(out, res...)
			mu.Unlock()
		}()
	}
	if local > 0 {
		results, err := s.svc.Fork(ctx, id, local, timeout)
		mu.Lock()
		if err != nil && len(results) == 0 {
			for i := 0; i < local; i++ {
				out = append(out, forkResultJSON{Error: &errorBody{Code: statusOf(err), Message: err.Error()}})
			}
		}
		for _, res := range results {
			if res.Sandbox != nil {
				sj := s.toSandbox(res.Sandbox)
				out = append(out, forkResultJSON{Sandbox: &sj})
			} else if res.Err != nil {
				out = append(out, forkResultJSON{Error: &errorBody{Code: statusOf(res.Err), Message: res.Err.Error()}})
			}
		}
		mu.Unlock()
	}
	wg.Wait()
	// Every child restored from the fork image (or failed): nothing reads it again.
	s.cfg.Forker.DeleteStored(context.WithoutCancel(ctx), pf.ImageID)
	ok := 0
	for _, o := range out {
		if o.Sandbox != nil {
			ok++
		}
	}
	if ok == 0 {
		writeJSONError(w, http.StatusInternalServerError, "fork: every child failed")
		return true
	}
	writeJSON(w, http.StatusCreated, out)
	return true
}

// forkOn restores len(rs) children on the node holding reservations rs.
func (s *server) forkOn(r *http.Request, rs []*cluster.Reservation, pf *sandbox.PortableFork, timeout time.Duration) []forkResultJSON {
	fail := func(msg string) []forkResultJSON {
		for _, rv := range rs {
			s.cl.Cancel(context.WithoutCancel(r.Context()), rv)
		}
		out := make([]forkResultJSON, len(rs))
		for i := range out {
			out[i] = forkResultJSON{Error: &errorBody{Code: http.StatusBadGateway, Message: msg}}
		}
		return out
	}
	req := forkRequest{Fork: *pf, Timeout: timeout}
	for _, rv := range rs {
		req.Reservations = append(req.Reservations, rv.ID)
	}
	body, _ := json.Marshal(req)
	out, err := http.NewRequestWithContext(r.Context(), http.MethodPost, strings.TrimSuffix(rs[0].URL, "/")+"/ember/forks", bytes.NewReader(body))
	if err != nil {
		return fail(err.Error())
	}
	for _, h := range []string{"X-API-Key", "Authorization"} {
		if v := r.Header.Get(h); v != "" {
			out.Header.Set(h, v)
		}
	}
	out.Header.Set("Content-Type", "application/json")
	out.Header.Set(HeaderForwarded, s.cl.NodeID())
	s.signForward(out)
	resp, err := s.nodeTransport.RoundTrip(out)
	if err != nil {
		return fail("node " + rs[0].Node + " did not answer")
	}
	defer resp.Body.Close()
	var res []forkResultJSON
	if resp.StatusCode != http.StatusCreated || json.NewDecoder(io.LimitReader(resp.Body, 4<<20)).Decode(&res) != nil {
		return fail(fmt.Sprintf("node %s: fork: status %d", rs[0].Node, resp.StatusCode))
	}
	return res
}

// forkHere restores children of a fork image stored by another node (POST /ember/forks),
// each consuming one of the reservations the edge made here.
func (s *server) forkHere(w http.ResponseWriter, r *http.Request, _ params) error {
	if err := nodesOnly(r); err != nil {
		return err
	}
	if s.cfg.Forker == nil || s.cl == nil {
		return errNoCluster
	}
	var req forkRequest
	if err := s.decodeJSON(w, r, &req, true); err != nil {
		return err
	}
	if len(req.Reservations) < 1 || len(req.Reservations) > MaxForkCount {
		return badRequest("between 1 and %d reservations", MaxForkCount)
	}
	// Each child is claimed with its reservation as it starts (cluster.Events).
	results, err := s.cfg.Forker.ForkFrom(r.Context(), &req.Fork, len(req.Reservations), req.Timeout, req.Reservations)
	if err != nil && len(results) == 0 {
		return err
	}
	out := make([]forkResultJSON, 0, len(results))
	for i, res := range results {
		if res.Sandbox != nil {
			sj := s.toSandbox(res.Sandbox)
			out = append(out, forkResultJSON{Sandbox: &sj})
			continue
		}
		s.cl.Cancel(context.WithoutCancel(r.Context()), &cluster.Reservation{ID: req.Reservations[i], Node: s.cl.NodeID()})
		out = append(out, forkResultJSON{Error: &errorBody{Code: statusOf(res.Err), Message: res.Err.Error()}})
	}
	writeJSON(w, http.StatusCreated, out)
	return nil
}

// sharedBuilder makes GET /templates/{id} answer with the cluster's templates too (in cluster
// mode with shared templates), as GET /templates lists them.
func (s *server) sharedBuilder(b sandbox.TemplateBuilder) sandbox.TemplateBuilder {
	if ss, ok := s.svc.(*sharedService); ok {
		return clusterBuilder{TemplateBuilder: b, t: ss.t}
	}
	return b
}

type clusterBuilder struct {
	sandbox.TemplateBuilder
	t TemplateSharer
}

func (b clusterBuilder) GetTemplate(ctx context.Context, id string) (*sandbox.Template, error) {
	shared := b.t.List()
	for _, st := range shared {
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
