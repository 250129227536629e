package edge

import (
	"context"
	"fmt"
	"net/http"
	"strings"

	"errors"

	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/errdefs"
)

// ErrNoCluster answers the cluster's routes on a node outside a cluster.
var ErrNoCluster = &errdefs.StatusError{Status: http.StatusNotFound, Message: "this node is not part of a cluster (ember serve --etcd-endpoints)"}

// AdoptHere serves POST /ember/sandboxes/{id}/adopt, which an edge sends to the node it
// placed a stored paused sandbox on: the sandbox becomes this node's.
func (e *Edge) AdoptHere(r *http.Request, id string) error {
	if err := NodesOnly(r); err != nil {
		return err
	}
	if e == nil || e.mover == nil {
		return ErrNoCluster
	}
	return e.mover.Adopt(r.Context(), id)
}

// relocate moves a stored paused sandbox whose node is gone or drained to a node placement
// chooses (its own node first, if it is a candidate), before its request is served there, and
// returns where the sandbox is now. Anything else is left where it is.
func (e *Edge) relocate(r *http.Request, id string, loc cluster.Location) (cluster.Location, error) {
	if e.mover == nil || loc.Lost != nil {
		return loc, nil
	}
	draining := e.cl.Draining(loc.Node)
	if !loc.Stored && draining && !loc.Local {
		// A draining node is storing its sandboxes: this edge's cache may not have seen the
		// stored route yet, and the node itself would resume it there.
		if fresh, err := e.cl.Locate(r.Context(), id, true); err == nil {
			loc = fresh
		}
	}
	if !loc.Stored {
		return loc, nil
	}
	if !loc.Dead && loc.URL != "" && !draining || loc.Local && !draining {
		return loc, nil
	}
	ctx := r.Context()
	var exclude []string
	for attempt := 0; attempt < maxPlacements; attempt++ {
		resv, err := e.cl.Place(ctx, cluster.PlaceRequest{TemplateID: loc.TemplateID, Prefer: loc.Node, Exclude: exclude})
		if err != nil {
			return loc, err
		}
		err = e.adoptOn(ctx, resv, id)
		e.cl.Cancel(context.WithoutCancel(ctx), resv) // adopted paused: it takes room when it resumes
		if err == nil {
			e.log.Info("cluster: moved a stored paused sandbox", "sandbox_id", id, "from", loc.Node, "to", resv.Node)
			return e.cl.Locate(ctx, id, true)
		}
		if errors.Is(err, errdefs.ErrConflict) {
			// Moved meanwhile by another edge, or its node serves it after all.
			return e.cl.Locate(ctx, id, true)
		}
		e.log.Warn("cluster: adopting a stored sandbox failed: trying another node", "sandbox_id", id, "node", resv.Node, "err", err)
		exclude = append(exclude, resv.Node)
	}
	return loc, fmt.Errorf("no node could adopt paused sandbox %q: %w", id, errdefs.ErrUnavailable)
}

// adoptOn has the node of resv adopt sandbox id.
func (e *Edge) adoptOn(ctx context.Context, resv *cluster.Reservation, id string) error {
	if resv.Local {
		return e.mover.Adopt(ctx, id)
	}
	out, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimSuffix(resv.URL, "/")+"/ember/sandboxes/"+id+"/adopt", nil)
	if err != nil {
		return err
	}
	e.sign(out)
	resp, err := e.transport.RoundTrip(out)
	if err != nil {
		return fmt.Errorf("node %s did not answer: %w", resv.Node, errdefs.ErrUnavailable)
	}
	defer resp.Body.Close()
	if err := errdefs.FromHTTP(resp); err != nil {
		return fmt.Errorf("node %s: adopt: %w", resv.Node, err)
	}
	return nil
}
