// Package api is ember's single HTTP edge. Every request is routed, in E2B's order, either to
// the sandbox plane (a reverse proxy into the sandbox's envd or any guest port, chosen by the
// E2b-Sandbox-Id header, a <port>-<id>.<domain> Host, or a signed /files URL) or to the control
// plane (E2B's REST API plus ember's extras: template builds and API keys), which requires an
// API key. It translates domain errors into HTTP statuses in one place (writeError) and owns
// the E2B wire format; it must not reach into the runtime, network or store directly — it only
// calls sandbox.Service and auth.Keys.
package api

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httputil"
	"regexp"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/cluster/edge"
	"github.com/ember-sandbox/ember/internal/envdclient"
	"github.com/ember-sandbox/ember/internal/quota"
	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/secret"
	"github.com/ember-sandbox/ember/internal/template/build"
	"github.com/ember-sandbox/ember/internal/volume"
)

// DefaultDomain is the sandbox domain when Config.Domain is empty. Browsers and curl resolve
// every *.localhost name to the loopback address, so with Domain set to "localhost:<port>" the
// SDK's getHost(port) URLs (http://<port>-<id>.localhost:<port>) reach this server's host
// routing without any DNS setup. Use a real wildcard domain (and TLS) for Mode B.
const DefaultDomain = "localhost"

// DefaultClientID is the constant (deprecated) clientID returned in every Sandbox.
const DefaultClientID = "ember"

// DefaultMaxBodyBytes bounds control-plane JSON request bodies.
const DefaultMaxBodyBytes = 1 << 20

// Config is the edge's configuration.
type Config struct {
	// Domain is returned as `domain` in sandbox responses (the SDK builds getHost() and, without
	// E2B_SANDBOX_URL, envd URLs from it) and is the suffix of routed hosts
	// `<port>-<id>[-<clientID>].<Domain>`. It may carry a port ("localhost:3000"); the port is
	// ignored when matching hosts. Default DefaultDomain.
	Domain string
	// MaxBodyBytes bounds control-plane request bodies (413 beyond). Default 1 MiB.
	MaxBodyBytes int64
	// ClientID is the constant clientID in responses. Default DefaultClientID.
	ClientID string
	// Metrics, if set, serves GET /metrics (Prometheus), behind the API key like every
	// control-plane call (Prometheus sends it as `authorization: {type: Bearer}`); the daemon's
	// --metrics-listen serves it without a key on a listener of its own.
	Metrics http.Handler
	// Cluster, when set, makes this node one edge of a cluster (cluster.go).
	Cluster Cluster
	// Templates, with Cluster, shares templates between the nodes (cluster.go).
	Templates TemplateSharer
	// Mover, with Cluster, moves stored paused sandboxes between the nodes (cluster.go).
	Mover PausedMover
	// Forker, with Cluster, places the children of a fork on other nodes (cluster.go).
	Forker Forker
	// Volumes, when set, serves E2B's volumes and their content API (volumes.go).
	Volumes *volume.Manager
	// Quotas keeps the teams within their quotas (quotas.go); nil: quotas over this node.
	Quotas *quota.Quotas
	// Secrets, when set, serves E2B's secrets (secrets.go) and resolves them at egress.
	Secrets *secret.Manager
	// Builds, when set, serves template builds (internal/template/build; templatebuild.go,
	// build.go).
	Builds build.TemplateBuilder
	// Startup, when set, is the daemon's start-up: while it builds its start-up templates the
	// API serves every request, a create of one of them waits for its build, and /health
	// answers 503 (a readiness probe waits for the templates).
	Startup Startup
}

// Startup tells which of the daemon's start-up templates are still being built.
type Startup interface {
	// Building lists the start-up templates still being built (empty: ready).
	Building() []string
	// Wait waits until template name is built if it is a start-up template still being built:
	// nil then, or the error of its build; nil at once for any other name.
	Wait(ctx context.Context, name string) error
}

