package api

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strings"
	"time"

	"github.com/ember-sandbox/ember/internal/sandbox"
)

// decodeJSON reads a JSON object into v. An empty body leaves v untouched unless required.
// Unknown fields are ignored (newer SDKs send fields ember does not use); wrong types, syntax
// errors and trailing data are 400, bodies over the limit 413.
func (s *server) decodeJSON(w http.ResponseWriter, r *http.Request, v any, required bool) error {
	body := http.MaxBytesReader(w, r.Body, s.cfg.MaxBodyBytes)
	dec := json.NewDecoder(body)
	err := dec.Decode(v)
	if errors.Is(err, io.EOF) {
		if required {
			return badRequest("request body is required")
		}
		return nil
	}
	if err != nil {
		return decodeError(err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		if err != nil {
			if de := decodeError(err); statusOf(de) == http.StatusRequestEntityTooLarge {
				return de
			}
		}
		return badRequest("request body must hold a single JSON object")
	}
	return nil
}

func decodeError(err error) error {
	var mbe *http.MaxBytesError
	if errors.As(err, &mbe) {
		return &httpError{status: http.StatusRequestEntityTooLarge, msg: fmt.Sprintf("request body larger than %d bytes", mbe.Limit)}
	}
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) {
		field := te.Field
		if field == "" {
			return badRequest("request body must be a JSON object, not %s", te.Value)
		}
		return badRequest("field %q: expected %s, got %s", field, te.Type, te.Value)
	}
	var se *json.SyntaxError
	if errors.As(err, &se) {
		return badRequest("malformed JSON at byte %d: %v", se.Offset, se)
	}
	if errors.Is(err, io.ErrUnexpectedEOF) {
		return badRequest("malformed JSON: unexpected end of body")
	}
	return badRequest("malformed JSON: %v", err)
}

var maxTimeoutSeconds = int64(sandbox.MaxTimeout / time.Second)

// timeoutSeconds validates a `timeout` in seconds. nil (absent) gives def; allowZero keeps an
// explicit 0, otherwise 0 also gives def.
func timeoutSeconds(field string, v *int64, def time.Duration, allowZero bool) (time.Duration, error) {
	if v == nil || (*v == 0 && !allowZero) {
		return def, nil
	}
	if *v < 0 {
		return 0, badRequest("%s must not be negative", field)
	}
	if *v > maxTimeoutSeconds {
		return 0, badRequest("%s must be at most %d seconds", field, maxTimeoutSeconds)
	}
	return time.Duration(*v) * time.Second, nil
}

// sandboxIDParam validates a sandbox id from a path. A legacy `<id>-<clientID>` (JS 1.x) is
// accepted by dropping the suffix. Odd ids cannot name a sandbox: 404.
func sandboxIDParam(p params) (string, error) {
	raw := p["id"]
	id, _, _ := strings.Cut(raw, "-")
	if !validSandboxID(id) {
		return "", notFound("sandbox %s not found", quoteID(raw))
	}
	return id, nil
}

var templateIDRe = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$`)

func validTemplateID(id string) bool { return templateIDRe.MatchString(id) }

var templateNameRe = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,63}$`)

var keyIDRe = regexp.MustCompile(`^[0-9a-f]{1,64}$`)
