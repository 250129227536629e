package daemon

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/ember-sandbox/ember/internal/cluster/clustertest"
	"github.com/ember-sandbox/ember/internal/datadir"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/snapshot"
	"github.com/ember-sandbox/ember/internal/snapshot/local"
	"github.com/ember-sandbox/ember/internal/tlsca"
)

// A node joins etcd only when both sides authenticate: etcd's certificate signed by --etcd-ca,
// the node's own accepted by etcd, and the sealing key given. A plain http endpoint, a missing
// or foreign certificate are refused before the node starts, each with an error that says
// what is wrong; --etcd-insecure is the explicit way past the first.
func TestEtcdJoinNeedsAuthentication(t *testing.T) {
	e := clustertest.Start(t, 1)
	good := e.Files()
	other := t.TempDir() // another cluster's CA and certificates
	if _, err := tlsca.MakeCluster(tlsca.ClusterOptions{Dir: other, Nodes: []string{"n1"}}); err != nil {
		t.Fatal(err)
	}
	base := Config{NodeID: "n1", EtcdEndpoints: e.Endpoints(), EtcdCA: good.CA, EtcdCert: good.Cert, EtcdKey: good.Key, ClusterKeyFile: e.KeyFile()}
	plain := strings.Replace(e.Endpoints()[0], "https://", "http://", 1)
	cases := []struct {
		name string
		mod  func(*Config)
		want string
	}{
		{"plain http", func(c *Config) { c.EtcdEndpoints = []string{plain} }, "is plain http"},
		{"no client certificate", func(c *Config) { c.EtcdCert, c.EtcdKey = "", "" }, "needs --etcd-ca"},
		{"no client certificate, insecure", func(c *Config) { c.EtcdCert, c.EtcdKey, c.EtcdInsecure = "", "", true }, "requires a client certificate and this node gave none"},
		{"foreign client certificate", func(c *Config) {
			c.EtcdCert, c.EtcdKey = filepath.Join(other, tlsca.NodeCertFile("n1")), filepath.Join(other, tlsca.NodeKeyFile("n1"))
		}, "refused this node's client certificate"},
		{"foreign CA", func(c *Config) { c.EtcdCA = filepath.Join(other, tlsca.ClusterCAFile) }, "not signed by --etcd-ca"},
		{"no sealing key", func(c *Config) { c.ClusterKeyFile = "" }, "cluster-key-file"},
		{"not a sealing key", func(c *Config) { c.ClusterKeyFile = filepath.Join(e.CertDir(), tlsca.ClusterCAKeyFile) }, "64 hex digits"},
		{"a sealing key others can read", func(c *Config) { c.ClusterKeyFile = good.CA }, "readable by others"},
	}
	for _, tc := range cases {
		cfg := base
		tc.mod(&cfg)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		c, _, err := dialEtcd(ctx, cfg)
		cancel()
		if err == nil {
			c.Close()
			t.Errorf("%s: joined", tc.name)
			continue
		}
		t.Logf("%s: %v", tc.name, err)
		if !errors.Is(err, errdefs.ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want invalid saying %q", tc.name, err, tc.want)
		}
	}

	// The right credentials join.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, seal, err := dialEtcd(ctx, base)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if seal == nil {
		t.Fatal("no sealing key")
	}
	if _, err := c.Put(ctx, "/ember-test/joined", "1"); err != nil {
		t.Fatal(err)
	}

	// And etcd itself refuses a client that skips the checks and has no certificate.
	tc := e.TLS()
	tc.Certificates = nil
	anon, err := clientv3.New(clientv3.Config{Endpoints: e.Endpoints(), DialTimeout: 2 * time.Second, TLS: tc, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	defer anon.Close()
	pctx, pcancel := context.WithTimeout(ctx, 2*time.Second)
	defer pcancel()
	if _, err := anon.Put(pctx, "/ember/nodes/evil", `{"url":"http://evil"}`); err == nil {
		t.Fatal("etcd took a write from a client without a certificate")
	}
}

// The README's one-host cluster with S3 and no --snapshot-key: every node signs and checks
// stored images with the cluster's key (the first node's own key, kept sealed in etcd), so an
// image one node stored loads on every other. Each node with its own <data-dir>/snapshot-key
// answered "manifest signature invalid: corrupt data".
func TestClusterSharesSnapshotKey(t *testing.T) {
	e := clustertest.Start(t, 1)
	f := e.Files()
	cfgA := Config{NodeID: "a", EtcdEndpoints: e.Endpoints(), EtcdCA: f.CA, EtcdCert: f.Cert, EtcdKey: f.Key, ClusterKeyFile: e.KeyFile(), DataDir: t.TempDir()}
	cfgB := cfgA
	cfgB.DataDir = t.TempDir()
	// Node a ran alone before: its key signs what it stored then.
	own, err := snapshot.LoadOrCreateKey(datadir.SnapshotKey(cfgA.DataDir))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	keys := map[string][]byte{}
	for _, n := range []struct {
		name string
		cfg  Config
	}{{"a", cfgA}, {"b", cfgB}} { // a joins first
		c, seal, err := dialEtcd(ctx, n.cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if keys[n.name], err = clusterSnapshotKey(ctx, n.cfg, c, seal); err != nil {
			t.Fatal(err)
		}
	}
	if !bytes.Equal(keys["a"], own) || !bytes.Equal(keys["b"], own) {
		t.Fatalf("keys: a %x, b %x, a's own %x", keys["a"], keys["b"], own)
	}

	// An image stored by a loads on b.
	bucket, err := local.New(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	src := t.TempDir()
	if err := os.WriteFile(filepath.Join(src, "pages"), []byte("memory"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := snapshot.New(bucket, snapshot.WithSigningKey(keys["a"])).Save(ctx, "snap-1", src); err != nil {
		t.Fatal(err)
	}
	if err := snapshot.New(bucket, snapshot.WithSigningKey(keys["b"])).Load(ctx, "snap-1", filepath.Join(t.TempDir(), "out")); err != nil {
		t.Fatalf("b loads a's image: %v", err)
	}

	// The key in etcd is sealed: not there in plain text, nor hex.
	resp, err := e.Client(t).Get(ctx, "/ember/snapshot-key")
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("etcd: %v %v", resp, err)
	}
	v := resp.Kvs[0].Value
	if bytes.Contains(v, own) || bytes.Contains(v, []byte(hex.EncodeToString(own))) {
		t.Fatal("the snapshot key is readable in etcd")
	}
}

// An etcd that takes clients without a certificate is one anyone on its network can write to:
// a node refuses to join it, unless --etcd-insecure.
func TestEtcdWithoutClientAuthRefused(t *testing.T) {
	e := clustertest.StartOpen(t, 1)
	f := e.Files()
	cfg := Config{NodeID: "n1", EtcdEndpoints: e.Endpoints(), EtcdCA: f.CA, EtcdCert: f.Cert, EtcdKey: f.Key, ClusterKeyFile: e.KeyFile()}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if c, _, err := dialEtcd(ctx, cfg); err == nil || !strings.Contains(err.Error(), "accepts clients without a certificate") {
		if c != nil {
			c.Close()
		}
		t.Fatalf("joined an etcd without client certificate auth: %v", err)
	}
	cfg.EtcdInsecure = true
	c, _, err := dialEtcd(ctx, cfg)
	if err != nil {
		t.Fatalf("with --etcd-insecure: %v", err)
	}
	c.Close()
}
