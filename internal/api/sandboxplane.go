package api

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/envdclient"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

type proxyTargetKey struct{}

// notRunningBody is the body of E2B's proxy errors on the sandbox plane (client-proxy's
// templates, JSON form): the 502 the SDKs read as "sandbox not running", the 502 of a port
// nothing listens on, the 403s of a traffic access token.
type notRunningBody struct {
	SandboxID string `json:"sandboxId"`
	Message   string `json:"message"`
	Port      int    `json:"port,omitempty"`
	Code      int    `json:"code"`
}

// E2B's messages (client-proxy).
const (
	msgSandboxNotFound = "The sandbox was not found"
	msgPortClosed      = "The sandbox is running but port is not open"
)

func writeNotRunning(w http.ResponseWriter, id string) { writeNotRunningErr(w, id, nil) }

// writeNotRunningErr is writeNotRunning that says why when err tells that the sandbox ended.
func writeNotRunningErr(w http.ResponseWriter, id string, err error) {
	writeNotRunningTo(w, nil, id, err)
}

// writeNotRunningTo answers a request for a sandbox that does not run (unknown, killed, ended,
// paused without autoResume): E2B's 502, in the form the caller reads. A Connect stream (envd's
// process and watch streams) gets an end-of-stream error (code unavailable, which the SDKs map
// as they map the 502), and a unary Connect call an error body, both saying why when ember knows;
// everything else gets E2B's JSON 502, word for word:
// {"sandboxId":"<id>","message":"The sandbox was not found","code":502}.
func writeNotRunningTo(w http.ResponseWriter, r *http.Request, id string, err error) {
	msg := "sandbox " + quoteID(id) + " is not running or does not exist"
	var gone *sandbox.GoneError
	if errors.As(err, &gone) {
		msg = "sandbox " + quoteID(id) + " is not running: it stopped (" + gone.Reason + ") at " + gone.At.UTC().Format(time.RFC3339)
	}
	if r != nil {
		ct := r.Header.Get("Content-Type")
		connectErr := map[string]any{"code": "unavailable", "message": msg}
		switch {
		case strings.HasPrefix(ct, "application/connect+"):
			end, _ := json.Marshal(map[string]any{"error": connectErr})
			frame := make([]byte, 5, 5+len(end))
			frame[0] = 0x02 // end-of-stream
			binary.BigEndian.PutUint32(frame[1:], uint32(len(end)))
			w.Header().Set("Content-Type", ct)
			w.WriteHeader(http.StatusOK)
			_, _ = w.Write(append(frame, end...))
			return
		case r.Header.Get("Connect-Protocol-Version") != "":
			writeJSON(w, http.StatusBadGateway, connectErr)
			return
		}
	}
	writeJSON(w, http.StatusBadGateway, notRunningBody{SandboxID: id, Message: msgSandboxNotFound, Code: http.StatusBadGateway})
}

// writePortClosed is E2B's answer for a running sandbox with nothing listening on port.
func writePortClosed(w http.ResponseWriter, id string, port int) {
	writeJSON(w, http.StatusBadGateway, notRunningBody{SandboxID: id, Message: msgPortClosed, Port: port, Code: http.StatusBadGateway})
}

// quoteID keeps hostile ids out of messages' structure and bounds their length.
func quoteID(id string) string {
	if len(id) > 64 {
		id = id[:64] + "…"
	}
	return `"` + url.PathEscape(id) + `"`
}

func (s *server) newProxy() *httputil.ReverseProxy {
	transport := s.svc.GuestTransport()
	if transport == nil {
		transport = http.DefaultTransport
	}
	return &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			target := pr.In.Context().Value(proxyTargetKey{}).(*url.URL)
			pr.SetURL(target)
			// Keep the Host the client used (apps behind the proxy see their public name), unless
			// the sandbox masks it (network.maskRequestHost).
			pr.Out.Host = guestHost(pr.In)
			pr.SetXForwarded()
			stripCredentials(pr.Out.Header)
		},
		Transport:     transport,
		FlushInterval: -1, // flush every write: Connect streams must not be buffered
		ErrorLog:      slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if errors.Is(err, context.Canceled) || r.Context().Err() != nil {
				return // the client went away
			}
			id, _ := r.Context().Value(proxySandboxKey{}).(string)
			if port, perr := strconv.Atoi(r.URL.Port()); perr == nil && errors.Is(err, syscall.ECONNREFUSED) {
				// The guest answered: the sandbox runs, its port is closed. (r is the request as
				// sent: its URL names the guest's port.)
				writePortClosed(w, id, port)
				return
			}
			s.log.Warn("sandbox proxy error", "sandbox_id", id, "err", err)
			writeNotRunning(w, id)
		},
	}
}

type proxySandboxKey struct{}

