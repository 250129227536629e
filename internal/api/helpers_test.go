package api

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"

	"github.com/ember-sandbox/ember/api/gen/process/processconnect"
	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

const testDomain = "ember.test:3000"

type env struct {
	t     *testing.T
	fake  *service // the real Manager over test doubles
	keys  *auth.Keys
	key   string
	api   *httptest.Server
	guest *guest
}

func newEnv(t *testing.T) *env {
	t.Helper()
	return newEnvConfig(t, Config{Domain: testDomain})
}

// newEnvConfig is newEnv with a Config of the test's.
func newEnvConfig(t *testing.T, cfg Config) *env {
	t.Helper()
	return newEnvWith(t, cfg, nil)
}

// newEnvWith is newEnvConfig over a node of mod's sandbox config.
func newEnvWith(t *testing.T, cfg Config, mod func(*sandbox.Config)) *env {
	t.Helper()
	keys := auth.NewKeys(auth.NewMemoryBackend())
	key, _, err := keys.Create(context.Background(), "test")
	if err != nil {
		t.Fatal(err)
	}
	g := newGuest(t)
	fake := newServiceWith(t, g.srv.Listener.Addr().String(), mod)
	if cfg.Builds == nil {
		cfg.Builds = fake.builds()
	}
	h := New(cfg, fake, keys, testLogger(t))
	api := httptest.NewServer(h)
	t.Cleanup(api.Close)
	return &env{t: t, fake: fake, keys: keys, key: key, api: api, guest: g}
}

type resp struct {
	status int
	header http.Header
	body   []byte
}

func (r resp) json(t *testing.T, v any) {
	t.Helper()
	if err := json.Unmarshal(r.body, v); err != nil {
		t.Fatalf("response %d is not JSON (%v): %q", r.status, err, r.body)
	}
}

// wantError asserts the status and the E2B error shape {"code":status,"message":...}.
func (r resp) wantError(t *testing.T, status int) {
	t.Helper()
	if r.status != status {
		t.Fatalf("status = %d, want %d; body %s", r.status, status, r.body)
	}
	var eb struct {
		Code    *int    `json:"code"`
		Message *string `json:"message"`
	}
	r.json(t, &eb)
	if eb.Code == nil || *eb.Code != status || eb.Message == nil {
		t.Fatalf("error body %s, want {\"code\":%d,\"message\":...}", r.body, status)
	}
	if ct := r.header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
		t.Fatalf("error Content-Type %q", ct)
	}
}

// do sends a request; hdr pairs are header name, value. Use "Host" to set the Host.
func (e *env) do(method, path, body string, hdr ...string) resp {
	e.t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, e.api.URL+path, rd)
	if err != nil {
		e.t.Fatal(err)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		if http.CanonicalHeaderKey(hdr[i]) == "Host" {
			req.Host = hdr[i+1]
			continue
		}
		req.Header.Set(hdr[i], hdr[i+1])
	}
	res, err := e.api.Client().Do(req)
	if err != nil {
		e.t.Fatal(err)
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if err != nil {
		e.t.Fatal(err)
	}
	return resp{status: res.StatusCode, header: res.Header, body: b}
}

// ctl sends an authenticated control-plane request.
func (e *env) ctl(method, path, body string, hdr ...string) resp {
	e.t.Helper()
	return e.do(method, path, body, append([]string{"X-API-Key", e.key}, hdr...)...)
}

// guest stands in for envd (or any guest port) behind GuestURL.
type guest struct {
	srv     *httptest.Server
	release chan struct{}
	procs   *fakeProcesses // envd's process service (template build steps)
}

type guestEcho struct {
	Method    string            `json:"method"`
	Path      string            `json:"path"`
	Query     string            `json:"query"`
	Host      string            `json:"host"`
	Token     string            `json:"token"`
	SandboxID string            `json:"sandboxId"`
	Body      string            `json:"body"`
	Headers   map[string]string `json:"headers"`
}

func newGuest(t testing.TB) *guest {
	g := &guest{release: make(chan struct{}), procs: &fakeProcesses{release: make(chan struct{})}}
	mux := http.NewServeMux()
	mux.Handle(processconnect.NewProcessHandler(g.procs))
	mux.HandleFunc("/stream", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/connect+json")
		_, _ = io.WriteString(w, "chunk1\n")
		_ = http.NewResponseController(w).Flush()
		select {
		case <-g.release:
		case <-r.Context().Done():
			return
		}
		_, _ = io.WriteString(w, "chunk2\n")
	})
	// /duplex answers after the first body line, then echoes the rest of the body as it arrives
	// (Connect streams answer before the request body has been read to its end).
	mux.HandleFunc("/duplex", func(w http.ResponseWriter, r *http.Request) {
		_ = http.NewResponseController(w).EnableFullDuplex()
		br := bufio.NewReader(r.Body)
		first, _ := br.ReadString('\n')
		_, _ = io.WriteString(w, "got "+first)
		_ = http.NewResponseController(w).Flush()
		rest, _ := io.ReadAll(br)
		_, _ = io.WriteString(w, "then "+string(rest))
	})
	mux.HandleFunc("/ws", func(w http.ResponseWriter, r *http.Request) {
		if !strings.EqualFold(r.Header.Get("Upgrade"), "websocket") {
			http.Error(w, "want upgrade", http.StatusBadRequest)
			return
		}
		conn, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer conn.Close()
		_, _ = brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
		_ = brw.Flush()
		_, _ = io.Copy(conn, brw) // echo until the client closes
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/json")
		hdr := map[string]string{}
		for k := range r.Header {
			hdr[k] = r.Header.Get(k)
		}
		_ = json.NewEncoder(w).Encode(guestEcho{
			Method: r.Method, Path: r.URL.Path, Query: r.URL.RawQuery, Host: r.Host,
			Token: r.Header.Get("X-Access-Token"), SandboxID: r.Header.Get("E2b-Sandbox-Id"),
			Body: string(b), Headers: hdr,
		})
	})
	g.srv = httptest.NewServer(mux)
	t.Cleanup(g.srv.Close)
	return g
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }
