package api

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// Cluster is what the edge consults in cluster mode (Config.Cluster; nil = one node, and
// nothing here runs). Every node is an edge: a request for a sandbox on another node is
// proxied there (routing from the cluster's watch-fed cache; on a miss or a "not here"
// answer, one etcd read and one retry), a create is placed by the cluster, and lists gather
// every live node's.
type Cluster interface {
	NodeID() string
	Locate(ctx context.Context, id string, fresh bool) (cluster.Location, error)
	Place(ctx context.Context, req cluster.PlaceRequest) (*cluster.Reservation, error)
	Cancel(ctx context.Context, r *cluster.Reservation)
	HasReservation(ctx context.Context, id string) bool
	Live() []cluster.NodeInfo
	Nodes() []cluster.NodeView
	Node(id string) (cluster.NodeView, error)
	Drain(ctx context.Context, id string, on bool) error
	LostSandboxes(ctx context.Context) ([]cluster.LostSandbox, error)
	// Secret signs the requests between nodes (cluster_auth.go).
	Secret() []byte
	// Available is nil while the cluster store can commit; else why not (ErrUnavailable).
	Available() error
}

// Headers between the nodes of a cluster.
const (
	// HeaderForwarded marks a request another edge sent here: it is served here, never sent on.
	HeaderForwarded = "X-Ember-Forwarded"
	// HeaderNotHere on an answer says this node does not hold the sandbox asked for.
	HeaderNotHere = "X-Ember-Not-Here"
	// HeaderReservation carries the placement reservation of a forwarded create.
	HeaderReservation = "X-Ember-Reservation"
	// headerFwdSandbox/headerFwdPort carry a sandbox-plane request's target, whatever host the
	// client used (the owner's domain may differ).
	headerFwdSandbox = "X-Ember-Sandbox-Id"
	headerFwdPort    = "X-Ember-Sandbox-Port"
)

// reservationKey carries, in a create's context, the placement reservation it consumes
// (sandbox.CreateRequest.Reservation).
type reservationKey struct{}

func reservationOf(ctx context.Context) string {
	rid, _ := ctx.Value(reservationKey{}).(string)
	return rid
}

var errNotHere = errors.New("not here")

// maxPlacements bounds the nodes one create tries when they refuse it.
const maxPlacements = 3

func newNodeTransport() *http.Transport {
	return &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConnsPerHost: 64,
		IdleConnTimeout:     90 * time.Second,
	}
}

// serveCluster routes a request in cluster mode; false leaves it to the single-node path.
func (s *server) serveCluster(w http.ResponseWriter, r *http.Request) bool {
	if r.Header.Get(HeaderForwarded) != "" {
		return s.serveForwarded(w, r)
	}
	if vals, ok := r.Header[HeaderSandboxID]; ok {
		id := ""
		if len(vals) > 0 {
			id = vals[0]
		}
		return s.routeSandbox(w, r, id, r.Header.Get(HeaderSandboxPort), true)
	}
	if port, id, ok, err := s.matchHost(r.Host); ok {
		if err != nil {
			return false
		}
		return s.routeSandbox(w, r, id, strconv.Itoa(port), true)
	}
	if r.URL.Path == "/files" {
		return false
	}
	if s.refuseWithoutQuorum(w, r) {
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
		if !validSandboxID(id) {
			return false
		}
		return s.routeSandbox(w, r, id, "", false)
	}
	return false
}

