package edge

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// ForkResult is one child of a fork as the API answers it: its sandbox, or why it failed.
type ForkResult struct {
	Sandbox any           `json:"sandbox,omitempty"`
	Error   *errdefs.Body `json:"error,omitempty"`
}

// forkRequest is POST /ember/forks: children of a stored fork image, on the node that holds
// their reservations.
type forkRequest struct {
	Fork         sandbox.PortableFork `json:"fork"`
	Timeout      time.Duration        `json:"timeout"`
	Reservations []string             `json:"reservations"`
}

// ForkAcross forks running sandbox sb (held here) with its children placed by the cluster:
// those placed here are forked by here(n), the others restored on their nodes from one fork
// image stored in the image store. ok=false leaves the whole fork to this node.
func (e *Edge) ForkAcross(ctx context.Context, sb *sandbox.Sandbox, count int, timeout time.Duration, here func(n int) []ForkResult) (out []ForkResult, ok bool) {
	if e == nil || e.forker == nil {
		return nil, false
	}
	local := 0
	groups := map[string][]*cluster.Reservation{}
	var order, used []string
	for i := 0; i < count; i++ {
		// Spread: each child avoids the nodes its siblings went to while others have room.
		if len(used) > 0 && len(used)%max(1, len(e.cl.Live())) == 0 {
			used = used[:0]
		}
		resv, err := e.cl.Place(ctx, cluster.PlaceRequest{TemplateID: sb.TemplateID, Avoid: used})
		if err != nil {
			local += count - i // no room elsewhere: here, where the node admits or refuses them
			break
		}
		used = append(used, resv.Node)
		if resv.Local {
			e.cl.Cancel(context.WithoutCancel(ctx), resv) // a local child is counted once it runs
			local++
			continue
		}
		if groups[resv.Node] == nil {
			order = append(order, resv.Node)
		}
		groups[resv.Node] = append(groups[resv.Node], resv)
	}
	if len(groups) == 0 {
		return nil, false
	}
	pf, err := e.forker.ExportFork(ctx, sb.ID)
	if err != nil {
		for _, rs := range groups {
			for _, rv := range rs {
				e.cl.Cancel(context.WithoutCancel(ctx), rv)
			}
		}
		e.log.Warn("cluster: fork image not stored: forking here only", "sandbox_id", sb.ID, "err", err)
		return nil, false
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, node := range order {
		rs := groups[node]
		wg.Add(1)
		go func() {
			defer wg.Done()
			res := e.forkOn(ctx, rs, pf, timeout)
			mu.Lock()
			out = append(out, res...)
			mu.Unlock()
		}()
	}
	if local > 0 {
		res := here(local)
		mu.Lock()
		out = append(out, res...)
		mu.Unlock()
	}
	wg.Wait()
	// Every child restored from the fork image (or failed): nothing reads it again.
	e.forker.DeleteStored(context.WithoutCancel(ctx), pf.ImageID)
	return out, true
}

// forkOn restores len(rs) children on the node holding reservations rs.
func (e *Edge) forkOn(ctx context.Context, rs []*cluster.Reservation, pf *sandbox.PortableFork, timeout time.Duration) []ForkResult {
	fail := func(err error) []ForkResult {
		for _, rv := range rs {
			e.cl.Cancel(context.WithoutCancel(ctx), rv)
		}
		out := make([]ForkResult, len(rs))
		for i := range out {
			out[i] = ForkResult{Error: &errdefs.Body{Code: errdefs.HTTPStatus(err), Message: err.Error()}}
		}
		return out
	}
	req := forkRequest{Fork: *pf, Timeout: timeout}
	for _, rv := range rs {
		req.Reservations = append(req.Reservations, rv.ID)
	}
	body, _ := json.Marshal(req)
	out, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimSuffix(rs[0].URL, "/")+"/ember/forks", bytes.NewReader(body))
	if err != nil {
		return fail(&errdefs.StatusError{Status: http.StatusBadGateway, Message: err.Error()})
	}
	out.Header.Set("Content-Type", "application/json")
	e.sign(out)
	resp, err := e.transport.RoundTrip(out)
	if err != nil {
		return fail(&errdefs.StatusError{Status: http.StatusBadGateway, Message: "node " + rs[0].Node + " did not answer"})
	}
	defer resp.Body.Close()
	if err := errdefs.FromHTTP(resp); err != nil {
		return fail(&errdefs.StatusError{Status: http.StatusBadGateway, Message: fmt.Sprintf("node %s: fork: %v", rs[0].Node, err)})
	}
	var res []ForkResult
	var raw []struct {
		Sandbox json.RawMessage `json:"sandbox,omitempty"`
		Error   *errdefs.Body   `json:"error,omitempty"`
	}
	if json.NewDecoder(io.LimitReader(resp.Body, 4<<20)).Decode(&raw) != nil {
		return fail(&errdefs.StatusError{Status: http.StatusBadGateway, Message: "node " + rs[0].Node + ": fork: bad answer"})
	}
	for _, r := range raw {
		fr := ForkResult{Error: r.Error}
		if len(r.Sandbox) > 0 {
			fr.Sandbox = r.Sandbox
		}
		res = append(res, fr)
	}
	return res
}

// ForkHere serves POST /ember/forks: children of a fork image stored by another node, each
// consuming one of the reservations the edge made here. The answer is the children's results.
func (e *Edge) ForkHere(w http.ResponseWriter, r *http.Request, maxCount int) ([]ForkResult, error) {
	if err := NodesOnly(r); err != nil {
		return nil, err
	}
	if e == nil || e.forker == nil {
		return nil, ErrNoCluster
	}
	var req forkRequest
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, e.local.MaxBodyBytes())).Decode(&req); err != nil {
		return nil, &errdefs.StatusError{Status: http.StatusBadRequest, Message: "bad fork request: " + err.Error()}
	}
	if len(req.Reservations) < 1 || len(req.Reservations) > maxCount {
		return nil, &errdefs.StatusError{Status: http.StatusBadRequest, Message: fmt.Sprintf("between 1 and %d reservations", maxCount)}
	}
	// Each child is claimed with its reservation as it starts (cluster.Events).
	results, err := e.forker.ForkFrom(r.Context(), &req.Fork, len(req.Reservations), req.Timeout, req.Reservations)
	if err != nil && len(results) == 0 {
		return nil, err
	}
	out := make([]ForkResult, 0, len(results))
	for i, res := range results {
		if res.Sandbox != nil {
			out = append(out, ForkResult{Sandbox: e.local.SandboxJSON(res.Sandbox)})
			continue
		}
		e.cl.Cancel(context.WithoutCancel(r.Context()), &cluster.Reservation{ID: req.Reservations[i], Node: e.cl.NodeID()})
		out = append(out, ForkResult{Error: &errdefs.Body{Code: errdefs.HTTPStatus(res.Err), Message: res.Err.Error()}})
	}
	return out, nil
}
