package errdefs

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
)

// Errors cross between ember's nodes (and between an edge and its client) as an HTTP status
// with E2B's body {"code","message"}. The pair below is the only translation: WriteHTTP is the
// status out, FromHTTP the error back in, and an error that went out and came back in has the
// same category, status and message.

// StatusCoder is an error that names its HTTP status itself: an edge's own answers (a bad
// query, a missing API key) and an answer another node gave (*StatusError).
type StatusCoder interface {
	HTTPStatus() int
}

// Body is the error answer: E2B's shape, code always equal to the HTTP status (the JS SDK
// reads code from the body).
type Body struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

// WriteHTTP writes err's status and {"code","message"} with msg (the caller may hide the
// detail of a 500; "" keeps err's text).
func WriteHTTP(w http.ResponseWriter, err error, msg string) {
	status := HTTPStatus(err)
	if msg == "" {
		msg = err.Error()
	}
	WriteBody(w, status, msg)
}

// WriteBody writes status with {"code","message"}.
func WriteBody(w http.ResponseWriter, status int, msg string) {
	b, _ := json.Marshal(Body{Code: status, Message: msg})
	w.Header().Set("Content-Type", "application/json")
	if status == http.StatusTooManyRequests && w.Header().Get("Retry-After") == "" {
		// The SDKs retry a 429 only when Retry-After is an integer number of seconds.
		w.Header().Set("Retry-After", "1")
	}
	w.WriteHeader(status)
	_, _ = w.Write(append(b, '\n'))
}

// StatusError is an error with its own HTTP status: an answer another process gave (FromHTTP),
// or one an edge decides itself. It is in the category of its status (errors.Is(err,
// ErrNotFound) for a 404).
type StatusError struct {
	Status  int
	Message string
}

func (e *StatusError) Error() string   { return e.Message }
func (e *StatusError) HTTPStatus() int { return e.Status }
func (e *StatusError) Unwrap() error   { return categoryOf(e.Status) }

// FromHTTP is the error back in: nil for a 1xx-3xx answer, else a *StatusError with the
// answer's status and message (its body's, or the status text when the body is not ember's).
// It reads at most 64 KiB of the body and leaves closing it to the caller.
func FromHTTP(resp *http.Response) error {
	if resp.StatusCode < 400 {
		return nil
	}
	var b Body
	raw, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	msg := ""
	if json.Unmarshal(raw, &b) == nil && b.Message != "" {
		msg = b.Message
	} else if s := strings.TrimSpace(string(raw)); s != "" && len(s) < 512 && !strings.ContainsAny(s, "{<") {
		msg = s
	}
	if msg == "" {
		msg = strings.ToLower(http.StatusText(resp.StatusCode))
	}
	return &StatusError{Status: resp.StatusCode, Message: msg}
}

// categoryOf is HTTPStatus backwards.
func categoryOf(status int) error {
	switch status {
	case http.StatusNotFound:
		return ErrNotFound
	case http.StatusConflict:
		return ErrConflict
	case http.StatusBadRequest, http.StatusRequestEntityTooLarge:
		return ErrInvalid
	case http.StatusUnauthorized, http.StatusForbidden:
		return ErrUnauthorized
	case http.StatusTooManyRequests:
		return ErrExhausted
	case http.StatusServiceUnavailable, http.StatusBadGateway, http.StatusGatewayTimeout:
		return ErrUnavailable
	case http.StatusUnprocessableEntity:
		return ErrCorrupt
	}
	return errors.New(strings.ToLower(http.StatusText(status)))
}