// serveForwarded serves a request another edge sent: here, saying "not here" for a sandbox
// this node does not hold.
func (s *server) serveForwarded(w http.ResponseWriter, r *http.Request) bool {
	if err := s.verifyForward(r); err != nil { // cluster_auth.go
		writeError(w, s.log, r, err)
		return true
	}
	r.Header.Del(HeaderNodeProof)
	if r.URL.Path == signedOwnerPath && r.Method == http.MethodPost { // cluster_signed.go
		if err := s.signedOwnerHere(w, r); err != nil {
			writeError(w, s.log, r, err)
		}
		return true
	}
	id := r.Header.Get(headerFwdSandbox)
	if id == "" {
		segs := splitPath(r.URL.Path)
		if len(segs) > 0 && segs[0] == "v2" {
			segs = segs[1:]
		}
		if len(segs) >= 2 && segs[0] == "sandboxes" {
			id, _, _ = strings.Cut(segs[1], "-")
		}
	}
	if id != "" {
		if _, err := s.svc.Get(r.Context(), id); errors.Is(err, errdefs.ErrNotFound) {
			w.Header().Set(HeaderNotHere, s.cl.NodeID())
		}
	}
	if id := r.Header.Get(headerFwdSandbox); id != "" {
		port, err := parsePort(r.Header.Get(headerFwdPort))
		r.Header.Del(headerFwdSandbox)
		r.Header.Del(headerFwdPort)
		r.Header.Del(HeaderForwarded)
		if err != nil {
			writeError(w, s.log, r, err)
			return true
		}
		s.serveSandbox(w, r, id, port)
		return true
	}
	if rid := r.Header.Get(HeaderReservation); rid != "" && s.cl.HasReservation(r.Context(), rid) {
		r = r.WithContext(context.WithValue(r.Context(), reservationKey{}, rid))
	}
	s.serveControl(w, r)
	return true
}

// routeSandbox serves a request for sandbox id here, or proxies it to the node that holds it.
// sandboxPlane: port is the guest port ("" = envd's).
func (s *server) routeSandbox(w http.ResponseWriter, r *http.Request, id, port string, sandboxPlane bool) bool {
	if !validSandboxID(id) {
		return false
	}
	ctx := r.Context()
	loc, err := s.cl.Locate(ctx, id, false)
	if err == nil && (!loc.Known() || loc.Dead) {
		loc, err = s.cl.Locate(ctx, id, true)
	}
	if err == nil && !sandboxPlane {
		var done bool
		if loc, done, err = s.serveUnheld(w, r, id, loc); done { // cluster_stored.go
			return true
		}
	}
	if err == nil {
		loc, err = s.relocate(r, id, loc) // a stored paused sandbox of a gone node (cluster_move.go)
	}
	if err != nil {
		writeError(w, s.log, r, err)
		return true
	}
	if loc.Local || !loc.Known() {
		return false
	}
	if loc.Lost != nil || loc.Dead || loc.URL == "" {
		s.writeLost(w, r, id, loc, sandboxPlane)
		return true
	}
	body, replay := replayableBody(r)
	s.proxyTo(w, r, loc, id, port, sandboxPlane, body, replay, true)
	return true
}

// writeLost answers for a sandbox that died with its node: 404 on the control plane (E2B's
// wording, then the node and the time), the SDK's "not running" 502 on the sandbox plane.
func (s *server) writeLost(w http.ResponseWriter, r *http.Request, id string, loc cluster.Location, sandboxPlane bool) {
	gone := &sandbox.GoneError{ID: id, Reason: "lost with node " + loc.Node, At: time.Now()}
	if loc.Lost != nil {
		gone.Reason, gone.At = "lost with node "+loc.Lost.Node+": "+loc.Lost.Reason, loc.Lost.At
	}
	if sandboxPlane {
		writeNotRunningTo(w, r, id, gone)
		return
	}
	writeJSONError(w, http.StatusNotFound, sandboxNotFoundMsg(id)+": it was "+gone.Reason+" at "+gone.At.UTC().Format(time.RFC3339))
}

// replayableBody reads a small body so that a request can be sent twice; larger ones (file
// uploads) stream once.
func replayableBody(r *http.Request) ([]byte, bool) {
	if r.Body == nil || r.Body == http.NoBody || r.ContentLength == 0 {
		return nil, true
	}
	if r.ContentLength < 0 || r.ContentLength > DefaultMaxBodyBytes {
		return nil, false
	}
	b, err := io.ReadAll(io.LimitReader(r.Body, DefaultMaxBodyBytes+1))
	if err != nil || int64(len(b)) > DefaultMaxBodyBytes {
		return nil, false
	}
	return b, true
}

