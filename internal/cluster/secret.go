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
// every node that joins after. Whoever can read etcd can read it; etcd is trusted anyway.
func (cl *Cluster) loadSecret(ctx context.Context) error {
	if len(cl.cfg.Secret) > 0 {
		if len(cl.cfg.Secret) < 16 {
			return fmt.Errorf("the cluster secret must be 16 bytes or more: %w", errdefs.ErrInvalid)
		}
		cl.secret = cl.cfg.Secret
		return nil
	}
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		return err
	}
	k := cl.key("secret")
	resp, err := cl.c.Txn(ctx).If(clientv3.Compare(clientv3.Version(k), "=", 0)).Then(clientv3.OpPut(k, hex.EncodeToString(b))).Else(clientv3.OpGet(k)).Commit()
	if err != nil {
		return err
	}
	if !resp.Succeeded {
		kvs := resp.Responses[0].GetResponseRange().Kvs
		if len(kvs) == 0 {
			return fmt.Errorf("cluster secret vanished")
		}
		if b, err = hex.DecodeString(string(kvs[0].Value)); err != nil || len(b) < 16 {
			return fmt.Errorf("cluster secret under %s is not 16 or more hex-encoded bytes", k)
		}
	}
	cl.secret = b
	return nil
}

// Secret is the key nodes sign their requests to each other with.
func (cl *Cluster) Secret() []byte { return cl.secret }
