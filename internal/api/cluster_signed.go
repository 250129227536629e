package api

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"
)

// A signed uploadUrl()/downloadUrl() request names no sandbox: only the signature, made with
// the sandbox's access token, tells which one it is for. In a cluster the edge that gets it and
// does not hold that sandbox asks the other live nodes which of theirs signed it (POST
// /ember/signed-files/owner, between nodes only), then routes the request there like any other
// (its body streams once, so an upload of any size works).

// signedQuery is what identifies a signed files request's sandbox.
type signedQuery struct {
	Path      string `json:"path"`
	Operation string `json:"operation"`
	User      string `json:"user"`
	Exp       int64  `json:"exp,omitempty"`
	Signature string `json:"signature"`
}

// signedOwner returns the id of the local sandbox (running or paused) whose access token made
// q's signature, or "".
func (s *server) signedOwner(ctx context.Context, q signedQuery) (string, error) {
	sbx, err := s.signedSandbox(ctx, q)
	if err != nil || sbx == nil {
		return "", err
	}
	return sbx.ID, nil
}

// signedOwnerPath is the request an edge sends the other nodes. It carries no API key (a
// signed URL has none): its node proof, checked by serveForwarded, is its authentication.
const signedOwnerPath = "/ember/signed-files/owner"

func (s *server) signedOwnerHere(w http.ResponseWriter, r *http.Request) error {
	var q signedQuery
	if err := s.decodeJSON(w, r, &q, true); err != nil {
		return err
	}
	id, err := s.signedOwner(r.Context(), q)
	if err != nil {
		return err
	}
	if id == "" {
		return notFound("no sandbox here signed it")
	}
	writeJSON(w, http.StatusOK, map[string]string{"sandboxID": id})
	return nil
}

// signedOwnerElsewhere asks every other live node which of its sandboxes signed q; "" when
// none did (or none answered within a few seconds), errFanoutLimited when this edge asked too
// often lately (signed_files.go).
func (s *server) signedOwnerElsewhere(r *http.Request, q signedQuery) string {
	if s.cl == nil || r.Header.Get(HeaderForwarded) != "" {
		return ""
	}
	if !s.fanout.allow() { // signed_files.go
		return errFanoutLimited
	}
	body, _ := json.Marshal(q)
	ctx, cancel := context.WithTimeout(r.Context(), 5*time.Second)
	defer cancel()
	var mu sync.Mutex
	found := ""
	var wg sync.WaitGroup
	for _, n := range s.cl.Live() {
		if n.ID == s.cl.NodeID() {
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
			out.Header.Set(HeaderForwarded, s.cl.NodeID())
			s.signForward(out)
			resp, err := s.nodeTransport.RoundTrip(out)
			if err != nil {
				return
			}
			defer resp.Body.Close()
			var a struct {
				SandboxID string `json:"sandboxID"`
			}
			if resp.StatusCode == http.StatusOK && json.NewDecoder(io.LimitReader(resp.Body, 4096)).Decode(&a) == nil && validSandboxID(a.SandboxID) {
				mu.Lock()
				found = a.SandboxID
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return found
}
