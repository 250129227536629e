package api

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// errorBody is E2B's error shape. The JS SDK reads `code` from the body (not the status) to
// tell 404 and 409 apart, so code always equals the HTTP status.
type errorBody = errdefs.Body

// httpError is an error the edge itself decides (bad input, auth, routing), with its status.
type httpError struct {
	status int
	msg    string
}

func (e *httpError) Error() string { return e.msg }

// HTTPStatus makes the status errdefs's (errdefs.StatusCoder).
func (e *httpError) HTTPStatus() int { return e.status }

func badRequest(format string, args ...any) error {
	return &httpError{status: http.StatusBadRequest, msg: fmt.Sprintf(format, args...)}
}

func notFound(format string, args ...any) error {
	return &httpError{status: http.StatusNotFound, msg: fmt.Sprintf(format, args...)}
}

// sandboxNotFoundAsE2B gives every 404 of a /sandboxes/{id} route E2B's wording, whatever the
// layer below said (unknown id, killed, not running).
func sandboxNotFoundAsE2B(h handlerFunc) handlerFunc {
	return func(w http.ResponseWriter, r *http.Request, p params) error {
		err := h(w, r, p)
		var ckpt *sandbox.CheckpointNotFoundError
		if errors.As(err, &ckpt) {
			return err // the sandbox is there, its checkpoint is not (checkpoints.go)
		}
		if err != nil && statusOf(err) == http.StatusNotFound {
			msg := sandboxNotFoundMsg(p["id"])
			// A sandbox that ended says why (E2B's wording first, for the SDKs).
			var gone *sandbox.GoneError
			if errors.As(err, &gone) {
				msg += ": it stopped (" + gone.Reason + ") at " + gone.At.UTC().Format(time.RFC3339)
			}
			return &httpError{status: http.StatusNotFound, msg: msg}
		}
		return err
	}
}

// sandboxNotFoundMsg is E2B's 404 message for a sandbox; the id is the one the caller used,
// without a legacy -clientID suffix.
func sandboxNotFoundMsg(raw string) string {
	id, _, _ := strings.Cut(raw, "-")
	return "Sandbox " + quoteID(id) + " doesn't exist or you don't have access to it"
}

// templateNotFoundAsE2B gives a create's 404 for an unknown template E2B's wording,
// "template '<id>' not found"; the id is the one the service's error quotes.
func templateNotFoundAsE2B(h handlerFunc) handlerFunc {
	return func(w http.ResponseWriter, r *http.Request, p params) error {
		return templateNotFoundE2B(h(w, r, p))
	}
}

// templateNotFoundE2B is templateNotFoundAsE2B for one create's error.
func templateNotFoundE2B(err error) error {
	if err == nil || statusOf(err) != http.StatusNotFound {
		return err
	}
	if m := quotedTemplateRe.FindStringSubmatch(err.Error()); m != nil {
		if id, uerr := strconv.Unquote(`"` + m[1] + `"`); uerr == nil {
			return &httpError{status: http.StatusNotFound, msg: "template " + quoteTemplate(id) + " not found"}
		}
	}
	return err
}

var quotedTemplateRe = regexp.MustCompile(`template "((?:[^"\\]|\\.)*)"`)

// statusOf is the one place errors become HTTP statuses (errdefs.HTTPStatus: an httpError's
// own, an answer another node gave, else the category's).
func statusOf(err error) int {
	return errdefs.HTTPStatus(err)
}

// writeError writes err as {"code","message"} with the matching status. 500s hide the detail
// from the caller and log it.
func writeError(w http.ResponseWriter, log *slog.Logger, r *http.Request, err error) {
	status := statusOf(err)
	msg := err.Error()
	switch {
	case status == http.StatusInternalServerError:
		log.Error("api error", "method", r.Method, "path", r.URL.Path, "err", err)
		msg = "internal error"
		// Another node's answer was already written for a client.
		var re *errdefs.StatusError
		if errors.As(err, &re) {
			msg = re.Message
		}
		// A sandbox that died as it started: say why, and where its logs are kept.
		var le *runtime.LaunchError
		if errors.As(err, &le) {
			msg += ": " + le.Summary()
		}
	case status >= 500:
		log.Warn("api error", "method", r.Method, "path", r.URL.Path, "status", status, "err", err)
	}
	// A 429 says when to try again: what the refusal says (the admission queue's), else 1 s.
	var ra interface{ RetryAfter() time.Duration }
	if status == http.StatusTooManyRequests && errors.As(err, &ra) {
		w.Header().Set("Retry-After", strconv.Itoa(max(1, int(math.Ceil(ra.RetryAfter().Seconds())))))
	}
	if status == http.StatusTooManyRequests && errors.Is(err, errdefs.ErrOverQuota) {
		w.Header().Set(errdefs.HeaderOverQuota, "1") // a cluster's edge tries no other node
	}
	errdefs.WriteBody(w, status, msg) // with Retry-After on a 429
}

func writeJSONError(w http.ResponseWriter, status int, msg string) {
	writeJSON(w, status, errorBody{Code: status, Message: msg})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		status = http.StatusInternalServerError
		b, _ = json.Marshal(errorBody{Code: status, Message: "internal error: encode response"})
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(append(b, '\n'))
}
