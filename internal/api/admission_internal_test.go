package api

import (
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/admission"
)

// The queue timeout comes from the header, else the query parameter, else the default; the
// tenant is the caller's key; bad values are a 400.
func TestAdmissionTicketOfARequest(t *testing.T) {
	for _, tc := range []struct {
		header, query string
		want          time.Duration
		bad           bool
	}{
		{want: admission.DefaultWait},
		{header: "2.5", want: 2500 * time.Millisecond},
		{query: "0", want: 0},
		{header: "1", query: "7", want: time.Second},
		{header: "-1", bad: true},
		{query: "soon", bad: true},
		{header: "100000", bad: true},
	} {
		r := httptest.NewRequest(http.MethodPost, "/sandboxes?queueTimeout="+tc.query, nil)
		if tc.query == "" {
			r = httptest.NewRequest(http.MethodPost, "/sandboxes", nil)
		}
		if tc.header != "" {
			r.Header.Set(HeaderQueueTimeout, tc.header)
		}
		r.Header.Set(HeaderAPIKey, "e2b_00ff")
		ctx, err := withAdmission(nil, r)
		if tc.bad {
			if err == nil || statusOf(err) != http.StatusBadRequest {
				t.Errorf("%+v: %v, want a 400", tc, err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("%+v: %v", tc, err)
		}
		got := admission.TicketOf(ctx)
		if got.Wait != tc.want || got.Tenant == "" || got.Tenant == "e2b_00ff" {
			t.Errorf("%+v: ticket %+v, want wait %s and the key's identity (not the key)", tc, got, tc.want)
		}
	}
}

// The queue's refusal is a 429 whose Retry-After (an integer number of seconds, which the
// SDKs retry on) is the refusal's.
func TestRefusalAnswers429WithRetryAfter(t *testing.T) {
	w := httptest.NewRecorder()
	r := httptest.NewRequest(http.MethodPost, "/sandboxes", nil)
	err := fmt.Errorf("this node runs its maximum of 2 sandboxes: %w", &admission.Refusal{Waited: time.Second, Retry: 3 * time.Second})
	writeError(w, slog.New(slog.DiscardHandler), r, err)
	if w.Code != http.StatusTooManyRequests || w.Header().Get("Retry-After") != "3" {
		t.Fatalf("refusal: %d, Retry-After %q, want 429 and 3", w.Code, w.Header().Get("Retry-After"))
	}
}
