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
	if r := b.env.do(http.MethodPost, signedOwnerPath, `{"path":"/a.txt"}`); r.status == http.StatusOK {
		t.Fatalf("a client's owner lookup: %d %s", r.status, r.body)
	}
}
