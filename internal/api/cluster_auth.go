package api

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Requests between nodes carry a proof that a node sent them: HeaderNodeProof =
// "v1.<unix seconds>.<hex HMAC-SHA256>" over the method, the request target, that time, the
// sending node and the routing headers (sandbox, port, reservation), keyed with the cluster
// secret. A node serves a request marked forwarded only with a fresh, valid proof: without
// it, a client could pin a create to a node past placement (a forged reservation header), or
// have a node serve as the owner of a sandbox it was never routed. The body is not covered:
// the proof is against clients, not against someone on the nodes' network (which a replay in
// the freshness window would also need).
const (
	HeaderNodeProof = "X-Ember-Node-Proof"
	// proofWindow is how far a proof's time may be from the receiver's clock.
	proofWindow = 30 * time.Second
)

// nodeProof computes the MAC of a forwarded request.
func nodeProof(secret []byte, method, target string, at int64, h http.Header) string {
	m := hmac.New(sha256.New, secret)
	for _, part := range []string{"ember-node-proof-v1", method, target, strconv.FormatInt(at, 10), h.Get(HeaderForwarded),
		h.Get(headerFwdSandbox), h.Get(headerFwdPort), h.Get(HeaderReservation)} {
		m.Write([]byte(part))
		m.Write([]byte{0})
	}
	return hex.EncodeToString(m.Sum(nil))
}

// signForward marks out as sent by this node, after its routing headers are set.
func (s *server) signForward(out *http.Request) {
	at := time.Now().Unix()
	out.Header.Set(HeaderNodeProof, "v1."+strconv.FormatInt(at, 10)+"."+nodeProof(s.cl.Secret(), out.Method, out.URL.RequestURI(), at, out.Header))
}

// verifyForward checks the proof of a request marked forwarded: 401 without one or with a
// stale one, 403 with a forged one.
func (s *server) verifyForward(r *http.Request) error {
	v := r.Header.Get(HeaderNodeProof)
	if v == "" {
		return &httpError{status: http.StatusUnauthorized, msg: HeaderForwarded + " is for requests between the nodes of the cluster, and this one carries no node proof"}
	}
	parts := strings.SplitN(v, ".", 3)
	if len(parts) != 3 || parts[0] != "v1" {
		return &httpError{status: http.StatusUnauthorized, msg: "malformed node proof"}
	}
	at, err := strconv.ParseInt(parts[1], 10, 64)
	if err != nil {
		return &httpError{status: http.StatusUnauthorized, msg: "malformed node proof"}
	}
	if d := time.Since(time.Unix(at, 0)); d > proofWindow || d < -proofWindow {
		return &httpError{status: http.StatusUnauthorized, msg: "stale node proof (" + d.Round(time.Second).String() + " old; are the nodes' clocks in sync?)"}
	}
	target := r.RequestURI
	if target == "" {
		target = r.URL.RequestURI()
	}
	want := nodeProof(s.cl.Secret(), r.Method, target, at, r.Header)
	if !hmac.Equal([]byte(want), []byte(parts[2])) {
		return &httpError{status: http.StatusForbidden, msg: "invalid node proof"}
	}
	return nil
}

// Forwarded requests do not carry the client's API key: the edge checked it, and the node
// proof says so. A node's URL comes from etcd, so a URL someone wrote there must receive no
// client's key (it would be a key harvester); and the receiving node serves a request with a
// valid proof as authenticated (nodeAuthenticated, set by serveForwarded only).

// nodeAuthenticated marks, in a request's context, a forwarded request whose proof checked.
type nodeAuthenticated struct{}

// dropClientKey removes the client's API key (X-API-Key, or Authorization: Bearer) from the
// headers of a control request sent to another node.
func dropClientKey(h http.Header) {
	h.Del(HeaderAPIKey)
	if v := h.Get("Authorization"); len(v) > 7 && strings.EqualFold(v[:7], "bearer ") {
		h.Del("Authorization")
	}
}