// proxyTo sends r to the node at loc. An answer "not here" (the route was stale) leads to one
// etcd read and, with retry, one more try wherever the sandbox is now.
func (s *server) proxyTo(w http.ResponseWriter, r *http.Request, loc cluster.Location, id, port string, sandboxPlane bool, body []byte, replay, retry bool) {
	target, err := url.Parse(loc.URL)
	if err != nil {
		s.writeLost(w, r, id, loc, sandboxPlane)
		return
	}
	if replay {
		r.Body = io.NopCloser(bytes.NewReader(body))
		r.ContentLength = int64(len(body))
	}
	var again bool
	p := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(target)
			pr.Out.Host = pr.In.Host
			pr.Out.Header.Set(HeaderForwarded, s.cl.NodeID())
			if sandboxPlane {
				pr.Out.Header.Set(headerFwdSandbox, id)
				pr.Out.Header.Set(headerFwdPort, port)
			}
			// The client's X-Forwarded-For etc. pass through unchanged.
			pr.Out.Header["X-Forwarded-For"] = pr.In.Header["X-Forwarded-For"]
			s.signForward(pr.Out)
		},
		Transport:     s.nodeTransport,
		FlushInterval: -1,
		ModifyResponse: func(resp *http.Response) error {
			if resp.Header.Get(HeaderNotHere) != "" && retry && replay {
				return errNotHere
			}
			resp.Header.Del(HeaderNotHere)
			return nil
		},
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if errors.Is(err, context.Canceled) || r.Context().Err() != nil {
				return
			}
			if !errors.Is(err, errNotHere) {
				s.log.Warn("cluster: node unreachable", "node", loc.Node, "sandbox_id", id, "err", err)
			}
			again = true
		},
	}
	if sandboxPlane {
		if err := http.NewResponseController(w).EnableFullDuplex(); err != nil && !errors.Is(err, http.ErrNotSupported) {
			s.log.Debug("full duplex", "err", err)
		}
	}
	p.ServeHTTP(w, r)
	if !again {
		return
	}
	// The route was stale or the node did not answer: where is it now?
	fresh, err := s.cl.Locate(r.Context(), id, true)
	switch {
	case err != nil:
		writeError(w, s.log, r, err)
	case fresh.Lost != nil || fresh.Dead || (fresh.Known() && !fresh.Local && fresh.URL == ""):
		s.writeLost(w, r, id, fresh, sandboxPlane)
	case fresh.Local || !fresh.Known():
		if replay {
			r.Body = io.NopCloser(bytes.NewReader(body))
		}
		s.serveLocal(w, r, id, port, sandboxPlane)
	case retry && replay && fresh.Node != loc.Node:
		s.proxyTo(w, r, fresh, id, port, sandboxPlane, body, replay, false)
	default:
		if sandboxPlane {
			writeNotRunning(w, id)
		} else {
			writeJSONError(w, http.StatusBadGateway, "node "+loc.Node+" holding sandbox "+quoteID(id)+" did not answer")
		}
	}
}

func (s *server) serveLocal(w http.ResponseWriter, r *http.Request, id, port string, sandboxPlane bool) {
	if sandboxPlane {
		p, err := parsePort(port)
		if err != nil {
			writeError(w, s.log, r, err)
			return
		}
		s.serveSandbox(w, r, id, p)
		return
	}
	s.routes.serve(w, r, s.log)
}

