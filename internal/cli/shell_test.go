package cli

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/envd"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// ember sandbox shell runs an interactive login bash on a pty through the daemon's sandbox plane
// (a real envd in process behind a stand-in for the daemon): keystrokes reach it, its output comes
// back, and the CLI returns the shell's exit code.
func TestShellRunsAPtyThroughTheSandboxPlane(t *testing.T) {
	testutil.RequireRoot(t)
	srv := envd.New(envd.Config{AccessToken: "tok", DefaultUser: "root"})
	t.Cleanup(func() { srv.Close() })
	t.Setenv("TERM", "dumb") // the shell then asks for xterm-256color
	envdH := srv.Handler()
	plane := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet && r.URL.Path == "/sandboxes/sb1" {
			io.WriteString(w, `{"sandboxID":"sb1","envdAccessToken":"tok"}`)
			return
		}
		if r.Header.Get("E2b-Sandbox-Id") != "sb1" || r.Header.Get("E2b-Sandbox-Port") != "49983" {
			http.Error(w, "not routed to sb1's envd", http.StatusBadGateway)
			return
		}
		envdH.ServeHTTP(w, r)
	}))
	t.Cleanup(plane.Close)

	in, keys, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	old := os.Stdin
	os.Stdin = in
	t.Cleanup(func() { os.Stdin = old; keys.Close(); in.Close() })
	go io.WriteString(keys, "echo shell-$((6*7)) $TERM\nexit 7\n")

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var code int
	out := captureStdout(t, func() {
		code, err = (&client{base: plane.URL, key: "k", http: plane.Client()}).shell(ctx, "sb1", "", "")
	})
	if err != nil || code != 7 || !strings.Contains(out, "shell-42 xterm-256color") {
		t.Fatalf("shell: code %d, err %v, output %q", code, err, out)
	}
}
