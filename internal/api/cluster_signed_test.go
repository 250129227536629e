package api

import (
	"context"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/cluster/edge"
)

// A signed uploadUrl()/downloadUrl() request names no sandbox; sent to an edge that does not
// hold the sandbox, it is served by the node that does.
func TestClusterSignedFilesReachAnyNode(t *testing.T) {
	nodes := newTestCluster(t, 2)
	a, b := nodes[0], nodes[1]
	var onB string
	for i := 0; i < 12 && onB == ""; i++ {
		var sb struct {
			SandboxID string `json:"sandboxID"`
		}
		a.env.ctl(http.MethodPost, "/sandboxes", `{"templateID":"base"}`).json(t, &sb)
		if b.holds(sb.SandboxID) {
			onB = sb.SandboxID
		}
	}
	if onB == "" {
		t.Fatal("nothing placed on b")
	}
	sbx, err := b.svc.Manager.Get(context.Background(), onB)
	if err != nil {
		t.Fatal(err)
	}
	exp := time.Now().Unix() + 60
	sig := auth.FileSignature("/a.txt", auth.OpRead, "user", sbx.AccessToken, exp)
	q := "/files?path=%2Fa.txt&username=user&signature=" + url.QueryEscape(sig) + "&signature_expiration=" + strconv.FormatInt(exp, 10)
	before := len(b.svc.hits())
	r := a.env.do(http.MethodGet, q, "")
	if r.status != http.StatusOK {
		t.Fatalf("signed download through a for b's sandbox: %d %s", r.status, r.body)
	}
	var echo guestEcho
	r.json(t, &echo)
	if hits := b.svc.hits()[before:]; echo.Path != "/files" || !slices.Equal(hits, []string{onB + ":49983"}) {
		t.Fatalf("reached %+v (b's guest hits %v), want b's sandbox %s at /files", echo, hits, onB)
	}
	bad := auth.FileSignature("/a.txt", auth.OpRead, "user", "not-a-token", exp)
	if r := a.env.do(http.MethodGet, "/files?path=%2Fa.txt&username=user&signature="+url.QueryEscape(bad)+"&signature_expiration="+strconv.FormatInt(exp, 10), ""); r.status != http.StatusUnauthorized {
		t.Fatalf("a signature no sandbox made: %d %s, want 401", r.status, r.body)
	}
	// The owner lookup is for nodes only.
	if r := b.env.do(http.MethodPost, "/ember/signed-files/owner", `{"path":"/a.txt"}`); r.status == http.StatusOK {
		t.Fatalf("a client's owner lookup: %d %s", r.status, r.body)
	}
}

// Signed URLs need no key, and each one for a sandbox the edge does not hold costs a lookup on
// every other node: an edge sends at most a burst of edge.FanoutBurst of them, then answers 429 with
// Retry-After; a signed URL of one of its own sandboxes still works meanwhile.
func TestClusterSignedFilesFanoutLimited(t *testing.T) {
	nodes := newTestCluster(t, 2)
	a := nodes[0]
	exp := time.Now().Unix() + 60
	bad := auth.FileSignature("/a.txt", auth.OpRead, "user", "not-a-token", exp)
	q := "/files?path=%2Fa.txt&username=user&signature=" + url.QueryEscape(bad) + "&signature_expiration=" + strconv.FormatInt(exp, 10)
	// The burst goes through (401: no sandbox made it); then the limit answers, once requests
	// come faster than edge.FanoutRate a second (they do on loopback).
	first := -1
	for i := 0; i < 50*edge.FanoutBurst && first < 0; i++ {
		r := a.env.do(http.MethodGet, q, "")
		switch r.status {
		case http.StatusUnauthorized:
		case http.StatusTooManyRequests:
			if r.header.Get("Retry-After") == "" {
				t.Fatal("429 without Retry-After")
			}
			first = i
		default:
			t.Fatalf("request %d: %d %s", i, r.status, r.body)
		}
	}
	if first < edge.FanoutBurst {
		t.Fatalf("first 429 at request %d, want none before the burst of %d is spent", first, edge.FanoutBurst)
	}
	// a's own sandbox is found without any fan-out.
	var sb struct {
		SandboxID string `json:"sandboxID"`
	}
	var own string
	for i := 0; i < 12 && own == ""; i++ {
		a.env.ctl(http.MethodPost, "/sandboxes", `{"templateID":"base"}`).json(t, &sb)
		if a.holds(sb.SandboxID) {
			own = sb.SandboxID
		}
	}
	if own == "" {
		t.Fatal("nothing placed on a")
	}
	sbx, err := a.svc.Manager.Get(context.Background(), own)
	if err != nil {
		t.Fatal(err)
	}
	sig := auth.FileSignature("/a.txt", auth.OpRead, "user", sbx.AccessToken, exp)
	if r := a.env.do(http.MethodGet, "/files?path=%2Fa.txt&username=user&signature="+url.QueryEscape(sig)+"&signature_expiration="+strconv.FormatInt(exp, 10), ""); r.status != http.StatusOK {
		t.Fatalf("a signed URL of the edge's own sandbox while limited: %d %s", r.status, r.body)
	}
}
