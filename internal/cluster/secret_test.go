package cluster_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/cluster/clustertest"
)

// Every node of a cluster signs with one secret: the first node's, kept in etcd, unless the
// operator gives one (16 bytes or more).
func TestClusterSecret(t *testing.T) {
	e := clustertest.Start(t, 3)
	a := join(t, e.Endpoints(), "a", 4, newLocal("base"))
	b := join(t, e.Endpoints(), "b", 4, newLocal("base"))
	if len(a.Secret()) < 16 || !bytes.Equal(a.Secret(), b.Secret()) {
		t.Fatalf("secrets: a %x, b %x", a.Secret(), b.Secret())
	}
	own := []byte("an operator's secret, 16+ bytes")
	c := join(t, e.Endpoints(), "c", 4, newLocal("base"), func(cfg *cluster.Config) { cfg.Secret = own })
	if !bytes.Equal(c.Secret(), own) {
		t.Fatalf("c signs with %q, want the operator's", c.Secret())
	}
	cli, err := clientv3.New(clustertest.ClientConfig(e.Endpoints()))
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := cluster.New(ctx, cluster.Config{Client: cli, NodeID: "d", Local: newLocal(), Secret: []byte("short")}); err == nil {
		t.Fatal("a 5-byte secret was accepted")
	}
}