// stripCredentials removes the caller's ember/E2B credentials from a request bound for a
// sandbox: the code inside must never learn the API key (or access token) that controls every
// sandbox of its owner. Authorization stays when it is anything else (envd's Basic user, an
// app's own bearer token).
func stripCredentials(h http.Header) {
	h.Del("X-API-Key")
	h.Del(sandbox.TrafficAccessTokenHeader)
	if v := h.Values("Authorization"); len(v) > 0 {
		h.Del("Authorization")
		for _, a := range v {
			// As permissive as authenticate: any case of the scheme, any blanks around the key.
			if len(a) >= 7 && strings.EqualFold(a[:7], "bearer ") {
				tok := strings.ToLower(strings.TrimSpace(a[7:]))
				if strings.HasPrefix(tok, "e2b_") || strings.HasPrefix(tok, "sk_e2b_") {
					continue
				}
			}
			h.Add("Authorization", a)
		}
	}
}

// serveSandbox proxies r to port of sandbox id. Anything that stops the request reaching a
// running sandbox answers 502.
func (s *server) serveSandbox(w http.ResponseWriter, r *http.Request, id string, port int) {
	if !validSandboxID(id) {
		writeNotRunning(w, id)
		return
	}
	// The traffic token before GuestURL, which may resume the sandbox: no token, no wake.
	ctx, ok := s.guestAccess(r.Context(), w, r, id, port) // traffic token, Host mask
	if !ok {
		return
	}
	if port == envdclient.Port {
		ctx = sandbox.WithEnvdToken(ctx, r.Header.Get("X-Access-Token"))
	}
	base, err := s.svc.GuestURL(ctx, id, port)
	if err != nil {
		if statusOf(err) == http.StatusInternalServerError {
			s.log.Warn("guest url", "sandbox_id", id, "port", port, "err", err)
		}
		writeNotRunningTo(w, r, id, err)
		return
	}
	target, err := url.Parse(base)
	if err != nil || target.Host == "" {
		s.log.Error("bad guest url", "sandbox_id", id, "url", base, "err", err)
		writeNotRunning(w, id)
		return
	}
	ctx = context.WithValue(ctx, proxyTargetKey{}, target)
	ctx = context.WithValue(ctx, proxySandboxKey{}, id)
	// Connect streams answer while the request body may still be arriving. Without full duplex
	// the HTTP/1 server drains the request body when the response starts, racing the proxy that
	// is still forwarding it: the upstream write fails and the stream is cut mid-way.
	if err := http.NewResponseController(w).EnableFullDuplex(); err != nil && !errors.Is(err, http.ErrNotSupported) {
		s.log.Debug("full duplex", "err", err)
	}
	s.proxy.ServeHTTP(w, r.WithContext(ctx))
}

// serveSignedFiles routes an uploadUrl()/downloadUrl() request, which carries no headers, to
// the sandbox whose access token produced its signature.
func (s *server) serveSignedFiles(w http.ResponseWriter, r *http.Request, sig string) {
	q := r.URL.Query()
	op := auth.OperationForMethod(r.Method)
	if op == "" {
		w.Header().Set("Allow", "GET, POST")
		writeJSONError(w, http.StatusMethodNotAllowed, "method "+r.Method+" not allowed on /files")
		return
	}
	exp, err := auth.ParseSignatureExpiration(q.Get("signature_expiration"))
	if err != nil {
		writeError(w, s.log, r, err)
		return
	}
	path, user := q.Get("path"), q.Get("username")
	if sbx, err := s.signedSandbox(r.Context(), signedQuery{Path: path, Operation: op, User: user, Exp: exp, Signature: sig}); err != nil {
		writeError(w, s.log, r, err)
		return
	} else if sbx != nil {
		if err := auth.VerifyFileSignature(sig, path, op, user, sbx.AccessToken, exp); err != nil {
			writeJSONError(w, http.StatusUnauthorized, "signature is already expired") // E2B envd's words
			return
		}
		if sbx.State != sandbox.StateRunning {
			writeNotRunning(w, sbx.ID)
			return
		}
		s.serveSandbox(w, r, sbx.ID, envdclient.Port)
		return
	}
	// In a cluster, the sandbox may be another node's (internal/cluster/edge).
	if s.edge != nil && s.edge.ServeSigned(w, r, signedQuery{Path: path, Operation: op, User: user, Exp: exp, Signature: sig}) {
		return
	}
	writeError(w, s.log, r, &httpError{status: http.StatusUnauthorized, msg: "invalid signature"})
}

// validSandboxID: ember's sandbox ids are [a-z0-9]+ (no '-', so hosts stay unambiguous).
func validSandboxID(id string) bool {
	if id == "" || len(id) > 64 {
		return false
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9') {
			return false
		}
	}
	return true
}
