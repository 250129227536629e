package api

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/ember-sandbox/ember/internal/runtime"
)

// A 500 hides its detail, except for a sandbox that died as it started: why, and where its
// runtime logs are kept.
func TestWriteErrorLaunchFailure(t *testing.T) {
	le := &runtime.LaunchError{ID: "abc", Op: "restore", Reason: "panic: boom", Logs: "/data/logs/failed/abc-restore-1", Err: fmt.Errorf("runsc: exit status 128")}
	for _, tc := range []struct {
		err  error
		want string
	}{
		{fmt.Errorf("create: %w", le), "internal error: the sandbox failed to restore (abc): panic: boom (runtime logs kept in /data/logs/failed/abc-restore-1)"},
		{fmt.Errorf("secret detail"), "internal error"},
	} {
		w := httptest.NewRecorder()
		writeError(w, slog.New(slog.DiscardHandler), httptest.NewRequest(http.MethodPost, "/sandboxes", nil), tc.err)
		var body errorBody
		if err := json.NewDecoder(strings.NewReader(w.Body.String())).Decode(&body); err != nil {
			t.Fatal(err)
		}
		if w.Code != 500 || body.Message != tc.want {
			t.Errorf("writeError(%v) = %d %q, want 500 %q", tc.err, w.Code, body.Message, tc.want)
		}
	}
}
