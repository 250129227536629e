package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/errdefs"
)

// Keys returns the cluster's API key store (an auth.Backend in etcd): a key made on any node
// works on every node. Verification reads the watch-fed cache, and etcd once on a miss (a key
// made on another node a moment ago).
func (cl *Cluster) Keys() auth.Backend { return keyStore{cl} }

type keyStore struct{ cl *Cluster }

func (s keyStore) PutKey(ctx context.Context, k *auth.Key) error {
	ctx, done := s.cl.opCtx(ctx, s.cl.cfg.OpTimeout)
	defer done()
	b, err := json.Marshal(k)
	if err != nil {
		return err
	}
	if _, err := s.cl.c.Put(ctx, s.cl.key("apikeys", k.ID), string(b)); err != nil {
		return fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	return nil
}

func (s keyStore) GetKeyByHash(ctx context.Context, hash string) (*auth.Key, error) {
	s.cl.mu.RLock()
	for _, b := range s.cl.keys {
		var k auth.Key
		if json.Unmarshal(b, &k) == nil && k.Hash == hash {
			s.cl.mu.RUnlock()
			return &k, nil
		}
	}
	s.cl.mu.RUnlock()
	ks, err := s.ListKeys(ctx)
	if err != nil {
		return nil, err
	}
	for _, k := range ks {
		if k.Hash == hash {
			return k, nil
		}
	}
	return nil, fmt.Errorf("api key: %w", errdefs.ErrNotFound)
}

func (s keyStore) ListKeys(ctx context.Context) ([]*auth.Key, error) {
	ctx, done := s.cl.opCtx(ctx, s.cl.cfg.OpTimeout)
	defer done()
	r, err := s.cl.c.Get(ctx, s.cl.key("apikeys")+"/", clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	out := make([]*auth.Key, 0, len(r.Kvs))
	for _, kv := range r.Kvs {
		var k auth.Key
		if json.Unmarshal(kv.Value, &k) == nil {
			out = append(out, &k)
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if !out[i].CreatedAt.Equal(out[j].CreatedAt) {
			return out[i].CreatedAt.Before(out[j].CreatedAt)
		}
		return out[i].ID < out[j].ID
	})
	return out, nil
}

func (s keyStore) DeleteKey(ctx context.Context, id string) error {
	ctx, done := s.cl.opCtx(ctx, s.cl.cfg.OpTimeout)
	defer done()
	r, err := s.cl.c.Delete(ctx, s.cl.key("apikeys", id))
	if err != nil {
		return fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	if r.Deleted == 0 {
		return fmt.Errorf("api key %q: %w", id, errdefs.ErrNotFound)
	}
	return nil
}

// Teams are kept next to the keys, under teams/<id>: a team made on any node is every node's.

func (s keyStore) PutTeam(ctx context.Context, t *auth.Team) error {
	ctx, done := s.cl.opCtx(ctx, s.cl.cfg.OpTimeout)
	defer done()
	b, err := json.Marshal(t)
	if err != nil {
		return err
	}
	if _, err := s.cl.c.Put(ctx, s.cl.key("teams", t.ID), string(b)); err != nil {
		return fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	return nil
}

func (s keyStore) GetTeam(ctx context.Context, id string) (*auth.Team, error) {
	ctx, done := s.cl.opCtx(ctx, s.cl.cfg.OpTimeout)
	defer done()
	r, err := s.cl.c.Get(ctx, s.cl.key("teams", id))
	if err != nil {
		return nil, fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	var t auth.Team
	if len(r.Kvs) == 0 || json.Unmarshal(r.Kvs[0].Value, &t) != nil {
		return nil, fmt.Errorf("team %q: %w", id, errdefs.ErrNotFound)
	}
	return &t, nil
}

func (s keyStore) ListTeams(ctx context.Context) ([]*auth.Team, error) {
	ctx, done := s.cl.opCtx(ctx, s.cl.cfg.OpTimeout)
	defer done()
	r, err := s.cl.c.Get(ctx, s.cl.key("teams")+"/", clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	out := make([]*auth.Team, 0, len(r.Kvs))
	for _, kv := range r.Kvs {
		var t auth.Team
		if json.Unmarshal(kv.Value, &t) == nil {
			out = append(out, &t)
		}
	}
	auth.SortTeams(out)
	return out, nil
}

func (s keyStore) DeleteTeam(ctx context.Context, id string) error {
	ctx, done := s.cl.opCtx(ctx, s.cl.cfg.OpTimeout)
	defer done()
	r, err := s.cl.c.Delete(ctx, s.cl.key("teams", id))
	if err != nil {
		return fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	if r.Deleted == 0 {
		return fmt.Errorf("team %q: %w", id, errdefs.ErrNotFound)
	}
	return nil
}
