package api

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/ember-sandbox/ember/internal/cluster/edge"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// In cluster mode (Config.Cluster) every node is an edge: api decides once what a request is
// for (serveCluster) and hands the request to the cluster edge (internal/cluster/edge), which
// serves it here through nodeLocal or sends it to the node that holds its sandbox.

// Cluster is what the edge consults in cluster mode (*cluster.Cluster; nil = one node).
type Cluster = edge.Cluster

// TemplateSharer shares templates between the nodes (*cluster.Templates).
type TemplateSharer = edge.TemplateSharer

// PausedMover moves stored paused sandboxes between the nodes (*cluster.Moves).
type PausedMover = edge.PausedMover

// Forker forks across nodes (*sandbox.Manager).
type Forker = edge.Forker

type signedQuery = edge.SignedQuery

func (s *server) newEdge() *edge.Edge {
	return edge.New(edge.Config{Cluster: s.cfg.Cluster, Local: nodeLocal{s}, Mover: s.cfg.Mover, Forker: s.cfg.Forker, Logger: s.log})
}

// serveCluster decides a request's target and hands it to the cluster edge; false leaves it
// to the single-node path.
func (s *server) serveCluster(w http.ResponseWriter, r *http.Request) bool {
	if r.Header.Get(edge.HeaderForwarded) != "" {
		s.edge.ServeForwarded(w, r)
		return true
	}
	if vals, ok := r.Header[HeaderSandboxID]; ok {
		id := ""
		if len(vals) > 0 {
			id = vals[0]
		}
		return validSandboxID(id) && s.edge.Serve(w, r, edge.Target{Kind: edge.SandboxPlane, ID: id, Port: r.Header.Get(HeaderSandboxPort)})
	}
	if port, id, ok, err := s.matchHost(r.Host); ok {
		return err == nil && validSandboxID(id) && s.edge.Serve(w, r, edge.Target{Kind: edge.SandboxPlane, ID: id, Port: strconv.Itoa(port)})
	}
	if r.URL.Path == "/files" {
		return false
	}
	if s.edge.RefuseWithoutQuorum(w, r) {
		return true
	}
	segs := splitPath(r.URL.Path)
	if len(segs) > 0 && segs[0] == "v2" {
		segs = segs[1:]
	}
	if len(segs) == 0 || segs[0] != "sandboxes" {
		return false
	}
	if err := s.authenticate(r); err != nil {
		writeError(w, s.log, r, err)
		return true
	}
	switch {
	case len(segs) == 1 && r.Method == http.MethodPost:
		s.placeCreate(w, r)
		return true
	case len(segs) == 1 && r.Method == http.MethodGet:
		s.listEverywhere(w, r)
		return true
	case len(segs) >= 2:
		id, _, _ := strings.Cut(segs[1], "-")
		return validSandboxID(id) && s.edge.Serve(w, r, edge.Target{Kind: edge.SandboxControl, ID: id})
	}
	return false
}

// placeCreate hands a placeable create to the edge, with this node's create for the
// placements that land here; one that is not placeable gets the local handler's 400.
func (s *server) placeCreate(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.cfg.MaxBodyBytes))
	if err != nil {
		writeError(w, s.log, r, &httpError{status: http.StatusRequestEntityTooLarge, msg: "request body too large"})
		return
	}
	var req struct {
		TemplateID string `json:"templateID"`
	}
	if json.Unmarshal(body, &req) != nil || req.TemplateID == "" || !validTemplateID(req.TemplateID) {
		r.Body = io.NopCloser(bytes.NewReader(body))
		s.routes.serve(w, r, s.log)
		return
	}
	// Its admission ticket: with the cluster full, the edge queues it (admission.go).
	actx, err := withAdmission(w, r)
	if err != nil {
		writeError(w, s.log, r, err)
		return
	}
	r = r.WithContext(actx)
	here := func(ctx context.Context, reservation string) ([]byte, error) {
		lr := r.Clone(ctx)
		lr.Body = io.NopCloser(bytes.NewReader(body))
		sj, err := s.createFrom(nil, lr, reservation)
		if err != nil {
			return nil, templateNotFoundE2B(err)
		}
		b, err := json.Marshal(sj)
		return append(b, '\n'), err
	}
	s.edge.Serve(w, r, edge.Target{Kind: edge.Create, TemplateID: req.TemplateID, Body: body, CreateHere: here})
}

// forkAcross forks sandbox id (held here) with children placed on other nodes too; false
// leaves the fork to this node alone.
func (s *server) forkAcross(w http.ResponseWriter, r *http.Request, id string, count int, timeout time.Duration) bool {
	if s.edge == nil {
		return false
	}
	sb, err := s.svc.Get(r.Context(), id)
	if err != nil || sb.State != sandbox.StateRunning {
		return false // the local fork answers as it does
	}
	out, ok := s.edge.ForkAcross(r.Context(), sb, count, timeout, func(n int) []edge.ForkResult {
		results, err := s.svc.Fork(r.Context(), id, n, timeout)
		var out []edge.ForkResult
		if err != nil && len(results) == 0 {
			for i := 0; i < n; i++ {
				out = append(out, edge.ForkResult{Error: &errorBody{Code: statusOf(err), Message: err.Error()}})
			}
		}
		for _, res := range results {
			if res.Sandbox != nil {
				out = append(out, edge.ForkResult{Sandbox: s.toSandbox(res.Sandbox)})
			} else if res.Err != nil {
				out = append(out, edge.ForkResult{Error: &errorBody{Code: statusOf(res.Err), Message: res.Err.Error()}})
			}
		}
		return out
	})
	if !ok {
		return false
	}
	for _, o := range out {
		if o.Sandbox != nil {
			writeJSON(w, http.StatusCreated, out)
			return true
		}
	}
	writeJSONError(w, http.StatusInternalServerError, "fork: every child failed")
	return true
}

