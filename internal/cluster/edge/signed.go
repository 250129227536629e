package edge

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// A signed uploadUrl()/downloadUrl() request names no sandbox: only the signature, made with
// the sandbox's access token, tells which one it is for. In a cluster the edge that gets it and
// does not hold that sandbox asks the other live nodes which of theirs signed it (POST
// /ember/signed-files/owner, between nodes only), then routes the request there like any other
// (its body streams once, so an upload of any size works).

// SignedQuery is what identifies a signed files request's sandbox.
type SignedQuery struct {
	Path      string `json:"path"`
	Operation string `json:"operation"`
	User      string `json:"user"`
	Exp       int64  `json:"exp,omitempty"`
	Signature string `json:"signature"`
}

// signedOwnerPath is the request an edge sends the other nodes. It carries no API key (a
// signed URL has none): its node proof, checked by ServeForwarded, is its authentication.
const signedOwnerPath = "/ember/signed-files/owner"

func (e *Edge) signedOwnerHere(w http.ResponseWriter, r *http.Request) error {
	var q SignedQuery
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, e.local.MaxBodyBytes()))
	if err := dec.Decode(&q); err != nil {
		return &errdefs.StatusError{Status: http.StatusBadRequest, Message: "bad signed query: " + err.Error()}
	}
	id, err := e.local.SignedOwner(r.Context(), q)
	if err != nil {
		return err
	}
	if id == "" {
		return &errdefs.StatusError{Status: http.StatusNotFound, Message: "no sandbox here signed it"}
	}
	b, _ := json.Marshal(map[string]string{"sandboxID": id})
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(append(b, '\n'))
	return nil
}

// Signed-URL lookups an edge sends to the other nodes: FanoutRate a second on average, up to
// FanoutBurst at once. A signed URL of a sandbox on the edge itself never costs one; past the
// limit a request for another node's sandbox answers 429 with Retry-After.
const (
	FanoutRate  = 50
	FanoutBurst = 100
)

// ErrFanoutLimited is what SignedOwnerElsewhere says when this edge asked too often lately.
var ErrFanoutLimited = &errdefs.StatusError{Status: http.StatusTooManyRequests, Message: "too many signed file requests for sandboxes on other nodes: retry shortly"}

// fanoutLimit is a token bucket (the zero value is full).
type fanoutLimit struct {
	mu     sync.Mutex
	tokens float64
	last   time.Time
	now    func() time.Time // tests
}

func (l *fanoutLimit) allow() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := time.Now()
	if l.now != nil {
		now = l.now()
	}
	if l.last.IsZero() {
		l.tokens = FanoutBurst
	} else {
		l.tokens = min(FanoutBurst, l.tokens+now.Sub(l.last).Seconds()*FanoutRate)
	}
	l.last = now
	if l.tokens < 1 {
		return false
	}
	l.tokens--
	return true
}

// ServeSigned serves a signed files request for a sandbox that is not this node's: it asks
// every other live node which of its sandboxes signed q (within a few seconds) and routes the
// request there. False: no node's did (the caller answers "invalid signature").
func (e *Edge) ServeSigned(w http.ResponseWriter, r *http.Request, q SignedQuery) bool {
	if r.Header.Get(HeaderForwarded) != "" {
		return false
	}
	if !e.fanout.allow() {
		e.local.WriteError(w, r, ErrFanoutLimited)
		return true
	}
	id := e.signedOwnerElsewhere(r.Context(), q)
	if id == "" {
		return false
	}
	if !e.route(w, r, id, "", true) {
		e.local.ServeSandbox(w, r, id, "")
	}
	return true
}

func (e *Edge) signedOwnerElsewhere(ctx context.Context, q SignedQuery) string {
	body, _ := json.Marshal(q)
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var mu sync.Mutex
	found := ""
	var wg sync.WaitGroup
	for _, n := range e.cl.Live() {
		if n.ID == e.cl.NodeID() {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			out, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimSuffix(n.URL, "/")+signedOwnerPath, bytes.NewReader(body))
			if err != nil {
				return
			}
			out.Header.Set("Content-Type", "application/json")
			e.sign(out)
			resp, err := e.transport.RoundTrip(out)
			if err != nil {
				return
			}
			defer resp.Body.Close()
			if errdefs.FromHTTP(resp) != nil {
				return
			}
			var a struct {
				SandboxID string `json:"sandboxID"`
			}
			if json.NewDecoder(io.LimitReader(resp.Body, 4096)).Decode(&a) == nil && validID(a.SandboxID) {
				mu.Lock()
				found = a.SandboxID
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return found
}

// validID: ember's sandbox ids are [a-z0-9]+.
func validID(id string) bool {
	if id == "" || len(id) > 64 {
		return false
	}
	for _, c := range id {
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') {
			return false
		}
	}
	return true
}
