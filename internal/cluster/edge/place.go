package edge

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"

	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/errdefs"
)

// maxPlacements bounds the nodes one create tries when they refuse it.
const maxPlacements = 3

// placeCreate places a create: the cluster reserves room on a node (atomically in etcd), the
// create runs there (here, or forwarded with the reservation), and a node that refuses it
// (full, or failing) is excluded and the next one tried.
func (e *Edge) placeCreate(w http.ResponseWriter, r *http.Request, t Target) {
	ctx := r.Context()
	var exclude []string
	for attempt := 0; ; attempt++ {
		resv, err := e.cl.Place(ctx, cluster.PlaceRequest{TemplateID: t.TemplateID, Exclude: exclude})
		if err != nil {
			if errors.Is(err, errdefs.ErrNotFound) && attempt == 0 {
				// No live node has it: this node answers as E2B does.
				body, err := t.CreateHere(ctx, "")
				e.answerCreate(w, r, body, err)
				return
			}
			e.local.WriteError(w, r, err)
			return
		}
		var body []byte
		if resv.Local {
			body, err = t.CreateHere(ctx, resv.ID)
		} else {
			body, err = e.createOn(ctx, r, resv, t.Body)
		}
		if err != nil {
			e.cl.Cancel(context.WithoutCancel(ctx), resv)
		}
		status := errdefs.HTTPStatus(err)
		refused := status == http.StatusTooManyRequests || status == http.StatusServiceUnavailable || status == http.StatusBadGateway
		if refused && attempt+1 < maxPlacements {
			e.log.Info("cluster: node refused a create: trying another", "node", resv.Node, "status", status)
			exclude = append(exclude, resv.Node)
			continue
		}
		e.answerCreate(w, r, body, err)
		return
	}
}

func (e *Edge) answerCreate(w http.ResponseWriter, r *http.Request, body []byte, err error) {
	if err != nil {
		e.local.WriteError(w, r, err)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	_, _ = w.Write(body)
}

// createOn forwards a create to the node holding its reservation: the sandbox's JSON, or the
// node's error back in.
func (e *Edge) createOn(ctx context.Context, r *http.Request, resv *cluster.Reservation, body []byte) ([]byte, error) {
	out, err := http.NewRequestWithContext(ctx, r.Method, strings.TrimSuffix(resv.URL, "/")+r.URL.RequestURI(), bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	out.Header = r.Header.Clone()
	dropClientKey(out.Header)
	out.Header.Set(HeaderReservation, resv.ID)
	e.sign(out)
	resp, err := e.transport.RoundTrip(out)
	if err != nil {
		e.log.Warn("cluster: node unreachable for a create", "node", resv.Node, "err", err)
		return nil, &errdefs.StatusError{Status: http.StatusBadGateway, Message: "node " + resv.Node + " did not answer"}
	}
	defer resp.Body.Close()
	if err := errdefs.FromHTTP(resp); err != nil {
		return nil, err
	}
	b, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return nil, fmt.Errorf("node %s: create: %v: %w", resv.Node, err, errdefs.ErrUnavailable)
	}
	return b, nil
}
