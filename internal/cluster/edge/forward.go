package edge

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"time"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

var errNotHere = errors.New("not here")

// reservationKey carries, in a create's context, the placement reservation it consumes.
type reservationKey struct{}

// ReservationOf is the placement reservation a create consumes ("" = none).
func ReservationOf(ctx context.Context) string {
	rid, _ := ctx.Value(reservationKey{}).(string)
	return rid
}

func withReservation(ctx context.Context, rid string) context.Context {
	return context.WithValue(ctx, reservationKey{}, rid)
}

// Serve serves, or sends to the node that holds it, a request api aimed at target t; false
// leaves it to this node's usual path. Control requests come here authenticated.
func (e *Edge) Serve(w http.ResponseWriter, r *http.Request, t Target) bool {
	switch t.Kind {
	case SandboxPlane:
		return e.route(w, r, t.ID, t.Port, true)
	case SandboxControl:
		return e.route(w, r, t.ID, "", false)
	case Create:
		e.placeCreate(w, r, t)
		return true
	}
	return false
}

// RefuseWithoutQuorum answers 503 for a control call while the cluster store cannot commit
// (etcd has no quorum, or this node cannot reach it): such a call would hang on etcd or act
// on a state the cluster cannot record. The sandbox plane (served before this) goes on from
// the routing caches; /health, /metrics and GET /nodes answer from this node's view.
func (e *Edge) RefuseWithoutQuorum(w http.ResponseWriter, r *http.Request) bool {
	switch p := r.URL.Path; {
	case p == "/health", p == "/metrics":
		return false
	case r.Method == http.MethodGet && (p == "/nodes" || strings.HasPrefix(p, "/nodes/")):
		return false
	}
	err := e.cl.Available()
	if err == nil {
		return false
	}
	e.local.WriteError(w, r, err)
	return true
}

// ServeForwarded serves a request another edge sent (HeaderForwarded): here, saying "not
// here" for a sandbox this node does not hold.
func (e *Edge) ServeForwarded(w http.ResponseWriter, r *http.Request) {
	if err := Verify(e.cl.Secret(), r); err != nil {
		e.local.WriteError(w, r, err)
		return
	}
	r.Header.Del(HeaderNodeProof)
	if r.URL.Path == signedOwnerPath && r.Method == http.MethodPost { // signed.go
		if err := e.signedOwnerHere(w, r); err != nil {
			e.local.WriteError(w, r, err)
		}
		return
	}
	id := r.Header.Get(HeaderFwdSandbox)
	if id == "" {
		segs := strings.Split(strings.TrimPrefix(r.URL.Path, "/"), "/")
		if len(segs) > 0 && segs[0] == "v2" {
			segs = segs[1:]
		}
		if len(segs) >= 2 && segs[0] == "sandboxes" {
			id, _, _ = strings.Cut(segs[1], "-")
		}
	}
	if id != "" {
		switch node, held := e.adopter(r.Context(), id); {
		case !held:
			w.Header().Set(HeaderNotHere, e.cl.NodeID())
		case node != "":
			// The copy of a stored paused sandbox that another node adopted: this node drops it
			// at its next reconcile, and never serves it meanwhile (a fork there once answered
			// "is paused"). The sending edge reads the route again and goes to the adopter.
			w.Header().Set(HeaderNotHere, e.cl.NodeID())
			e.local.WriteError(w, r, fmt.Errorf("sandbox %q is on node %s now: %w", id, node, errdefs.ErrNotFound))
			return
		}
	}
	if id := r.Header.Get(HeaderFwdSandbox); id != "" {
		port := r.Header.Get(HeaderFwdPort)
		r.Header.Del(HeaderFwdSandbox)
		r.Header.Del(HeaderFwdPort)
		r.Header.Del(HeaderForwarded)
		e.local.ServeSandbox(w, r, id, port)
		return
	}
	if rid := r.Header.Get(HeaderReservation); rid != "" && e.cl.HasReservation(r.Context(), rid) {
		r = r.WithContext(withReservation(r.Context(), rid))
	}
	e.local.ServeForwarded(w, r)
}

// adopter reports whether this node holds sandbox id and, if it holds a copy of a sandbox
// that another node has adopted since (a stored paused one, moves.go), that node. Locate
// reads the route again for a stored sandbox of this node while another may adopt it, and
// answers from the cache otherwise.
func (e *Edge) adopter(ctx context.Context, id string) (string, bool) {
	if !e.local.Holds(ctx, id) {
		return "", false
	}
	loc, err := e.cl.Locate(ctx, id, false)
	if err != nil || loc.Node == "" || loc.Node == e.cl.NodeID() {
		return "", true
	}
	return loc.Node, true
}

