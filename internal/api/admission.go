package api

import (
	"context"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/ember-sandbox/ember/internal/admission"
	"github.com/ember-sandbox/ember/internal/auth"
)

// A create that finds the node full waits in its fair admission queue (internal/admission) for
// up to the caller's queue timeout: the X-Ember-Queue-Timeout header or the queueTimeout query
// parameter, in seconds (fractions allowed; 0 = do not wait), default
// admission.DefaultWait, at most admission.MaxWait. It is separate from the sandbox's
// `timeout` (its lifetime), which keeps E2B's meaning.
const (
	HeaderQueueTimeout = "X-Ember-Queue-Timeout"
	queryQueueTimeout  = "queueTimeout"
)

// HeaderQueueWait, on a create's answer, is how long it waited for room in seconds (0 = it
// did not wait).
const HeaderQueueWait = "X-Ember-Queue-Wait"

// withAdmission returns r's context carrying its admission ticket: its tenant and how long it
// may wait for room. With w, the answer says how long the create waited (HeaderQueueWait).
func withAdmission(w http.ResponseWriter, r *http.Request) (context.Context, error) {
	wait := admission.DefaultWait
	v := r.Header.Get(HeaderQueueTimeout)
	field := HeaderQueueTimeout
	if v == "" {
		v, field = r.URL.Query().Get(queryQueueTimeout), queryQueueTimeout
	}
	if v != "" {
		f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
		if err != nil || math.IsNaN(f) || f < 0 {
			return nil, badRequest("%s must be a number of seconds, not negative", field)
		}
		if f > admission.MaxWait.Seconds() {
			return nil, badRequest("%s must be at most %d seconds", field, int(admission.MaxWait.Seconds()))
		}
		wait = time.Duration(f * float64(time.Second))
	}
	t := admission.Ticket{Tenant: auth.TeamOf(r.Context()), Wait: wait} // fair across teams
	if w != nil {
		t.Waited = func(d time.Duration) {
			w.Header().Set(HeaderQueueWait, strconv.FormatFloat(d.Seconds(), 'f', 3, 64))
		}
	}
	return admission.WithTicket(r.Context(), t), nil
}
