// Package errdefs holds the few error categories that every ember package wraps its errors in
// (with fmt.Errorf("...: %w", errdefs.ErrNotFound)). They are translated once, at the edge, into
// HTTP statuses (internal/api) and Connect codes (internal/envd). It must not import anything of
// ember's.
package errdefs

import (
	"errors"
	"net/http"
)

var (
	// ErrNotFound: the named thing (sandbox, template, snapshot, process, file) does not exist.
	ErrNotFound = errors.New("not found")
	// ErrConflict: the thing exists but is in the wrong state for the call (pausing a paused sandbox).
	ErrConflict = errors.New("conflict")
	// ErrInvalid: the caller's input is wrong.
	ErrInvalid = errors.New("invalid argument")
	// ErrUnavailable: a dependency or the sandbox is temporarily unable to serve.
	ErrUnavailable = errors.New("unavailable")
	// ErrUnauthorized: missing or wrong credentials.
	ErrUnauthorized = errors.New("unauthorized")
	// ErrCorrupt: stored data failed its integrity check and was refused.
	ErrCorrupt = errors.New("corrupt data")
	// ErrExhausted: a limit was reached (slots, sandboxes, disk).
	ErrExhausted = errors.New("resource exhausted")
	// ErrOverQuota: a team's quota was reached, an ErrExhausted that is the caller's and not
	// the node's (any other node refuses it too). Its HTTP answers carry HeaderOverQuota.
	ErrOverQuota error = &narrower{msg: "over quota", of: ErrExhausted}
)

// HeaderOverQuota marks an answer refused by the caller's team's quota (ErrOverQuota).
const HeaderOverQuota = "X-Ember-Over-Quota"

// narrower is a category inside another.
type narrower struct {
	msg string
	of  error
}

func (e *narrower) Error() string { return e.msg }
func (e *narrower) Unwrap() error { return e.of }

// HTTPStatus maps an error to the HTTP status the API returns for it: the status an error
// names itself (StatusCoder), else its category's.
func HTTPStatus(err error) int {
	var sc StatusCoder
	var mbe *http.MaxBytesError
	switch {
	case err == nil:
		return http.StatusOK
	case errors.As(err, &sc):
		return sc.HTTPStatus()
	case errors.As(err, &mbe):
		return http.StatusRequestEntityTooLarge
	case errors.Is(err, ErrNotFound):
		return http.StatusNotFound
	case errors.Is(err, ErrConflict):
		return http.StatusConflict
	case errors.Is(err, ErrInvalid):
		return http.StatusBadRequest
	case errors.Is(err, ErrUnauthorized):
		return http.StatusUnauthorized
	case errors.Is(err, ErrExhausted):
		return http.StatusTooManyRequests
	case errors.Is(err, ErrUnavailable):
		return http.StatusServiceUnavailable
	case errors.Is(err, ErrCorrupt):
		return http.StatusUnprocessableEntity
	default:
		return http.StatusInternalServerError
	}
}