// placeCreate places a create: the cluster reserves room on a node (atomically in etcd), the
// create runs there (here, or forwarded with the reservation), and a node that refuses it
// (full, or failing) is excluded and the next one tried.
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
		// Not placeable: the local handler gives the 400.
		r.Body = io.NopCloser(bytes.NewReader(body))
		s.routes.serve(w, r, s.log)
		return
	}
	var exclude []string
	for attempt := 0; ; attempt++ {
		resv, err := s.cl.Place(r.Context(), cluster.PlaceRequest{TemplateID: req.TemplateID, Exclude: exclude})
		if err != nil {
			if errors.Is(err, errdefs.ErrNotFound) && attempt == 0 {
				// No live node has it: the local handler answers as E2B does.
				r.Body = io.NopCloser(bytes.NewReader(body))
				s.routes.serve(w, r, s.log)
				return
			}
			writeError(w, s.log, r, err)
			return
		}
		rec := httptest.NewRecorder()
		if resv.Local {
			lr := r.Clone(context.WithValue(r.Context(), reservationKey{}, resv.ID))
			lr.Body = io.NopCloser(bytes.NewReader(body))
			s.routes.serve(rec, lr, s.log)
		} else {
			s.createOn(r, rec, resv, body)
		}
		refused := rec.Code == http.StatusTooManyRequests || rec.Code == http.StatusServiceUnavailable || rec.Code == http.StatusBadGateway
		if rec.Code >= 300 {
			s.cl.Cancel(context.WithoutCancel(r.Context()), resv)
		}
		if refused && attempt+1 < maxPlacements {
			s.log.Info("cluster: node refused a create: trying another", "node", resv.Node, "status", rec.Code)
			exclude = append(exclude, resv.Node)
			continue
		}
		for k, v := range rec.Header() {
			w.Header()[k] = v
		}
		w.WriteHeader(rec.Code)
		_, _ = w.Write(rec.Body.Bytes())
		return
	}
}

// createOn forwards a create to the node holding its reservation.
func (s *server) createOn(r *http.Request, rec *httptest.ResponseRecorder, resv *cluster.Reservation, body []byte) {
	out, err := http.NewRequestWithContext(r.Context(), r.Method, strings.TrimSuffix(resv.URL, "/")+r.URL.RequestURI(), bytes.NewReader(body))
	if err != nil {
		writeError(rec, s.log, r, err)
		return
	}
	out.Header = r.Header.Clone()
	out.Header.Set(HeaderForwarded, s.cl.NodeID())
	out.Header.Set(HeaderReservation, resv.ID)
	s.signForward(out)
	resp, err := s.nodeTransport.RoundTrip(out)
	if err != nil {
		s.log.Warn("cluster: node unreachable for a create", "node", resv.Node, "err", err)
		writeJSONError(rec, http.StatusBadGateway, "node "+resv.Node+" did not answer")
		return
	}
	defer resp.Body.Close()
	for k, v := range resp.Header {
		rec.Header()[k] = v
	}
	rec.WriteHeader(resp.StatusCode)
	_, _ = io.Copy(rec, io.LimitReader(resp.Body, 16<<20))
}

