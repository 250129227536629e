package daemon

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"io"
	"log/slog"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/datadir"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/layerfs"
	"github.com/ember-sandbox/ember/internal/testutil"
)

func hello(name string) *tls.ClientHelloInfo { return &tls.ClientHelloInfo{ServerName: name} }

func TestSandboxTLSLocalCA(t *testing.T) {
	data := t.TempDir()
	var out bytes.Buffer
	cfg := Config{DataDir: data, Domain: "ember.test:8443", Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Out: &out}
	conf, err := sandboxTLS(cfg, "127.0.0.1:8443")
	if err != nil {
		t.Fatal(err)
	}
	caPath := filepath.Join(data, "tls", "ca.pem")
	if !strings.Contains(out.String(), "NODE_EXTRA_CA_CERTS="+caPath) || !strings.Contains(out.String(), "Created a local CA for *.ember.test") {
		t.Errorf("start-up lines lack the CA path or the new-CA notice:\n%s", out.String())
	}
	cert, err := conf.GetCertificate(hello("49983-abc.ember.test"))
	if err != nil {
		t.Fatal(err)
	}
	pemBytes, _ := os.ReadFile(caPath)
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(pemBytes)
	for _, name := range []string{"49983-abc.ember.test", "api.ember.test", "127.0.0.1"} {
		if _, err := cert.Leaf.Verify(x509.VerifyOptions{DNSName: name, Roots: pool}); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
	// A restart reuses the CA: no new-CA notice, the same ca.pem.
	out.Reset()
	if _, err := sandboxTLS(cfg, "127.0.0.1:8443"); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(out.String(), "Created a local CA") {
		t.Errorf("restart made a new CA:\n%s", out.String())
	}
	if again, _ := os.ReadFile(caPath); !bytes.Equal(again, pemBytes) {
		t.Error("ca.pem changed across a restart")
	}
}

func TestSandboxTLSOperatorFiles(t *testing.T) {
	dir := t.TempDir()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(7), Subject: pkix.Name{CommonName: "op"}, DNSNames: []string{"*.sbx.example.com"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		t.Fatal(err)
	}
	kder, _ := x509.MarshalPKCS8PrivateKey(key)
	certPath, keyPath := filepath.Join(dir, "c.pem"), filepath.Join(dir, "k.pem")
	os.WriteFile(certPath, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644)
	os.WriteFile(keyPath, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kder}), 0o600)

	var logs bytes.Buffer
	cfg := Config{DataDir: filepath.Join(dir, "data"), Domain: "sbx.example.com", TLSCert: certPath, TLSKey: keyPath,
		Logger: slog.New(slog.NewTextHandler(&logs, nil)), Out: io.Discard}
	conf, err := sandboxTLS(cfg, "0.0.0.0:443")
	if err != nil {
		t.Fatal(err)
	}
	cert, err := conf.GetCertificate(hello("8080-abc.sbx.example.com"))
	if err != nil || !bytes.Equal(cert.Certificate[0], der) {
		t.Fatalf("served certificate is not the operator's (err %v)", err)
	}
	if _, err := os.Stat(datadir.TLS(cfg.DataDir)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("an operator certificate still made a local CA dir (stat: %v)", err)
	}
	if logs.Len() != 0 {
		t.Errorf("unexpected warnings: %s", logs.String())
	}

	// A certificate for other names is served but warned about.
	cfg.Domain = "other.test"
	if _, err := sandboxTLS(cfg, "0.0.0.0:443"); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(logs.String(), "does not cover") {
		t.Errorf("no warning for a certificate not covering *.other.test: %q", logs.String())
	}

	cfg.TLSKey = ""
	if _, err := sandboxTLS(cfg, "0.0.0.0:443"); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("cert without key: %v, want ErrInvalid", err)
	}
}

// No node's interface names can be taken for another's: node "c1" slot 15 and node "c11" slot
// 5 once both named their veth "ec115h".
func TestNodeNamesNeverOverlap(t *testing.T) {
	ids := []string{"", "c1", "c11", "c115", "a", "ab", "n2"}
	prefixes := map[string]string{}
	for _, id := range ids {
		n, err := NodeNames(id)
		if err != nil {
			t.Fatalf("%q: %v", id, err)
		}
		prefixes[id] = n.NetPrefix
	}
	for a, pa := range prefixes {
		for b, pb := range prefixes {
			if a != b && strings.HasPrefix(pb, pa) {
				t.Fatalf("node %q's prefix %q is a prefix of node %q's %q", a, pa, b, pb)
			}
		}
	}
	for _, bad := range []string{"x1", "cx", "mb1", "1a", "abcdefg", "A"} {
		if _, err := NodeNames(bad); err == nil {
			t.Fatalf("node id %q accepted", bad)
		}
	}
}

// Mode B (--tls-listen) on a new data directory gets the layer filesystem layerfs chooses for
// an empty one (a btrfs image on ext4, for O(1) captures): the local CA, the first thing the
// start writes there, comes after that choice. It once came before it, and the start found
// the data directory holding "tls from an earlier ember" and fell back to copying captures.
func TestServeTLSOnANewDataDirGetsTheFavouredLayerFS(t *testing.T) {
	testutil.RequireRoot(t)
	root := t.TempDir()
	// What layerfs chooses for an empty directory here.
	empty := filepath.Join(root, "empty")
	if err := os.Mkdir(empty, 0o700); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = layerfs.Unmount(empty, 10*time.Second) })
	want, err := layerfs.Setup(layerfs.Config{DataDir: empty, Size: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}

	data := filepath.Join(root, "data")
	t.Cleanup(func() { _ = layerfs.Unmount(data, 10*time.Second) })
	var out bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// An invalid node id ends the start once the data directory, its CA and its store are
	// made: the rest of a node is not this test's.
	err = Serve(ctx, Config{DataDir: data, Listen: "127.0.0.1:0", TLSListen: "127.0.0.1:0", LayerFSSize: 1 << 30, NodeID: "X",
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Out: &out})
	if !errors.Is(err, errdefs.ErrInvalid) || !strings.Contains(err.Error(), "node_id") {
		t.Fatalf("start with node id X: %v, want the node id refused\n%s", err, out.String())
	}
	if _, err := os.Stat(filepath.Join(data, "tls", "ca.pem")); err != nil {
		t.Fatalf("no local CA: %v\n%s", err, out.String())
	}
	// The layer filesystem the start left over the data directory, as the next start finds it.
	got, err := layerfs.Setup(layerfs.Config{DataDir: data, Size: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	if got.FS != want.FS || (want.FS != "btrfs" && got.Action != want.Action) || strings.Contains(out.String(), "already holds") {
		t.Fatalf("Mode B on a new data directory: %s\n(an empty directory here gets: %s)\nstart's output:\n%s", got, want, out.String())
	}
	t.Logf("%s", got)
}
