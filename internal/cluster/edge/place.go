package edge

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/ember-sandbox/ember/internal/admission"
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
		resv, err := e.place(ctx, cluster.PlaceRequest{TemplateID: t.TemplateID, Exclude: exclude})
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
		// A node that is full or failing refuses a create another may take; the team's quota
		// refuses it on every node.
		refused := (status == http.StatusTooManyRequests && !errors.Is(err, errdefs.ErrOverQuota)) ||
			status == http.StatusServiceUnavailable || status == http.StatusBadGateway
		if refused && attempt+1 < maxPlacements {
			e.log.Info("cluster: node refused a create: trying another", "node", resv.Node, "status", status)
			exclude = append(exclude, resv.Node)
			continue
		}
		e.answerCreate(w, r, body, err)
		return
	}
}

// place places req; with the cluster full (no node has room) it waits in this edge's fair
// admission queue for as long as ctx's admission.Ticket allows, and places again whenever its
// view of the cluster shows room: the queue's take claims one of the places that view counts
// (less those being placed right now), so freed room wakes as many waiters as it can hold. A
// waiter that loses the race for it lines up again. It answers the queue's refusal (429 with
// Retry-After) when the wait is over or the queue full.
func (e *Edge) place(ctx context.Context, req cluster.PlaceRequest) (*cluster.Reservation, error) {
	resv, err := e.cl.Place(ctx, req)
	t := admission.TicketOf(ctx)
	if err == nil || !errors.Is(err, errdefs.ErrExhausted) || t.Wait <= 0 {
		return resv, err
	}
	start := time.Now()
	deadline := start.Add(t.Wait)
	if t.Waited != nil {
		defer func() { t.Waited(time.Since(start)) }()
	}
	for {
		left := time.Until(deadline)
		if left <= 0 {
			return nil, &admission.Refusal{Waited: time.Since(start), Retry: time.Second}
		}
		err := e.queue.Admit(ctx, t.Tenant, left, func() bool {
			if int(e.placing.Load()) >= e.cl.Room(req.TemplateID) {
				return false
			}
			e.placing.Add(1)
			return true
		})
		if err != nil {
			var ref *admission.Refusal
			if errors.As(err, &ref) {
				ref.Waited = time.Since(start)
			}
			return nil, err
		}
		resv, err = e.cl.Place(ctx, req)
		e.placing.Add(-1)
		e.queue.Kick() // what this one did not take (or gave back) goes to the next
		if err == nil || !errors.Is(err, errdefs.ErrExhausted) {
			return resv, err
		}
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
		var se *errdefs.StatusError
		if resp.Header.Get(errdefs.HeaderOverQuota) != "" && errors.As(err, &se) {
			return nil, overQuota{se}
		}
		return nil, err
	}
	b, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return nil, fmt.Errorf("node %s: create: %v: %w", resv.Node, err, errdefs.ErrUnavailable)
	}
	return b, nil
}

// overQuota is a node's refusal of a create by the team's quota (errdefs.HeaderOverQuota).
type overQuota struct{ *errdefs.StatusError }

func (e overQuota) Unwrap() []error { return []error{e.StatusError, errdefs.ErrOverQuota} }
