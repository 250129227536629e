package cluster

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// The cluster secret proves that a request between two nodes comes from a node (the API signs
// forwarded requests with it). It is the operator's (Config.Secret, from --cluster-secret-file)
// or else the cluster's own: 32 random bytes the first node to join puts under secret, read by
// every node that joins after. It is sealed with the cluster key (seal.go): reading etcd alone
// does not give it.
func (cl *Cluster) loadSecret(ctx context.Context) error {
	if len(cl.cfg.Secret) > 0 {
		if len(cl.cfg.Secret) < 16 {
			return fmt.Errorf("the cluster secret must be 16 bytes or more: %w", errdefs.ErrInvalid)
		}
		cl.secret = cl.cfg.Secret
		return nil
	}
	b, err := SharedKey(ctx, cl.c, cl.p, "secret", cl.cfg.SealKey, nil, 32)
	if err != nil {
		return err
	}
	cl.secret = b
	return nil
}

// Secret is the key nodes sign their requests to each other with.
func (cl *Cluster) Secret() []byte { return cl.secret }

// SharedKey returns the cluster's key under <prefix><name>: the one there, or else offer (or n
// random bytes when offer is empty), put there if no other node was first. The value is sealed
// with seal (hex-encoded plain without one, only with --etcd-insecure).
func SharedKey(ctx context.Context, c *clientv3.Client, prefix, name string, seal *SealKey, offer []byte, n int) ([]byte, error) {
	if prefix == "" {
		prefix = "/ember/"
	}
	cl := &Cluster{c: c, p: prefix, cfg: Config{SealKey: seal}}
	b := offer
	if len(b) == 0 {
		b = make([]byte, n)
		if _, err := rand.Read(b); err != nil {
			return nil, err
		}
	}
	k := cl.key(name)
	v := cl.seal(k, []byte(hex.EncodeToString(b)))
	resp, err := c.Txn(ctx).If(clientv3.Compare(clientv3.Version(k), "=", 0)).Then(clientv3.OpPut(k, v)).Else(clientv3.OpGet(k)).Commit()
	if err != nil {
		return nil, err
	}
	if resp.Succeeded {
		return b, nil
	}
	kvs := resp.Responses[0].GetResponseRange().Kvs
	if len(kvs) == 0 {
		return nil, fmt.Errorf("%s vanished", k)
	}
	plain, err := cl.open(k, kvs[0].Value)
	if err != nil {
		return nil, err
	}
	if b, err = hex.DecodeString(string(plain)); err != nil || len(b) < 16 {
		return nil, fmt.Errorf("%s is not 16 or more hex-encoded bytes: %w", k, errdefs.ErrCorrupt)
	}
	return b, nil
}
