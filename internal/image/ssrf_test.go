package image

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// counting wraps a handler and counts the requests it served.
func counting(h http.Handler) (http.Handler, *atomic.Int64) {
	var n atomic.Int64
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { n.Add(1); h.ServeHTTP(w, r) }), &n
}

// A pull never reaches a loopback, private, link-local or metadata address (the daemon's own
// network, past every sandbox egress rule) unless the operator allows that registry — by the
// address the caller names, by a name that resolves there, or by a redirect there.
func TestPullRefusesPrivateAddressesUnlessAllowed(t *testing.T) {
	img := testImage(t, v1.Config{}, layerOf(t, file("x", "y")))
	host := localRegistry(t, map[string]v1.Image{"team/app:v1": img})
	ctx := context.Background()
	_, port, _ := net.SplitHostPort(host)

	for _, ref := range []string{host + "/team/app:v1", "localhost:" + port + "/team/app:v1", "[::ffff:127.0.0.1]:" + port + "/team/app:v1"} {
		_, err := (&Resolver{}).Pull(ctx, ref, true, nil)
		if !errors.Is(err, errdefs.ErrInvalid) || !strings.Contains(err.Error(), "--registry-allow") {
			t.Errorf("pull %s with no allowance: %v; want ErrInvalid naming --registry-allow", ref, err)
		}
	}
	// Only loopback is pulled from here (a test never reaches outside); the other addresses
	// are checked by the dialer's own check.
	for _, a := range []string{"169.254.169.254", "10.1.2.3", "172.16.0.1", "192.168.0.1", "fd00:ec2::254", "fe80::1", "0.0.0.0", "::", "100.100.100.200", "::ffff:10.0.0.1", "127.0.0.53", "::1", "224.0.0.1"} {
		if err := publicAddr(netip.MustParseAddr(a)); err == nil {
			t.Errorf("%s counts as a public address", a)
		}
	}
	for _, a := range []string{"93.184.215.14", "2606:2800:21f:cb07:6820:80da:af6b:8b2c", "8.8.8.8"} {
		if err := publicAddr(netip.MustParseAddr(a)); err != nil {
			t.Errorf("%s: %v", a, err)
		}
	}
	if _, err := (&Resolver{Allow: []string{host}}).Pull(ctx, host+"/team/app:v1", true, nil); err != nil {
		t.Fatalf("pull from an allowed registry: %v", err)
	}
	if _, err := (&Resolver{Allow: []string{"localhost:" + port}}).Pull(ctx, "localhost:"+port+"/team/app:v1", true, nil); err != nil {
		t.Fatalf("pull from an allowed registry by name: %v", err)
	}

	// An allowed registry that redirects to one that is not: the redirect is refused.
	other, hits := counting(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, "http://"+host+r.URL.Path, http.StatusTemporaryRedirect)
	}))
	srv := httptest.NewServer(other)
	t.Cleanup(srv.Close)
	front := strings.TrimPrefix(srv.URL, "http://")
	_, err := (&Resolver{Allow: []string{front}}).Pull(ctx, front+"/team/app:v1", true, nil)
	if !errors.Is(err, errdefs.ErrInvalid) || hits.Load() == 0 {
		t.Fatalf("redirect to a registry not allowed: %v (front served %d)", err, hits.Load())
	}
}

// A registry's error body is not echoed into the build status (a port scanner's oracle): the
// status code and the registry are.
func TestPullErrorDoesNotEchoTheBody(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusTeapot)
		fmt.Fprint(w, "SSH-2.0-OpenSSH_9.6 internal-service-banner")
	}))
	t.Cleanup(srv.Close)
	host := strings.TrimPrefix(srv.URL, "http://")
	_, err := (&Resolver{Allow: []string{host}}).Pull(context.Background(), host+"/a/b:v1", true, nil)
	if err == nil || strings.Contains(err.Error(), "OpenSSH") || strings.Contains(err.Error(), "banner") {
		t.Fatalf("error echoes the body: %v", err)
	}
	if !strings.Contains(err.Error(), "418") || !strings.Contains(err.Error(), host) {
		t.Fatalf("error does not say the status and the registry: %v", err)
	}
}

// The operator's credentials (docker config) for a registry go to that registry only: not to
// a token realm on another host its challenge names.
func TestOperatorCredentialsStayWithTheirRegistry(t *testing.T) {
	var leaked atomic.Value
	realm := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if u, p, ok := r.BasicAuth(); ok {
			leaked.Store(u + ":" + p)
		}
		if r.ParseForm() == nil && r.PostForm.Get("password") != "" {
			leaked.Store("form: " + r.PostForm.Get("username") + ":" + r.PostForm.Get("password"))
		}
		w.WriteHeader(http.StatusUnauthorized)
	}))
	t.Cleanup(realm.Close)
	reg := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("WWW-Authenticate", fmt.Sprintf(`Bearer realm=%q,service="x"`, strings.Replace(realm.URL, "127.0.0.1", "localhost", 1)+"/token"))
		w.WriteHeader(http.StatusUnauthorized)
	}))
	t.Cleanup(reg.Close)
	host := strings.TrimPrefix(reg.URL, "http://")
	t.Setenv("DOCKER_CONFIG", t.TempDir())
	cfg := fmt.Sprintf(`{"auths":{%q:{"auth":%q}}}`, host, base64.StdEncoding.EncodeToString([]byte("alice:s3cret")))
	os.WriteFile(filepath.Join(os.Getenv("DOCKER_CONFIG"), "config.json"), []byte(cfg), 0o600)
	r := &Resolver{Allow: []string{host, strings.Replace(strings.TrimPrefix(realm.URL, "http://"), "127.0.0.1", "localhost", 1)}}
	if _, err := r.Pull(context.Background(), host+"/team/private:v1", true, nil); err == nil {
		t.Fatal("pull succeeded")
	} else {
		t.Log(err)
	}
	if v := leaked.Load(); v != nil {
		t.Fatalf("the operator's credentials for %s reached the realm on another host: %v", host, v)
	}
}
