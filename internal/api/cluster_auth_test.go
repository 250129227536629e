package api

import (
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/cluster/edge"
)

// A client that sends the headers nodes use between themselves gets refused (401 without a
// proof or with a stale one, 403 with a forged one) and reaches nothing: no create pinned to
// the node past placement, no sandbox served from a node that does not hold it. A request a
// node signed with the cluster secret is served.
func TestClusterForwardedNeedsANodeProof(t *testing.T) {
	nodes := newTestCluster(t, 2)
	a, b := nodes[0], nodes[1]
	// A sandbox on b, the node the client will not address.
	var onB string
	for i := 0; i < 12 && onB == ""; i++ {
		r := a.env.ctl(http.MethodPost, "/sandboxes", `{"templateID":"base"}`)
		var sb struct {
			SandboxID string `json:"sandboxID"`
		}
		r.json(t, &sb)
		if b.holds(sb.SandboxID) {
			onB = sb.SandboxID
		}
	}
	if onB == "" {
		t.Fatal("nothing placed on b")
	}
	count := func() int {
		var l []listedSandboxJSON
		a.env.ctl(http.MethodGet, "/sandboxes", "").json(t, &l)
		return len(l)
	}
	before := count()
	now := strconv.FormatInt(time.Now().Unix(), 10)
	stale := time.Now().Add(-5 * time.Minute).Unix()
	staleProof := "v1." + strconv.FormatInt(stale, 10) + "." + edge.NodeProof(a.cl.Secret(), http.MethodPost, "/sandboxes", stale, http.Header{
		edge.HeaderForwarded: {"b"}, edge.HeaderReservation: {"r1"}})
	for _, tc := range []struct {
		name, proof string
		status      int
	}{
		{"no proof", "", http.StatusUnauthorized},
		{"malformed proof", "v1.x", http.StatusUnauthorized},
		{"forged proof", "v1." + now + "." + strings.Repeat("ab", 32), http.StatusForbidden},
		{"stale proof", staleProof, http.StatusUnauthorized},
	} {
		hdr := []string{edge.HeaderForwarded, "b", edge.HeaderReservation, "r1"}
		if tc.proof != "" {
			hdr = append(hdr, edge.HeaderNodeProof, tc.proof)
		}
		// A create pinned to a, past placement.
		r := a.env.ctl(http.MethodPost, "/sandboxes", `{"templateID":"base"}`, hdr...)
		if r.status != tc.status || !strings.Contains(string(r.body), `"code":`+strconv.Itoa(tc.status)) {
			t.Fatalf("%s: pinned create: %d %s, want %d", tc.name, r.status, r.body, tc.status)
		}
		// The sandbox plane of b's sandbox, served by a as if a held it.
		r = a.env.do(http.MethodPost, "/echo", "x", append(hdr, edge.HeaderForwarded, "b", edge.HeaderFwdSandbox, onB, edge.HeaderFwdPort, "")...)
		if r.status != tc.status {
			t.Fatalf("%s: sandbox plane as the owner: %d %s, want %d", tc.name, r.status, r.body, tc.status)
		}
	}
	if n := count(); n != before {
		t.Fatalf("refused creates made sandboxes: %d before, %d after", before, n)
	}
	// Through the ordinary headers the client reaches b's sandbox as it always could, and the
	// guest sees none of the nodes' headers.
	r := a.env.do(http.MethodPost, "/echo", "hi", "E2b-Sandbox-Id", onB)
	if r.status != http.StatusOK {
		t.Fatalf("sandbox plane through a: %d %s", r.status, r.body)
	}
	var echo guestEcho
	r.json(t, &echo)
	if echo.Body != "hi" || echo.Headers[edge.HeaderNodeProof] != "" || echo.Headers[edge.HeaderForwarded] != "" {
		t.Fatalf("guest saw %+v", echo)
	}
	// A proof made with the cluster secret is served (what the nodes send each other).
	at := time.Now().Unix()
	h := http.Header{edge.HeaderForwarded: {"b"}}
	proof := "v1." + strconv.FormatInt(at, 10) + "." + edge.NodeProof(a.cl.Secret(), http.MethodGet, "/sandboxes", at, h)
	if r := a.env.ctl(http.MethodGet, "/sandboxes", "", edge.HeaderForwarded, "b", edge.HeaderNodeProof, proof); r.status != http.StatusOK {
		t.Fatalf("a signed forwarded list: %d %s", r.status, r.body)
	}
	// The proof covers the request target: the same proof on another path is forged.
	if r := a.env.ctl(http.MethodGet, "/sandboxes/"+onB, "", edge.HeaderForwarded, "b", edge.HeaderNodeProof, proof); r.status != http.StatusForbidden {
		t.Fatalf("a proof replayed on another path: %d %s", r.status, r.body)
	}
	// The routes only nodes call refuse a client, whatever its API key.
	for _, path := range []string{"/ember/sandboxes/" + onB + "/adopt", "/ember/forks"} {
		if r := a.env.ctl(http.MethodPost, path, `{}`); r.status != http.StatusForbidden {
			t.Fatalf("a client's POST %s: %d %s, want 403", path, r.status, r.body)
		}
	}
	if string(a.cl.Secret()) != string(b.cl.Secret()) || len(a.cl.Secret()) < 16 {
		t.Fatal("the nodes do not share one cluster secret")
	}
}