// route serves a request for sandbox id here, or proxies it to the node that holds it.
// sandboxPlane: port is the guest port ("" = envd's).
func (e *Edge) route(w http.ResponseWriter, r *http.Request, id, port string, sandboxPlane bool) bool {
	ctx := r.Context()
	loc, err := e.cl.Locate(ctx, id, false) // reads etcd on a miss
	if err == nil && !sandboxPlane && loc.Known() {
		if c, ok := auth.CallerOf(ctx); ok && auth.Owner(loc.Team) != c.Team {
			return false // another team's: this node answers it as a missing one
		}
	}
	if err == nil && !sandboxPlane {
		var done bool
		if loc, done, err = e.serveUnheld(w, r, id, loc); done { // stored.go
			return true
		}
	}
	if err == nil {
		loc, err = e.relocate(r, id, loc) // a stored paused sandbox of a gone node (move.go)
	}
	if err != nil {
		e.local.WriteError(w, r, err)
		return true
	}
	if loc.Local || !loc.Known() {
		return false
	}
	if loc.Lost != nil || loc.Dead || loc.URL == "" {
		e.writeLost(w, r, id, loc, sandboxPlane)
		return true
	}
	body, replay := e.replayableBody(r)
	e.proxyTo(w, r, loc, id, port, sandboxPlane, body, replay, true)
	return true
}

// writeLost answers for a sandbox that died with its node.
func (e *Edge) writeLost(w http.ResponseWriter, r *http.Request, id string, loc cluster.Location, sandboxPlane bool) {
	gone := &sandbox.GoneError{ID: id, Reason: "lost with node " + loc.Node, At: time.Now()}
	if loc.Lost != nil {
		gone.Reason, gone.At = "lost with node "+loc.Lost.Node+": "+loc.Lost.Reason, loc.Lost.At
	}
	e.local.WriteLost(w, r, id, gone, sandboxPlane)
}

// replayableBody reads a small body so that a request can be sent twice; larger ones (file
// uploads) stream once.
func (e *Edge) replayableBody(r *http.Request) ([]byte, bool) {
	if r.Body == nil || r.Body == http.NoBody || r.ContentLength == 0 {
		return nil, true
	}
	limit := e.local.MaxBodyBytes()
	if r.ContentLength < 0 || r.ContentLength > limit {
		return nil, false
	}
	b, err := io.ReadAll(io.LimitReader(r.Body, limit+1))
	if err != nil || int64(len(b)) > limit {
		return nil, false
	}
	return b, true
}

// proxyTo sends r to the node at loc. An answer "not here" (the route was stale) leads to one
// etcd read and, with retry, one more try wherever the sandbox is now.
func (e *Edge) proxyTo(w http.ResponseWriter, r *http.Request, loc cluster.Location, id, port string, sandboxPlane bool, body []byte, replay, retry bool) {
	target, err := url.Parse(loc.URL)
	if err != nil {
		e.writeLost(w, r, id, loc, sandboxPlane)
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
			if sandboxPlane {
				pr.Out.Header.Del(headerAPIKey) // the guest never gets it either
				pr.Out.Header.Set(HeaderFwdSandbox, id)
				pr.Out.Header.Set(HeaderFwdPort, port)
			} else {
				dropClientKey(pr.Out.Header)
			}
			// The client's X-Forwarded-For etc. pass through unchanged.
			pr.Out.Header["X-Forwarded-For"] = pr.In.Header["X-Forwarded-For"]
			e.sign(pr.Out)
		},
		Transport:     e.transport,
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
				e.log.Warn("cluster: node unreachable", "node", loc.Node, "sandbox_id", id, "err", err)
			}
			again = true
		},
	}
	if sandboxPlane {
		if err := http.NewResponseController(w).EnableFullDuplex(); err != nil && !errors.Is(err, http.ErrNotSupported) {
			e.log.Debug("full duplex", "err", err)
		}
	}
	p.ServeHTTP(w, r)
	if !again {
		return
	}
	// The route was stale or the node did not answer: where is it now?
	fresh, err := e.cl.Locate(r.Context(), id, true)
	switch {
	case err != nil:
		e.local.WriteError(w, r, err)
	case fresh.Lost != nil || fresh.Dead || (fresh.Known() && !fresh.Local && fresh.URL == ""):
		e.writeLost(w, r, id, fresh, sandboxPlane)
	case fresh.Local || !fresh.Known():
		if replay {
			r.Body = io.NopCloser(bytes.NewReader(body))
		}
		if sandboxPlane {
			e.local.ServeSandbox(w, r, id, port)
		} else {
			e.local.ServeControl(w, r)
		}
	case retry && replay && fresh.Node != loc.Node:
		e.proxyTo(w, r, fresh, id, port, sandboxPlane, body, replay, false)
	default:
		if sandboxPlane {
			e.local.WriteLost(w, r, id, nil, true)
		} else {
			errdefs.WriteBody(w, http.StatusBadGateway, "node "+loc.Node+" holding sandbox "+quoteID(id)+" did not answer")
		}
	}
}

// quoteID quotes a (valid) sandbox id as api's messages do.
func quoteID(id string) string { return `"` + url.PathEscape(id) + `"` }
