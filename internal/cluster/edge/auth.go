package edge

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/errdefs"
)

// Headers between the nodes of a cluster.
const (
	// HeaderForwarded marks a request another edge sent here: it is served here, never sent on.
	HeaderForwarded = "X-Ember-Forwarded"
	// HeaderNotHere on an answer says this node does not hold the sandbox asked for.
	HeaderNotHere = "X-Ember-Not-Here"
	// HeaderReservation carries the placement reservation of a forwarded create.
	HeaderReservation = "X-Ember-Reservation"
	// HeaderFwdSandbox/HeaderFwdPort carry a sandbox-plane request's target, whatever host
	// the client used (the owner's domain may differ).
	HeaderFwdSandbox = "X-Ember-Sandbox-Id"
	HeaderFwdPort    = "X-Ember-Sandbox-Port"
	// HeaderTeam carries, between nodes, the team (and ";admin" for an admin key) of the
	// client's key the sending edge checked; the node proof covers it.
	HeaderTeam = "X-Ember-Team"
	// HeaderNodeProof proves a request between nodes came from a node (below).
	HeaderNodeProof = "X-Ember-Node-Proof"
	// headerAPIKey is the client's API key header (api.HeaderAPIKey).
	headerAPIKey = "X-Api-Key"
)

// Requests between nodes carry a proof that a node sent them: HeaderNodeProof =
// "v1.<unix seconds>.<hex HMAC-SHA256>" over the method, the request target, that time, the
// sending node and the routing headers (sandbox, port, reservation), keyed with the cluster
// secret. A node serves a request marked forwarded only with a fresh, valid proof: without
// it, a client could pin a create to a node past placement (a forged reservation header), or
// have a node serve as the owner of a sandbox it was never routed. The body is not covered:
// the proof is against clients, not against someone on the nodes' network (which a replay in
// the freshness window would also need).

// proofWindow is how far a proof's time may be from the receiver's clock.
const proofWindow = 30 * time.Second

// NodeProof computes the MAC of a forwarded request (Sign and Verify; tests forge stale ones).
func NodeProof(secret []byte, method, target string, at int64, h http.Header) string {
	m := hmac.New(sha256.New, secret)
	for _, part := range []string{"ember-node-proof-v1", method, target, strconv.FormatInt(at, 10), h.Get(HeaderForwarded),
		h.Get(HeaderFwdSandbox), h.Get(HeaderFwdPort), h.Get(HeaderReservation), h.Get(HeaderTeam)} {
		m.Write([]byte(part))
		m.Write([]byte{0})
	}
	return hex.EncodeToString(m.Sum(nil))
}

// Sign marks out as sent by this node, after its routing headers are set.
func Sign(secret []byte, out *http.Request) {
	at := time.Now().Unix()
	out.Header.Set(HeaderNodeProof, "v1."+strconv.FormatInt(at, 10)+"."+NodeProof(secret, out.Method, out.URL.RequestURI(), at, out.Header))
}

func (e *Edge) sign(out *http.Request) {
	out.Header.Set(HeaderForwarded, e.cl.NodeID())
	out.Header.Del(HeaderTeam) // a client's own is never passed on
	if c, ok := auth.CallerOf(out.Context()); ok {
		out.Header.Set(HeaderTeam, EncodeCaller(c))
	}
	Sign(e.cl.Secret(), out)
}

// Verify checks the proof of a request marked forwarded: 401 without one or with a stale
// one, 403 with a forged one.
func Verify(secret []byte, r *http.Request) error {
	v := r.Header.Get(HeaderNodeProof)
	if v == "" {
		return &errdefs.StatusError{Status: http.StatusUnauthorized, Message: HeaderForwarded + " is for requests between the nodes of the cluster, and this one carries no node proof"}
	}
	parts := strings.SplitN(v, ".", 3)
	if len(parts) != 3 || parts[0] != "v1" {
		return &errdefs.StatusError{Status: http.StatusUnauthorized, Message: "malformed node proof"}
	}
	at, err := strconv.ParseInt(parts[1], 10, 64)
	if err != nil {
		return &errdefs.StatusError{Status: http.StatusUnauthorized, Message: "malformed node proof"}
	}
	if d := time.Since(time.Unix(at, 0)); d > proofWindow || d < -proofWindow {
		return &errdefs.StatusError{Status: http.StatusUnauthorized, Message: "stale node proof (" + d.Round(time.Second).String() + " old; are the nodes' clocks in sync?)"}
	}
	target := r.RequestURI
	if target == "" {
		target = r.URL.RequestURI()
	}
	want := NodeProof(secret, r.Method, target, at, r.Header)
	if !hmac.Equal([]byte(want), []byte(parts[2])) {
		return &errdefs.StatusError{Status: http.StatusForbidden, Message: "invalid node proof"}
	}
	return nil
}

// EncodeCaller is HeaderTeam's value for c.
func EncodeCaller(c auth.Caller) string {
	if c.Admin {
		return c.Team + ";admin"
	}
	return c.Team
}

// CallerFrom reads HeaderTeam of a forwarded request whose proof checked (ok false: none).
func CallerFrom(h http.Header) (auth.Caller, bool) {
	v := h.Get(HeaderTeam)
	if v == "" {
		return auth.Caller{}, false
	}
	team, admin := strings.CutSuffix(v, ";admin")
	return auth.Caller{Team: team, Admin: admin}, true
}

// Forwarded requests do not carry the client's API key: the edge checked it, and the node
// proof says so. A node's URL comes from etcd, so a URL someone wrote there must receive no
// client's key (it would be a key harvester); and the receiving node serves a request with a
// valid proof as authenticated (Local.ServeForwarded).

// dropClientKey removes the client's API key (X-API-Key, or Authorization: Bearer) from the
// headers of a control request sent to another node.
func dropClientKey(h http.Header) {
	h.Del(headerAPIKey)
	if v := h.Get("Authorization"); len(v) > 7 && strings.EqualFold(v[:7], "bearer ") {
		h.Del("Authorization")
	}
}

// NodesOnly refuses a request that did not come from another node of the cluster (those carry
// HeaderForwarded, whose node proof Serve checked before any route).
func NodesOnly(r *http.Request) error {
	if r.Header.Get(HeaderForwarded) == "" {
		return &errdefs.StatusError{Status: http.StatusForbidden, Message: r.URL.Path + " is for requests between the nodes of the cluster"}
	}
	return nil
}
