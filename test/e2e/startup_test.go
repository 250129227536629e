package e2e

import (
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/testutil"
)

// TestAPIServesWhileStartupTemplatesBuild: a daemon building its start-up templates (here base,
// on a fresh data dir) serves its API meanwhile: /health answers 503 naming what it builds,
// every other call is answered, and a create of the template being built waits for its build
// and succeeds. Before, the API accepted connections and answered nothing until the build
// ended (an SDK create waited out its timeout).
func TestAPIServesWhileStartupTemplatesBuild(t *testing.T) {
	d := ownDaemon(t, daemonOpts{Flags: []string{"--pool-size", "0", "--prestart-max", "0"}})
	if err := d.launch(); err != nil {
		t.Fatal(err)
	}
	// health: the status of /health and its body; 0 while nothing answers.
	health := func() (int, string) {
		resp, err := httpClient.Get("http://" + d.addr + "/health")
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	testutil.EventuallyOr(t, 10*time.Minute, func() bool {
		if !d.running() {
			t.Fatalf("ember serve exited: %v\n%s", d.exitErr, d.logs())
		}
		code, body := health()
		if code == http.StatusOK {
			t.Fatalf("the API answered only once the start-up templates were built (%s)\n%s", body, d.logs())
		}
		if code == http.StatusServiceUnavailable {
			var h struct {
				Status   string   `json:"status"`
				Building []string `json:"building"`
			}
			if err := json.Unmarshal([]byte(body), &h); err != nil || h.Status != "starting" || len(h.Building) != 1 || h.Building[0] != "base" {
				t.Fatalf("/health while base builds: %s", body)
			}
			return true
		}
		return false
	}, func() string { return "the API did not answer\n" + d.logs() })
	key, err := os.ReadFile(filepath.Join(d.dataDir, "api-key"))
	if err != nil {
		t.Fatal(err)
	}
	d.key = strings.TrimSpace(string(key))
	// Everything else is served meanwhile.
	if code, body, err := d.call(10*time.Second, http.MethodGet, "/sandboxes", nil, nil); err != nil || code != http.StatusOK {
		t.Fatalf("GET /sandboxes while base builds: %d %s %v", code, body, err)
	}
	if code, _ := health(); code != http.StatusServiceUnavailable {
		t.Fatalf("base was built before the API was asked (/health %d): the test proves nothing", code)
	}
	// A create of base waits for its build.
	var sb struct {
		SandboxID string `json:"sandboxID"`
	}
	code, body, err := d.call(10*time.Minute, http.MethodPost, "/sandboxes", map[string]any{"templateID": "base"}, &sb)
	if err != nil || code != http.StatusCreated {
		t.Fatalf("create of base during its start-up build: %d %s %v\n%s", code, body, err, d.logs())
	}
	if code, body := health(); code != http.StatusOK {
		t.Fatalf("/health after the build: %d %s", code, body)
	}
	d.started = true
	if code, body, err := d.call(time.Minute, http.MethodDelete, "/sandboxes/"+sb.SandboxID, nil, nil); err != nil || code/100 != 2 {
		t.Fatalf("kill: %d %s %v", code, body, err)
	}
}
