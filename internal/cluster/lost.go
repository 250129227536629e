package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// LostSandbox is one sandbox lost with its node, as listings show it on request.
type LostSandbox struct {
	ID string
	Lost
}

// LostSandboxes lists the sandboxes lost with their nodes that the cluster still remembers
// (LostTTL), oldest loss first. One etcd read: lost records are not cached.
func (cl *Cluster) LostSandboxes(ctx context.Context) ([]LostSandbox, error) {
	ctx, done := cl.opCtx(ctx, cl.cfg.OpTimeout)
	defer done()
	r, err := cl.c.Get(ctx, cl.key("lost")+"/", clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	out := make([]LostSandbox, 0, len(r.Kvs))
	for _, kv := range r.Kvs {
		var l LostSandbox
		if json.Unmarshal(kv.Value, &l.Lost) != nil {
			continue
		}
		l.ID = strings.TrimPrefix(string(kv.Key), cl.key("lost")+"/")
		out = append(out, l)
	}
	sort.Slice(out, func(i, j int) bool {
		if !out[i].At.Equal(out[j].At) {
			return out[i].At.Before(out[j].At)
		}
		return out[i].ID < out[j].ID
	})
	return out, nil
}
