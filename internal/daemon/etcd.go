package daemon

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/datadir"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/snapshot"
)

// dialEtcd connects to the cluster's etcd as cfg says, refusing one it cannot authenticate
// (plain http, no client certificate, an etcd that takes clients without one) unless
// --etcd-insecure, and loads the cluster sealing key (required unless --etcd-insecure).
func dialEtcd(ctx context.Context, cfg Config) (*clientv3.Client, *cluster.SealKey, error) {
	return dialEtcdCounted(ctx, cfg, nil)
}

// dialEtcdCounted is dialEtcd with the client's requests counted in counters (nil: not).
func dialEtcdCounted(ctx context.Context, cfg Config, counters *cluster.EtcdCounters) (*clientv3.Client, *cluster.SealKey, error) {
	if cfg.NodeID == "" {
		return nil, nil, fmt.Errorf("etcd-endpoints: cluster mode needs --node-id: %w", errdefs.ErrInvalid)
	}
	files := cluster.TLSFiles{CA: cfg.EtcdCA, Cert: cfg.EtcdCert, Key: cfg.EtcdKey, Insecure: cfg.EtcdInsecure}
	tc, err := cluster.ClientTLS(cfg.EtcdEndpoints, files)
	if err != nil {
		return nil, nil, err
	}
	var seal *cluster.SealKey
	switch {
	case cfg.ClusterKeyFile != "":
		if seal, err = cluster.LoadSealKey(cfg.ClusterKeyFile); err != nil {
			return nil, nil, err
		}
	case !cfg.EtcdInsecure:
		return nil, nil, fmt.Errorf("cluster-key-file: cluster mode needs the cluster sealing key (the same file on every node; ember cluster certs makes one), which seals the secrets kept in etcd; or --etcd-insecure to keep them in plain text: %w", errdefs.ErrInvalid)
	}
	if err := cluster.CheckTLS(ctx, cfg.EtcdEndpoints, tc, cfg.EtcdInsecure); err != nil {
		return nil, nil, err
	}
	ccfg := clientv3.Config{Endpoints: cfg.EtcdEndpoints, DialTimeout: 5 * time.Second, Logger: zap.NewNop(),
		DialKeepAliveTime: 5 * time.Second, DialKeepAliveTimeout: 3 * time.Second, TLS: tc}
	if counters != nil {
		ccfg.DialOptions = counters.DialOptions()
	}
	c, err := clientv3.New(ccfg)
	if err != nil {
		return nil, nil, fmt.Errorf("etcd: %w", err)
	}
	return c, seal, nil
}

// clusterSnapshotKey is the cluster's snapshot signing key, kept sealed in etcd: the first
// node to join puts its own there (<data-dir>/snapshot-key if it has one, so that what it
// stored before stays valid), every other node uses that one. nil with --snapshot-key (the
// operator's file, which every node must then share).
func clusterSnapshotKey(ctx context.Context, cfg Config, c *clientv3.Client, seal *cluster.SealKey) ([]byte, error) {
	if cfg.SnapshotKeyFile != "" {
		return nil, nil
	}
	var offer []byte
	local := datadir.SnapshotKey(cfg.DataDir)
	if _, err := os.Lstat(local); err == nil {
		if offer, err = snapshot.LoadOrCreateKey(local); err != nil {
			return nil, err
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	octx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	key, err := cluster.SharedKey(octx, c, "", "snapshot-key", seal, offer, snapshot.KeySize)
	if err != nil {
		return nil, fmt.Errorf("etcd: the cluster's snapshot key: %w", err)
	}
	return key, nil
}