// listEverywhere gathers a list from every live node (each filters and pages the same way)
// and merges the pages.
func (s *server) listEverywhere(w http.ResponseWriter, r *http.Request) {
	lost, r, ask, err := s.lostForList(r) // ember's state=lost (cluster_lost.go)
	if err != nil {
		writeError(w, s.log, r, err)
		return
	}
	if ask {
		stored, err := s.unheldForList(r) // no node lists them (cluster_stored.go)
		if err != nil {
			writeError(w, s.log, r, err)
			return
		}
		lost = append(lost, stored...)
	}
	v2 := strings.HasPrefix(r.URL.Path, "/v2/")
	q := r.URL.Query()
	limit, desc := 0, true
	if v2 {
		var err error
		if limit, err = limitParam(q.Get("limit")); err != nil {
			writeError(w, s.log, r, err)
			return
		}
		desc = !strings.EqualFold(q.Get("order"), "asc")
	}
	type answer struct {
		items []listedSandboxJSON
		next  string
		code  int
		err   []byte
	}
	nodes := s.cl.Live()
	if !ask {
		nodes = nil
	}
	answers := make([]answer, len(nodes))
	var wg sync.WaitGroup
	for i, n := range nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rec := httptest.NewRecorder()
			if n.ID == s.cl.NodeID() {
				s.routes.serve(rec, r.Clone(r.Context()), s.log)
			} else {
				out, err := http.NewRequestWithContext(r.Context(), r.Method, strings.TrimSuffix(n.URL, "/")+r.URL.RequestURI(), nil)
				if err != nil {
					return
				}
				out.Header = r.Header.Clone()
				out.Header.Set(HeaderForwarded, s.cl.NodeID())
				s.signForward(out)
				resp, err := s.nodeTransport.RoundTrip(out)
				if err != nil {
					s.log.Warn("cluster: list: node unreachable", "node", n.ID, "err", err)
					return // a node that does not answer lists nothing
				}
				defer resp.Body.Close()
				rec.Code = resp.StatusCode
				rec.Header().Set(HeaderNextToken, resp.Header.Get(HeaderNextToken))
				_, _ = io.Copy(rec.Body, io.LimitReader(resp.Body, 64<<20))
			}
			a := answer{code: rec.Code, next: rec.Header().Get(HeaderNextToken)}
			if rec.Code != http.StatusOK {
				a.err = rec.Body.Bytes()
			} else if json.Unmarshal(rec.Body.Bytes(), &a.items) != nil {
				a.code, a.err = http.StatusBadGateway, []byte(`{"code":502,"message":"bad list from node `+n.ID+`"}`)
			}
			answers[i] = a
		}()
	}
	wg.Wait()
	var items []pageItem[listedSandboxJSON]
	for _, it := range lost {
		items = append(items, pageItem[listedSandboxJSON]{at: it.StartedAt, id: it.SandboxID, v: it})
	}
	more := false
	for _, a := range answers {
		if a.code != 0 && a.code != http.StatusOK {
			// A bad query is bad everywhere: the first node's answer says why.
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(a.code)
			_, _ = w.Write(a.err)
			return
		}
		more = more || a.next != ""
		for _, it := range a.items {
			items = append(items, pageItem[listedSandboxJSON]{at: it.StartedAt, id: it.SandboxID, v: it})
		}
	}
	if limit <= 0 {
		limit = len(items) + 1
	}
	page, next := paginate(items, desc, nil, limit)
	if next == "" && more && len(page) > 0 {
		last := page[len(page)-1]
		next = encodeCursor(cursor{at: last.StartedAt, id: last.SandboxID})
	}
	if next != "" && v2 {
		w.Header().Set(HeaderNextToken, next)
	}
	if page == nil {
		page = []listedSandboxJSON{}
	}
	writeJSON(w, http.StatusOK, page)
}

// Node routes: GET /nodes, GET /nodes/{id}, POST /nodes/{id}/drain, DELETE /nodes/{id}/drain.

func (s *server) nodeRoutes(rt *router) {
	rt.handle(http.MethodGet, "/nodes", s.listNodes)
	rt.handle(http.MethodGet, "/nodes/{id}", s.getNode)
	rt.handle(http.MethodPost, "/nodes/{id}/drain", s.drainNode(true))
	rt.handle(http.MethodDelete, "/nodes/{id}/drain", s.drainNode(false))
}

var errNoCluster = &httpError{status: http.StatusNotFound, msg: "this node is not part of a cluster (ember serve --etcd-endpoints)"}

func (s *server) listNodes(w http.ResponseWriter, _ *http.Request, _ params) error {
	if s.cl == nil {
		return errNoCluster
	}
	writeJSON(w, http.StatusOK, s.cl.Nodes())
	return nil
}

func (s *server) getNode(w http.ResponseWriter, _ *http.Request, p params) error {
	if s.cl == nil {
		return errNoCluster
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
			return errNoCluster
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
