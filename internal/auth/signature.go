package auth

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// File operations a signature can grant (E2B: GET /files = read, POST /files = write).
const (
	OpRead  = "read"
	OpWrite = "write"
)

// SignaturePrefix starts every file signature.
const SignaturePrefix = "v1_"

// FileSignature computes the signature E2B SDKs put in uploadUrl()/downloadUrl():
//
//	raw = path:operation:user:token[:expiration]   (expiration only when non-zero)
//	sig = "v1_" + base64std(sha256(raw)) without "=" padding
//
// path is the decoded `path` query value, user the `username` query value ("" when absent) and
// expiration the `signature_expiration` unix seconds (0 = never expires).
func FileSignature(path, operation, user, token string, expiration int64) string {
	raw := path + ":" + operation + ":" + user + ":" + token
	if expiration != 0 {
		raw += ":" + strconv.FormatInt(expiration, 10)
	}
	sum := sha256.Sum256([]byte(raw))
	return SignaturePrefix + base64.RawStdEncoding.EncodeToString(sum[:])
}

// VerifyFileSignature checks a signature against the access token and, when expiration is
// non-zero, that it has not passed. It returns an error wrapping errdefs.ErrUnauthorized.
func VerifyFileSignature(signature, path, operation, user, token string, expiration int64) error {
	return verifyFileSignatureAt(time.Now(), signature, path, operation, user, token, expiration)
}

func verifyFileSignatureAt(now time.Time, signature, path, operation, user, token string, expiration int64) error {
	if token == "" || !strings.HasPrefix(signature, SignaturePrefix) {
		return fmt.Errorf("invalid signature: %w", errdefs.ErrUnauthorized)
	}
	want := FileSignature(path, operation, user, token, expiration)
	if subtle.ConstantTimeCompare([]byte(signature), []byte(want)) != 1 {
		return fmt.Errorf("invalid signature: %w", errdefs.ErrUnauthorized)
	}
	if expiration != 0 && now.Unix() > expiration {
		return fmt.Errorf("signature expired: %w", errdefs.ErrUnauthorized)
	}
	return nil
}

// ParseSignatureExpiration parses a `signature_expiration` query value ("" = 0, no expiry).
func ParseSignatureExpiration(v string) (int64, error) {
	if v == "" {
		return 0, nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("signature_expiration %q: %w", v, errdefs.ErrInvalid)
	}
	return n, nil
}

// OperationForMethod maps the /files HTTP method to its signature operation ("" if neither).
func OperationForMethod(method string) string {
	switch method {
	case "GET", "HEAD":
		return OpRead
	case "POST":
		return OpWrite
	}
	return ""
}
