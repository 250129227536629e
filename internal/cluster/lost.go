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
// (LostTTL), oldest loss first: the lost records, and the routes of gone nodes not yet
// replaced by one (Locate). Reads of etcd: neither is cached.
func (cl *Cluster) LostSandboxes(ctx context.Context) ([]LostSandbox, error) {
	ctx, done := cl.opCtx(ctx, cl.cfg.OpTimeout)
	defer done()
	// The routes first: one replaced by its lost record in between is then read twice
	// (kept once), never missed.
	var out []LostSandbox
	derived := map[string]bool{}
	if err := cl.scanRoutes(ctx, func(id string, rt *Route) {
		if !rt.Stored && cl.gone(rt) {
			out = append(out, LostSandbox{ID: id, Lost: *cl.lostOf(rt)})
			derived[id] = true
		}
	}); err != nil {
		return nil, err
	}
	r, err := cl.c.Get(ctx, cl.key("lost")+"/", clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	for _, kv := range r.Kvs {
		var l LostSandbox
		if json.Unmarshal(kv.Value, &l.Lost) != nil {
			continue
		}
		l.ID = strings.TrimPrefix(string(kv.Key), cl.key("lost")+"/")
		if !derived[l.ID] {
			out = append(out, l)
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if !out[i].At.Equal(out[j].At) {
			return out[i].At.Before(out[j].At)
		}
		return out[i].ID < out[j].ID
	})
	return out, nil
}
