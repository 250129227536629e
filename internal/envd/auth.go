package envd

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"
)

const accessTokenHeader = "X-Access-Token"

// errUnauthorized is E2B envd's answer to a request without the right access token.
var errUnauthorized = errors.New("unauthorized access, please provide a valid access token or method signing if supported")

// tokenOK reports whether the request's X-Access-Token matches the access token (or none is set).
func (s *Server) tokenOK(h http.Header) bool {
	want := s.settings().accessToken
	if want == "" {
		return true
	}
	got := h.Get(accessTokenHeader)
	return subtle.ConstantTimeCompare([]byte(got), []byte(want)) == 1
}

// authInterceptor enforces the access token on every Connect RPC.
type authInterceptor struct{ s *Server }

func (a *authInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if !a.s.tokenOK(req.Header()) {
			return nil, connect.NewError(connect.CodeUnauthenticated, errUnauthorized)
		}
		return next(ctx, req)
	}
}

func (a *authInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (a *authInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		if !a.s.tokenOK(conn.RequestHeader()) {
			return connect.NewError(connect.CodeUnauthenticated, errUnauthorized)
		}
		return next(ctx, conn)
	}
}

// httpAuth guards the plain HTTP endpoints: a matching X-Access-Token, or on /files a valid
// signature. Failures answer 401 {"code":401,"message":...} with E2B envd's messages.
func (s *Server) httpAuth(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		token := s.settings().accessToken
		if token == "" || s.tokenOK(r.Header) {
			next.ServeHTTP(w, r)
			return
		}
		if r.URL.Path != "/files" || (r.Method != http.MethodGet && r.Method != http.MethodPost) {
			writeJSONError(w, http.StatusUnauthorized, errUnauthorized.Error())
			return
		}
		if r.Header.Get(accessTokenHeader) != "" {
			writeJSONError(w, http.StatusUnauthorized, "access token present in header but does not match")
			return
		}
		q := r.URL.Query()
		if !q.Has("signature") {
			writeJSONError(w, http.StatusUnauthorized, "missing signature query parameter")
			return
		}
		op := "read"
		if r.Method == http.MethodPost {
			op = "write"
		}
		if err := checkSignature(q.Get("path"), op, q.Get("username"), token, q.Get("signature"), q.Get("signature_expiration"), time.Now()); err != nil {
			var he *httpError
			if errors.As(err, &he) {
				writeJSONError(w, he.status, he.msg)
				return
			}
			writeJSONError(w, http.StatusUnauthorized, err.Error())
			return
		}
		next.ServeHTTP(w, r)
	})
}

// Signature returns the v1 signature the SDKs put on upload/download URLs:
// "v1_" + base64(sha256("path:operation:user:token[:expiration]")) without padding.
// operation is "read" or "write"; expiration is unix seconds, 0 for none.
func Signature(path, operation, user, accessToken string, expiration int64) string {
	raw := path + ":" + operation + ":" + user + ":" + accessToken
	if expiration != 0 {
		raw += ":" + strconv.FormatInt(expiration, 10)
	}
	sum := sha256.Sum256([]byte(raw))
	return "v1_" + strings.TrimRight(base64.StdEncoding.EncodeToString(sum[:]), "=")
}

func checkSignature(path, op, user, token, sig, expiration string, now time.Time) error {
	var exp int64
	if expiration != "" {
		v, err := strconv.ParseInt(expiration, 10, 64)
		if err != nil {
			return httpErrorf(http.StatusBadRequest, "invalid format for parameter signature_expiration: %q is not an integer", expiration)
		}
		exp = v
	}
	want := Signature(path, op, user, token, exp)
	// The signature first: a forger never learns whether the expiry was the problem.
	if subtle.ConstantTimeCompare([]byte(sig), []byte(want)) != 1 {
		return errors.New("invalid signature")
	}
	if expiration != "" && exp < now.Unix() {
		return errors.New("signature is already expired")
	}
	return nil
}

// basicUser returns the user named by "Authorization: Basic base64(user:)", or "".
func basicUser(h http.Header) (string, error) {
	auth := h.Get("Authorization")
	if auth == "" {
		return "", nil
	}
	scheme, val, ok := strings.Cut(auth, " ")
	if !ok || !strings.EqualFold(scheme, "Basic") {
		return "", nil
	}
	raw, err := base64.StdEncoding.DecodeString(strings.TrimSpace(val))
	if err != nil {
		return "", fmt.Errorf("malformed basic authorization: %w", err)
	}
	name, _, _ := strings.Cut(string(raw), ":")
	return name, nil
}
