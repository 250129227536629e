package daemon

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ember-sandbox/ember/internal/cluster/clustertest"
	"github.com/ember-sandbox/ember/internal/errdefs"
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
	base := Config{EtcdEndpoints: e.Endpoints(), EtcdCA: good.CA, EtcdCert: good.Cert, EtcdKey: good.Key, ClusterKeyFile: e.KeyFile()}
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
		{"a sealing key of another cluster's size", func(c *Config) { c.ClusterKeyFile = good.CA }, "64 hex digits"},
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
	anon, err := clientv3.New(clientv3.Config{Endpoints: e.Endpoints(), DialTimeout: 2 * time.Second, TLS: tc})
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
