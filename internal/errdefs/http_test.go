package errdefs_test

import (
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// TestErrorsRoundTrip: every category goes out as its status and {"code","message"} and comes
// back in as the same category, status and message.
func TestErrorsRoundTrip(t *testing.T) {
	for _, cat := range []error{errdefs.ErrNotFound, errdefs.ErrConflict, errdefs.ErrInvalid, errdefs.ErrUnavailable,
		errdefs.ErrUnauthorized, errdefs.ErrCorrupt, errdefs.ErrExhausted} {
		t.Run(cat.Error(), func(t *testing.T) {
			err := fmt.Errorf("sandbox \"x\": %w", cat)
			back := roundTrip(t, err)
			if !errors.Is(back, cat) {
				t.Fatalf("back in: %v is not %v", back, cat)
			}
			if back.Error() != err.Error() {
				t.Fatalf("message %q, want %q", back.Error(), err.Error())
			}
			if got, want := errdefs.HTTPStatus(back), errdefs.HTTPStatus(err); got != want {
				t.Fatalf("status %d, want %d", got, want)
			}
			// Twice across (edge → node → edge → client) changes nothing.
			if again := roundTrip(t, back); again.Error() != err.Error() || errdefs.HTTPStatus(again) != errdefs.HTTPStatus(err) || !errors.Is(again, cat) {
				t.Fatalf("second round trip: %v", again)
			}
		})
	}
	t.Run("own status", func(t *testing.T) {
		for _, st := range []int{http.StatusForbidden, http.StatusBadGateway, http.StatusRequestEntityTooLarge, http.StatusInternalServerError} {
			back := roundTrip(t, &errdefs.StatusError{Status: st, Message: "m"})
			if errdefs.HTTPStatus(back) != st || back.Error() != "m" {
				t.Fatalf("%d came back as %d %q", st, errdefs.HTTPStatus(back), back.Error())
			}
		}
	})
	t.Run("not ember's body", func(t *testing.T) {
		rec := httptest.NewRecorder()
		rec.WriteHeader(http.StatusBadGateway)
		_, _ = rec.WriteString("<html>bad gateway</html>")
		back := errdefs.FromHTTP(rec.Result())
		if !errors.Is(back, errdefs.ErrUnavailable) || back.Error() != "bad gateway" {
			t.Fatalf("got %v", back)
		}
	})
	t.Run("success", func(t *testing.T) {
		rec := httptest.NewRecorder()
		rec.WriteHeader(http.StatusCreated)
		if err := errdefs.FromHTTP(rec.Result()); err != nil {
			t.Fatal(err)
		}
	})
}

func roundTrip(t *testing.T, err error) error {
	t.Helper()
	rec := httptest.NewRecorder()
	errdefs.WriteHTTP(rec, err, "")
	resp := rec.Result()
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusTooManyRequests && resp.Header.Get("Retry-After") != "1" {
		t.Fatal("429 without Retry-After")
	}
	back := errdefs.FromHTTP(resp)
	if back == nil {
		t.Fatalf("%v came back as no error", err)
	}
	return back
}
