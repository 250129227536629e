package api

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/sandbox"
)

// serveBoth runs the edge of e on a listener that serves TLS and plain HTTP, and returns its
// address.
func serveBoth(t *testing.T, e *env, cfg *tls.Config) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: New(Config{Domain: testDomain}, e.fake, e.keys, testLogger(t)), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ServeBoth(ln, cfg)) }()
	t.Cleanup(func() { _ = srv.Close() })
	return ln.Addr().String()
}

// clientFor trusts caFile and resolves every name to addr: the test's own resolver, no DNS.
func clientFor(t *testing.T, caFile, addr string) *http.Client {
	t.Helper()
	pool := x509.NewCertPool()
	b, err := os.ReadFile(caFile)
	if err != nil || !pool.AppendCertsFromPEM(b) {
		t.Fatalf("CA %s: %v", caFile, err)
	}
	d := &net.Dialer{Timeout: 3 * time.Second}
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: pool},
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return d.DialContext(ctx, network, addr)
		},
	}}
}

func TestModeBTLS(t *testing.T) {
	e := newEnv(t)
	sb := e.fake.add(sandbox.StateRunning, nil)
	dir := filepath.Join(t.TempDir(), "ca")
	opts := TLSOptions{CADir: dir, Domain: testDomain}
	cfg, err := TLSConfig(opts)
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(filepath.Join(dir, "ca-key.pem")); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("CA key: %v %v", fi, err)
	}
	addr := serveBoth(t, e, cfg)
	c := clientFor(t, opts.CAFile(), addr)

	cases := []struct {
		name, url string
		hdr       map[string]string
		wantHit   string
		status    int
	}{
		{"https host routing to a guest port (getHost)", "https://8080-" + sb.ID + ".ember.test:3000/app", nil, sb.ID + ":8080", 200},
		{"https envd of an old SDK", "https://49983-" + sb.ID + ".ember.test:3000/health", nil, sb.ID + ":49983", 200},
		{"https control plane", "https://api.ember.test:3000/v2/sandboxes", map[string]string{"X-API-Key": e.key}, "", 200},
		{"plain http on the same port (Mode A)", "http://127.0.0.1/v2/sandboxes", map[string]string{"X-API-Key": e.key}, "", 200},
		{"plain http host routing", "http://8080-" + sb.ID + ".ember.test:3000/", nil, sb.ID + ":8080", 200},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := len(e.fake.hits())
			req, _ := http.NewRequest(http.MethodGet, tc.url, nil)
			for k, v := range tc.hdr {
				req.Header.Set(k, v)
			}
			res, err := c.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(res.Body)
			res.Body.Close()
			if res.StatusCode != tc.status {
				t.Fatalf("%d %s", res.StatusCode, body)
			}
			hits := e.fake.hits()[before:]
			if tc.wantHit == "" {
				if len(hits) != 0 {
					t.Fatalf("reached a guest: %v", hits)
				}
				return
			}
			if len(hits) != 1 || hits[0] != tc.wantHit {
				t.Fatalf("guest hits %v, want %s", hits, tc.wantHit)
			}
			var echo guestEcho
			if err := json.Unmarshal(body, &echo); err != nil || echo.Method != http.MethodGet {
				t.Fatalf("guest answer %s: %v", body, err)
			}
		})
	}

	t.Run("the CA is kept: a restart issues from the same CA", func(t *testing.T) {
		before, _ := os.ReadFile(opts.CAFile())
		if _, err := TLSConfig(opts); err != nil {
			t.Fatal(err)
		}
		after, _ := os.ReadFile(opts.CAFile())
		if !bytes.Equal(before, after) {
			t.Fatal("ca.pem changed")
		}
	})

	t.Run("an untrusted client is refused", func(t *testing.T) {
		d := &net.Dialer{}
		plain := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DialContext: func(ctx context.Context, n, _ string) (net.Conn, error) {
			return d.DialContext(ctx, n, addr)
		}}}
		if _, err := plain.Get("https://8080-" + sb.ID + ".ember.test:3000/"); err == nil {
			t.Fatal("a client without the CA connected")
		}
	})
}

func TestTLSOptionsErrors(t *testing.T) {
	dir := t.TempDir()
	cases := []struct {
		name string
		o    TLSOptions
	}{
		{"nothing", TLSOptions{}},
		{"cert without key", TLSOptions{CertFile: filepath.Join(dir, "c.pem")}},
		{"missing files", TLSOptions{CertFile: filepath.Join(dir, "c.pem"), KeyFile: filepath.Join(dir, "k.pem")}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := TLSConfig(tc.o); err == nil {
				t.Fatal("no error")
			}
		})
	}
	t.Run("operator certificate", func(t *testing.T) {
		// A certificate the operator gives: here one issued by a throwaway CA, written as files.
		cfg, err := TLSConfig(TLSOptions{CADir: filepath.Join(dir, "ca"), Domain: "sbx.example.com"})
		if err != nil {
			t.Fatal(err)
		}
		certFile, keyFile := writePair(t, dir, cfg.Certificates[0])
		got, err := TLSConfig(TLSOptions{CertFile: certFile, KeyFile: keyFile})
		if err != nil || len(got.Certificates) != 1 {
			t.Fatalf("%v %v", got, err)
		}
		leaf, err := x509.ParseCertificate(got.Certificates[0].Certificate[0])
		if err != nil || leaf.VerifyHostname("8080-abc.sbx.example.com") != nil {
			t.Fatalf("leaf %v: %v", leaf.DNSNames, err)
		}
	})
}

func writePair(t *testing.T, dir string, c tls.Certificate) (string, string) {
	t.Helper()
	var certPEM bytes.Buffer
	for _, der := range c.Certificate {
		_ = pemEncode(&certPEM, "CERTIFICATE", der)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(c.PrivateKey)
	if err != nil {
		t.Fatal(err)
	}
	var keyPEM bytes.Buffer
	_ = pemEncode(&keyPEM, "PRIVATE KEY", keyDER)
	cf, kf := filepath.Join(dir, "op-cert.pem"), filepath.Join(dir, "op-key.pem")
	if err := os.WriteFile(cf, certPEM.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(kf, keyPEM.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	return cf, kf
}

func pemEncode(w io.Writer, typ string, der []byte) error {
	return pem.Encode(w, &pem.Block{Type: typ, Bytes: der})
}
