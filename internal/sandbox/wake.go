package sandbox

import (
	"context"
	"crypto/subtle"
)

// No token, no wake. Traffic resumes a paused sandbox created with autoResume (GuestURL) only
// once the request passed what a running sandbox would check: the API checks the traffic
// token of a guest port before it asks for the URL, and marks a request to envd's port with the
// access token it presents (WithEnvdToken), which must be the sandbox's own when it has one.

type envdTokenKey struct{}

// WithEnvdToken returns ctx marked as a request to envd's port presenting tok (its
// X-Access-Token, or the token a signed URL's signature proved).
func WithEnvdToken(ctx context.Context, tok string) context.Context {
	return context.WithValue(ctx, envdTokenKey{}, tok)
}

// mayWake reports whether the request of ctx may resume sb.
func mayWake(ctx context.Context, sb *Sandbox) bool {
	tok, ok := ctx.Value(envdTokenKey{}).(string)
	if !ok || sb.AccessToken == "" {
		return true
	}
	return subtle.ConstantTimeCompare([]byte(tok), []byte(sb.AccessToken)) == 1
}