func (c Config) withDefaults() Config {
	if c.Domain == "" {
		c.Domain = DefaultDomain
	}
	if c.MaxBodyBytes <= 0 {
		c.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if c.ClientID == "" {
		c.ClientID = DefaultClientID
	}
	return c
}

// Headers the SDKs send on every envd request.
const (
	HeaderSandboxID   = "E2b-Sandbox-Id"
	HeaderSandboxPort = "E2b-Sandbox-Port"
	HeaderNextToken   = "X-Next-Token"
	HeaderAPIKey      = "X-Api-Key"
)

type server struct {
	cfg Config
	// svc is the service the handlers call: shared as the request's team sees it (teams.go).
	svc sandbox.Service
	// shared is this node's service, or the cluster's view of it (templates shared).
	shared sandbox.Service
	// node is the Service New was given (the Manager), for its optional interfaces
	// (networkUpdater): svc may be the cluster's view of it.
	node   sandbox.Service
	keys   *auth.Keys
	log    *slog.Logger
	hostRe *regexp.Regexp
	proxy  *httputil.ReverseProxy
	routes *router
	// uploads are the COPY-file upload URLs handed out (templatebuild.go).
	uploads uploads
	// Cluster mode (nil: one node): the cluster edge serves what api hands it (cluster.go).
	cl   Cluster
	edge *edge.Edge
	// signer finds a signed URL's sandbox without its lock (signed_files.go).
	signer signer
	quotas *quota.Quotas
}

// New returns the daemon's HTTP handler. Serve it on one port; enabling h2c on the server is
// harmless and lets HTTP/2 clients in.
func New(cfg Config, svc sandbox.Service, keys *auth.Keys, logger *slog.Logger) http.Handler {
	cfg = cfg.withDefaults()
	if logger == nil {
		logger = slog.Default()
	}
	s := &server{cfg: cfg, svc: svc, node: svc, keys: keys, log: logger}
	s.signer, _ = svc.(signer) // signed_files.go
	if cfg.Cluster != nil {
		s.cl = cfg.Cluster
		if cfg.Templates != nil {
			s.svc = edge.ShareTemplates(svc, cfg.Templates)
		}
		s.edge = s.newEdge()
	}
	s.shared = s.svc
	s.svc = scoped{Service: s.shared, s: s}
	if s.quotas = cfg.Quotas; s.quotas == nil {
		s.quotas = s.newQuotas()
		if qb, ok := cfg.Cluster.(quotaBlocker); ok {
			s.quotas.SetBlocks(qb.NewQuotaBlocks(s.quotas.Held))
		}
	}
	domainHost := strings.ToLower(cfg.Domain)
	if h, _, ok := strings.Cut(domainHost, ":"); ok {
		domainHost = h
	}
	s.hostRe = regexp.MustCompile(`^(\d+)-([^.-]+)(-[^.]+)?\.` + regexp.QuoteMeta(domainHost) + `(:\d+)?$`)
	s.proxy = s.newProxy()
	s.routes = s.controlRoutes()
	return s
}

// ServeHTTP routes one request (E2B-PROTOCOL §1.5): header, then Host, then /files signature,
// else control plane.
func (s *server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	defer s.recoverPanic(w, r)
	if s.cl != nil && s.serveCluster(w, r) {
		return
	}

	if vals, ok := r.Header[HeaderSandboxID]; ok {
		id := ""
		if len(vals) > 0 {
			id = vals[0]
		}
		port, err := parsePort(r.Header.Get(HeaderSandboxPort))
		if err != nil {
			writeError(w, s.log, r, err)
			return
		}
		s.serveSandbox(w, r, id, port)
		return
	}
	if port, id, ok, err := s.matchHost(r.Host); ok {
		if err != nil {
			writeError(w, s.log, r, err)
			return
		}
		s.serveSandbox(w, r, id, port)
		return
	}
	if strings.HasPrefix(r.URL.Path, volumeContentPrefix) { // volumes.go: its own token
		s.serveVolumeContent(w, r)
		return
	}
	if strings.HasPrefix(r.URL.Path, uploadPrefix) {
		s.serveUpload(w, r)
		return
	}
	if r.URL.Path == "/files" {
		if sig := r.URL.Query().Get("signature"); strings.HasPrefix(sig, auth.SignaturePrefix) {
			s.serveSignedFiles(w, r, sig)
			return
		}
	}
	s.serveControl(w, r)
}

// matchHost recognises <port>-<id>[-<clientID>].<domain>[:port]. ok reports a match; err a
// matched host with an unusable port.
func (s *server) matchHost(host string) (port int, id string, ok bool, err error) {
	m := s.hostRe.FindStringSubmatch(strings.ToLower(host))
	if m == nil {
		return 0, "", false, nil
	}
	port, err = parsePort(m[1])
	return port, m[2], true, err
}

// parsePort parses a guest port; "" means envd's port.
func parsePort(v string) (int, error) {
	if v == "" {
		return envdclient.Port, nil
	}
	p, err := strconv.Atoi(v)
	if err != nil || p < 1 || p > 65535 {
		return 0, badRequest("invalid sandbox port %q", v)
	}
	return p, nil
}

func (s *server) recoverPanic(w http.ResponseWriter, r *http.Request) {
	rec := recover()
	if rec == nil {
		return
	}
	if rec == http.ErrAbortHandler {
		panic(rec)
	}
	s.log.Error("panic in handler", "method", r.Method, "path", r.URL.Path, "panic", fmt.Sprint(rec), "stack", string(debug.Stack()))
	writeJSONError(w, http.StatusInternalServerError, "internal error")
}

// serveControl authenticates and dispatches a control-plane request.
func (s *server) serveControl(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	sw := &statusWriter{ResponseWriter: w}
	defer func() {
		s.log.Debug("api request", "method", r.Method, "path", r.URL.Path, "status", sw.status, "duration", time.Since(start))
	}()
	if r.URL.Path == "/health" && (r.Method == http.MethodGet || r.Method == http.MethodHead) {
		if s.cfg.Startup != nil {
			if b := s.cfg.Startup.Building(); len(b) > 0 {
				writeJSON(sw, http.StatusServiceUnavailable, map[string]any{"status": "starting", "building": b})
				return
			}
		}
		writeJSON(sw, http.StatusOK, map[string]string{"status": "ok"})
		return
	}
	r, err := s.authenticate(r)
	if err != nil {
		writeError(sw, s.log, r, err)
		return
	}
	if r.URL.Path == "/metrics" && s.cfg.Metrics != nil && (r.Method == http.MethodGet || r.Method == http.MethodHead) {
		// Every team's usage and quotas are in it: an operator's view, for admin keys.
		if _, ok := auth.CallerOf(r.Context()); ok && !auth.IsAdmin(r.Context()) {
			writeError(sw, s.log, r, &httpError{status: http.StatusForbidden, msg: "/metrics needs an admin key (every team's usage is in it)"})
			return
		}
		s.cfg.Metrics.ServeHTTP(sw, r)
		return
	}
	s.routes.serve(sw, r, s.log)
}

// authenticate checks X-API-Key, falling back to `Authorization: Bearer <key>` when the header
// is absent (an Authorization header carrying E2B_ACCESS_TOKEN next to a valid X-API-Key is
// ignored), and returns r acting for the key's team (auth.WithCaller).
func (s *server) authenticate(r *http.Request) (*http.Request, error) {
	if fromNode, _ := r.Context().Value(nodeAuthenticated{}).(bool); fromNode {
		// An edge's, with a valid node proof: it checked the client's key and says whose
		// (internal/cluster/edge).
		if c, ok := edge.CallerFrom(r.Header); ok {
			return r.WithContext(auth.WithCaller(r.Context(), c)), nil
		}
		return r, nil
	}
	key := apiKeyOf(r)
	if key == "" {
		return r, &httpError{status: http.StatusUnauthorized, msg: "Invalid API key"}
	}
	k, err := s.keys.Verify(r.Context(), key)
	if err != nil {
		if http.StatusUnauthorized == statusOf(err) {
			return r, &httpError{status: http.StatusUnauthorized, msg: "Invalid API key"}
		}
		return r, err
	}
	return r.WithContext(auth.WithCaller(r.Context(), k.Caller())), nil
}

// apiKeyOf is r's API key: X-API-Key, else `Authorization: Bearer <key>` ("" = none).
func apiKeyOf(r *http.Request) string {
	key := r.Header.Get(HeaderAPIKey)
	if key == "" {
		if v := r.Header.Get("Authorization"); len(v) > 7 && strings.EqualFold(v[:7], "bearer ") {
			key = strings.TrimSpace(v[7:])
		}
	}
	return key
}

// statusWriter records the status for the access log; Unwrap keeps Flush and friends working
// through http.ResponseController.
type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

func (w *statusWriter) Flush() {
	_ = http.NewResponseController(w.ResponseWriter).Flush()
}

func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }
