package tlsca

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"github.com/ember-sandbox/ember/internal/testutil"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

var t0 = time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)

func clock(t *time.Time) func() time.Time { return func() time.Time { return *t } }

func opts(dir string, now *time.Time) Options {
	return Options{Dir: dir, Domain: "ember.test", IPs: []net.IP{net.ParseIP("127.0.0.1")}, Now: clock(now)}
}

func mustLocal(t *testing.T, o Options) (*Local, Changes) {
	t.Helper()
	l, ch, err := NewLocal(o)
	if err != nil {
		t.Fatalf("NewLocal: %v", err)
	}
	return l, ch
}

func caPool(t *testing.T, dir string) *x509.CertPool {
	t.Helper()
	pem, err := os.ReadFile(filepath.Join(dir, CAFile))
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		t.Fatal("ca.pem holds no certificate")
	}
	return pool
}

func leafOf(t *testing.T, l *Local) *x509.Certificate {
	t.Helper()
	c, err := l.GetCertificate(nil)
	if err != nil {
		t.Fatalf("GetCertificate: %v", err)
	}
	return c.Leaf
}

func verify(leaf *x509.Certificate, pool *x509.CertPool, name string, at time.Time) error {
	_, err := leaf.Verify(x509.VerifyOptions{DNSName: name, Roots: pool, CurrentTime: at})
	return err
}

func TestNewLocalIssuesVerifiableLeaf(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "tls")
	now := t0
	l, ch := mustLocal(t, opts(dir, &now))
	if !ch.NewCA || !ch.NewLeaf {
		t.Fatalf("first start: changes %+v, want a new CA and leaf", ch)
	}
	if l.CAPath() != filepath.Join(dir, CAFile) {
		t.Fatalf("CAPath %q", l.CAPath())
	}
	for name, want := range map[string]os.FileMode{"": 0o700, CAKeyFile: 0o600, KeyFile: 0o600, CAFile: 0o644, CertFile: 0o644} {
		st, err := os.Stat(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		if got := st.Mode().Perm(); got != want {
			t.Errorf("%s: mode %o, want %o", filepath.Join(dir, name), got, want)
		}
	}
	pool := caPool(t, dir)
	leaf := leafOf(t, l)
	for _, name := range []string{"49983-abc123.ember.test", "8080-abc123.ember.test", "api.ember.test", "ember.test", "127.0.0.1"} {
		if err := verify(leaf, pool, name, now); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
	for _, name := range []string{"a.b.ember.test", "example.com", "ember.test.evil", "127.0.0.2"} {
		if err := verify(leaf, pool, name, now); err == nil {
			t.Errorf("%s: verified, want a hostname error", name)
		}
	}
	if leaf.PublicKeyAlgorithm != x509.ECDSA {
		t.Errorf("leaf key %v, want ECDSA", leaf.PublicKeyAlgorithm)
	}
	if got := leaf.NotAfter.Sub(now); got < LeafValidity-time.Minute || got > LeafValidity {
		t.Errorf("leaf lifetime %v, want %v", got, LeafValidity)
	}
}

// The CA is name-constrained: a certificate it signs for another name does not verify, so
// trusting ca.pem trusts nothing outside the sandbox domain.
func TestCAIsNameConstrained(t *testing.T) {
	dir := t.TempDir()
	now := t0
	mustLocal(t, opts(dir, &now))
	ca, caKey, err := loadPair(filepath.Join(dir, CAFile), filepath.Join(dir, CAKeyFile))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		dns  []string
		ips  []net.IP
		host string
	}{
		{"other domain", []string{"bank.example.com"}, nil, "bank.example.com"},
		{"suffix trick", []string{"xember.test"}, nil, "xember.test"},
		{"other ip", nil, []net.IP{net.ParseIP("10.0.0.1")}, "10.0.0.1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
			tmpl := &x509.Certificate{SerialNumber: bigOne(), Subject: pkix.Name{CommonName: "forged"},
				NotBefore: now.Add(-time.Hour), NotAfter: now.Add(time.Hour), DNSNames: tc.dns, IPAddresses: tc.ips,
				ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
			forged, _, err := sign(tmpl, ca, key, caKey)
			if err != nil {
				t.Fatal(err)
			}
			err = verify(forged, caPool(t, dir), tc.host, now)
			var inv x509.CertificateInvalidError
			if !errors.As(err, &inv) || inv.Reason != x509.CANotAuthorizedForThisName {
				t.Fatalf("forged %v: err %v, want CANotAuthorizedForThisName", tc.dns, err)
			}
		})
	}
}

func TestReuseAndRegeneration(t *testing.T) {
	type step struct {
		name            string
		edit            func(o *Options, now *time.Time, dir string)
		newCA, newLeaf  bool
		sameCA, sameKey bool
	}
	for _, tc := range []step{
		{name: "same config reuses both", edit: func(*Options, *time.Time, string) {}, sameCA: true, sameKey: true},
		{name: "port in domain is ignored", edit: func(o *Options, _ *time.Time, _ string) { o.Domain = "Ember.Test:8443" }, sameCA: true, sameKey: true},
		{name: "domain change", edit: func(o *Options, _ *time.Time, _ string) { o.Domain = "sbx.example.com" }, newCA: true, newLeaf: true},
		{name: "listen ip change", edit: func(o *Options, _ *time.Time, _ string) { o.IPs = []net.IP{net.ParseIP("::1")} }, newCA: true, newLeaf: true},
		{name: "leaf near expiry", edit: func(_ *Options, now *time.Time, _ string) {
			*now = now.Add(LeafValidity - LeafRenewBefore + time.Hour)
		}, newLeaf: true, sameCA: true},
		{name: "leaf expired", edit: func(_ *Options, now *time.Time, _ string) { *now = now.Add(LeafValidity + time.Hour) }, newLeaf: true, sameCA: true},
		{name: "ca near expiry", edit: func(_ *Options, now *time.Time, _ string) {
			*now = now.Add(CAValidity - CARenewBefore + time.Hour)
		}, newCA: true, newLeaf: true},
		{name: "corrupt leaf", edit: func(_ *Options, _ *time.Time, dir string) {
			os.WriteFile(filepath.Join(dir, CertFile), []byte("garbage"), 0o644)
		}, newLeaf: true, sameCA: true},
		{name: "leaf key lost", edit: func(_ *Options, _ *time.Time, dir string) { os.Remove(filepath.Join(dir, KeyFile)) }, newLeaf: true, sameCA: true},
		{name: "ca key lost", edit: func(_ *Options, _ *time.Time, dir string) { os.Remove(filepath.Join(dir, CAKeyFile)) }, newCA: true, newLeaf: true},
		{name: "leaf from another ca", edit: func(_ *Options, now *time.Time, dir string) {
			other := t0
			mustLocal(t, opts(filepath.Join(dir, "other"), &other))
			for _, f := range []string{CertFile, KeyFile} {
				b, _ := os.ReadFile(filepath.Join(dir, "other", f))
				os.WriteFile(filepath.Join(dir, f), b, 0o600)
			}
		}, newLeaf: true, sameCA: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			now := t0
			o := opts(dir, &now)
			first, _ := mustLocal(t, o)
			firstLeaf := leafOf(t, first)
			caBefore, _ := os.ReadFile(filepath.Join(dir, CAFile))
			tc.edit(&o, &now, dir)
			second, ch := mustLocal(t, o)
			if ch.NewCA != tc.newCA || ch.NewLeaf != tc.newLeaf {
				t.Fatalf("changes %+v, want NewCA=%v NewLeaf=%v", ch, tc.newCA, tc.newLeaf)
			}
			caAfter, _ := os.ReadFile(filepath.Join(dir, CAFile))
			if bytes.Equal(caBefore, caAfter) != tc.sameCA {
				t.Errorf("ca.pem unchanged=%v, want %v", !tc.newCA, tc.sameCA)
			}
			leaf := leafOf(t, second)
			if bytes.Equal(leaf.Raw, firstLeaf.Raw) != tc.sameKey {
				t.Errorf("leaf reused=%v, want %v", bytes.Equal(leaf.Raw, firstLeaf.Raw), tc.sameKey)
			}
			host, _ := HostOf(o.Domain)
			if err := verify(leaf, caPool(t, dir), "49983-x."+host, now); err != nil {
				t.Errorf("leaf after %s does not verify against ca.pem: %v", tc.name, err)
			}
		})
	}
}

// A running server renews its leaf before expiry without a restart.
func TestGetCertificateRenewsInPlace(t *testing.T) {
	dir := t.TempDir()
	now := t0
	l, _ := mustLocal(t, opts(dir, &now))
	first := leafOf(t, l)
	caBefore, _ := os.ReadFile(filepath.Join(dir, CAFile))
	now = now.Add(LeafValidity - LeafRenewBefore - time.Hour)
	if got := leafOf(t, l); !bytes.Equal(got.Raw, first.Raw) {
		t.Fatal("renewed while more than LeafRenewBefore was left")
	}
	now = now.Add(2 * time.Hour)
	renewed := leafOf(t, l)
	if bytes.Equal(renewed.Raw, first.Raw) {
		t.Fatal("not renewed inside LeafRenewBefore")
	}
	if !renewed.NotAfter.After(first.NotAfter) {
		t.Errorf("renewed NotAfter %v not after %v", renewed.NotAfter, first.NotAfter)
	}
	if err := verify(renewed, caPool(t, dir), "api.ember.test", now); err != nil {
		t.Fatal(err)
	}
	if after, _ := os.ReadFile(filepath.Join(dir, CAFile)); !bytes.Equal(after, caBefore) {
		t.Error("a leaf renewal replaced the CA")
	}
	onDisk, _, err := loadPair(filepath.Join(dir, CertFile), filepath.Join(dir, KeyFile))
	if err != nil || !bytes.Equal(onDisk.Raw, renewed.Raw) {
		t.Fatalf("cert.pem not the renewed leaf (err %v)", err)
	}
}

func TestInvalidOptions(t *testing.T) {
	for _, d := range []string{"", "127.0.0.1", "-bad.test", "a..b", "under_score.test", "*.ember.test", "ember.test:8443:1"} {
		_, _, err := NewLocal(Options{Dir: t.TempDir(), Domain: d})
		if !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("domain %q: err %v, want ErrInvalid", d, err)
		}
	}
	if _, _, err := NewLocal(Options{Domain: "ember.test"}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("empty dir: err %v, want ErrInvalid", err)
	}
}

func TestListenIPs(t *testing.T) {
	for addr, want := range map[string]string{
		":443":           "[127.0.0.1 ::1]",
		"0.0.0.0:8443":   "[127.0.0.1 ::1]",
		"[::]:8443":      "[127.0.0.1 ::1]",
		"127.0.0.1:8443": "[127.0.0.1]",
		"[::1]:443":      "[::1]",
		"localhost:443":  "[]",
	} {
		if got := fmtIPs(ListenIPs(addr)); got != want {
			t.Errorf("ListenIPs(%q) = %s, want %s", addr, got, want)
		}
	}
}

func fmtIPs(ips []net.IP) string {
	s := "["
	for i, ip := range ips {
		if i > 0 {
			s += " "
		}
		s += ip.String()
	}
	return s + "]"
}

// writeOperatorPair writes a self-signed pair for names, as an operator's certificate.
func writeOperatorPair(t *testing.T, dir string, names ...string) {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: bigOne(), Subject: pkix.Name{CommonName: names[0]}, DNSNames: names,
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	cert, _, err := sign(tmpl, tmpl, key, key)
	if err != nil {
		t.Fatal(err)
	}
	if err := writePair(dir, "op.pem", "op-key.pem", cert, key, 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestFilesReloadOnChange(t *testing.T) {
	dir := t.TempDir()
	writeOperatorPair(t, dir, "*.one.test")
	f, err := LoadFiles(filepath.Join(dir, "op.pem"), filepath.Join(dir, "op-key.pem"))
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	f.now = clock(&now)
	if !Covers(f.Leaf(), "one.test:443") || Covers(f.Leaf(), "two.test") {
		t.Fatal("Covers is wrong for *.one.test")
	}
	writeOperatorPair(t, dir, "*.two.test")
	os.Chtimes(filepath.Join(dir, "op.pem"), now, now.Add(time.Second)) // a distinct mtime even on coarse clocks
	get := func() *x509.Certificate {
		c, err := f.GetCertificate(nil)
		if err != nil {
			t.Fatal(err)
		}
		return c.Leaf
	}
	if got := get(); got.DNSNames[0] != "*.one.test" {
		t.Fatalf("reloaded before reloadCheck passed: %v", got.DNSNames)
	}
	now = now.Add(reloadCheck + time.Second)
	if got := get(); got.DNSNames[0] != "*.two.test" {
		t.Fatalf("not reloaded after a change: %v", got.DNSNames)
	}
	// A broken replacement keeps the last good pair in service.
	os.WriteFile(filepath.Join(dir, "op-key.pem"), []byte("not a key"), 0o600)
	now = now.Add(reloadCheck + time.Second)
	if got := get(); got.DNSNames[0] != "*.two.test" {
		t.Fatalf("broken reload replaced the pair: %v", got.DNSNames)
	}
	if f.ReloadError() == nil {
		t.Error("ReloadError is nil after a failed reload")
	}
	if _, err := LoadFiles(filepath.Join(dir, "op.pem"), filepath.Join(dir, "op-key.pem")); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("LoadFiles of a broken pair: %v, want ErrInvalid", err)
	}
	if _, err := LoadFiles(filepath.Join(dir, "op.pem"), ""); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("LoadFiles without a key: %v, want ErrInvalid", err)
	}
}

// End to end on loopback: an HTTPS server with ServerConfig, a client trusting only ca.pem
// and resolving every name to 127.0.0.1, as the SDK would reach <port>-<id>.<domain>.
func TestServeHTTPSWithLocalCA(t *testing.T) {
	dir := t.TempDir()
	l, _, err := NewLocal(Options{Dir: dir, Domain: "ember.test", IPs: ListenIPs("127.0.0.1:0")})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	testutil.Need(t, err == nil, fmt.Sprintf("no loopback listener: %v", err))
	srv := &http.Server{
		TLSConfig: ServerConfig(l),
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			io.WriteString(w, r.Proto+" "+r.Host)
		}),
	}
	srv.Protocols = new(http.Protocols)
	srv.Protocols.SetHTTP1(true)
	srv.Protocols.SetHTTP2(true)
	go srv.ServeTLS(ln, "", "")
	t.Cleanup(func() { srv.Close() })
	port := ln.Addr().(*net.TCPAddr).Port

	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		TLSClientConfig:   &tls.Config{RootCAs: caPool(t, dir)},
		ForceAttemptHTTP2: true,
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			_, p, _ := net.SplitHostPort(addr)
			return (&net.Dialer{}).DialContext(ctx, network, net.JoinHostPort("127.0.0.1", p))
		},
	}}
	for _, host := range []string{"8080-abc123.ember.test", "api.ember.test", "127.0.0.1"} {
		resp, err := client.Get("https://" + net.JoinHostPort(host, itoa(port)) + "/")
		if err != nil {
			t.Fatalf("%s: %v", host, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if want := "HTTP/2.0 " + net.JoinHostPort(host, itoa(port)); string(body) != want {
			t.Errorf("%s: got %q, want %q", host, body, want)
		}
	}
	// Without the CA the client refuses the server.
	plain := &http.Client{Timeout: 10 * time.Second}
	if _, err := plain.Get("https://127.0.0.1:" + itoa(port) + "/"); err == nil {
		t.Error("a client without ca.pem accepted the certificate")
	}
}

func bigOne() *big.Int { return big.NewInt(1) }

func itoa(i int) string { return strconv.Itoa(i) }