// Routes between nodes: POST /ember/sandboxes/{id}/adopt, which an edge sends to the node it
// placed a stored paused sandbox on, and POST /ember/forks, children of a fork image.
func (s *server) moveRoutes(rt *router) {
	rt.handle(http.MethodPost, "/ember/sandboxes/{id}/adopt", s.adoptSandbox)
	rt.handle(http.MethodPost, "/ember/forks", s.forkHere)
}

func (s *server) adoptSandbox(w http.ResponseWriter, r *http.Request, p params) error {
	if err := edge.NodesOnly(r); err != nil {
		return err
	}
	if !validSandboxID(p["id"]) {
		return notFound("sandbox %s not found", quoteID(p["id"]))
	}
	if err := s.edge.AdoptHere(r, p["id"]); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (s *server) forkHere(w http.ResponseWriter, r *http.Request, _ params) error {
	out, err := s.edge.ForkHere(w, r, MaxForkCount)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, out)
	return nil
}

// nodeLocal is this node's API as the cluster edge serves with it (edge.Local).
type nodeLocal struct{ s *server }

func (l nodeLocal) WriteError(w http.ResponseWriter, r *http.Request, err error) {
	writeError(w, l.s.log, r, err)
}

func (l nodeLocal) ServeControl(w http.ResponseWriter, r *http.Request) {
	l.s.routes.serve(w, r, l.s.log)
}

// ServeForwarded serves a forwarded control request as authenticated: the edge that sent it
// checked the client's key, and its node proof checked.
func (l nodeLocal) ServeForwarded(w http.ResponseWriter, r *http.Request) {
	l.s.serveControl(w, r.WithContext(context.WithValue(r.Context(), nodeAuthenticated{}, true)))
}

func (l nodeLocal) ServeSandbox(w http.ResponseWriter, r *http.Request, id, port string) {
	p, err := parsePort(port)
	if err != nil {
		writeError(w, l.s.log, r, err)
		return
	}
	l.s.serveSandbox(w, r, id, p)
}

// WriteLost answers for a sandbox that died with its node: 404 on the control plane (E2B's
// wording, then the node and the time), the SDK's "not running" 502 on the sandbox plane.
func (l nodeLocal) WriteLost(w http.ResponseWriter, r *http.Request, id string, gone *sandbox.GoneError, sandboxPlane bool) {
	switch {
	case gone == nil:
		writeNotRunning(w, id)
	case sandboxPlane:
		writeNotRunningTo(w, r, id, gone)
	default:
		writeJSONError(w, http.StatusNotFound, sandboxNotFoundMsg(id)+": it was "+gone.Reason+" at "+gone.At.UTC().Format(time.RFC3339))
	}
}

func (l nodeLocal) WriteStored(w http.ResponseWriter, _ *http.Request, sb *sandbox.Sandbox) {
	writeJSON(w, http.StatusOK, l.s.toDetail(sb))
}

func (l nodeLocal) Holds(ctx context.Context, id string) bool {
	_, err := l.s.svc.Get(ctx, id)
	return statusOf(err) != http.StatusNotFound
}

func (l nodeLocal) SignedOwner(ctx context.Context, q edge.SignedQuery) (string, error) {
	sbx, err := l.s.signedSandbox(ctx, q)
	if err != nil || sbx == nil {
		return "", err
	}
	return sbx.ID, nil
}

func (l nodeLocal) SandboxJSON(sb *sandbox.Sandbox) any { return l.s.toSandbox(sb) }

func (l nodeLocal) MaxBodyBytes() int64 { return l.s.cfg.MaxBodyBytes }

// nodeAuthenticated marks, in a request's context, a forwarded request whose node proof
// checked (nodeLocal.ServeForwarded only).
type nodeAuthenticated struct{}

// Node routes: GET /nodes, GET /nodes/{id}, POST /nodes/{id}/drain, DELETE /nodes/{id}/drain.

func (s *server) nodeRoutes(rt *router) {
	rt.handle(http.MethodGet, "/nodes", s.listNodes)
	rt.handle(http.MethodGet, "/nodes/{id}", s.getNode)
	rt.handle(http.MethodPost, "/nodes/{id}/drain", s.drainNode(true))
	rt.handle(http.MethodDelete, "/nodes/{id}/drain", s.drainNode(false))
}

func (s *server) listNodes(w http.ResponseWriter, _ *http.Request, _ params) error {
	if s.cl == nil {
		return edge.ErrNoCluster
	}
	writeJSON(w, http.StatusOK, s.cl.Nodes())
	return nil
}

func (s *server) getNode(w http.ResponseWriter, _ *http.Request, p params) error {
	if s.cl == nil {
		return edge.ErrNoCluster
	}
	v, err := s.cl.Node(p["id"])
	if err != nil {
		return notFound("node %s not found", quoteID(p["id"]))
	}
	writeJSON(w, http.StatusOK, v)
	return nil
}

func (s *server) drainNode(on bool) handlerFunc {
	return func(w http.ResponseWriter, r *http.Request, p params) error {
		if s.cl == nil {
			return edge.ErrNoCluster
		}
		if _, err := s.cl.Node(p["id"]); err != nil {
			return notFound("node %s not found", quoteID(p["id"]))
		}
		if err := s.cl.Drain(r.Context(), p["id"], on); err != nil {
			return err
		}
		v, _ := s.cl.Node(p["id"])
		writeJSON(w, http.StatusOK, v)
		return nil
	}
}
