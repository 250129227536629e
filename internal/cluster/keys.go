package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/errdefs"
)

// Keys returns the cluster's API key store (an auth.Backend in etcd): a key made on any node
// works on every node. Verification reads the watch-fed cache, and etcd once on a miss (a key
// made on another node a moment ago).
func (cl *Cluster) Keys() auth.Backend { return keyStore{cl} }

type keyStore struct{ cl *Cluster }

func (s keyStore) keys() *Records  { return s.cl.plainRecords("apikeys", "api key") }
func (s keyStore) teams() *Records { return s.cl.plainRecords("teams", "team") }

func (s keyStore) PutKey(ctx context.Context, k *auth.Key) error { return s.keys().Put(ctx, k.ID, k) }

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
	out, err := ListOf[auth.Key](ctx, s.keys())
	if err != nil {
		return nil, err
	}
	sort.Slice(out, func(i, j int) bool {
		if !out[i].CreatedAt.Equal(out[j].CreatedAt) {
			return out[i].CreatedAt.Before(out[j].CreatedAt)
		}
		return out[i].ID < out[j].ID
	})
	return out, nil
}

func (s keyStore) DeleteKey(ctx context.Context, id string) error { return s.keys().Delete(ctx, id) }

// Teams are kept next to the keys, under teams/<id>: a team made on any node is every node's.

func (s keyStore) PutTeam(ctx context.Context, t *auth.Team) error {
	return s.teams().Put(ctx, t.ID, t)
}

func (s keyStore) GetTeam(ctx context.Context, id string) (*auth.Team, error) {
	var t auth.Team
	if err := s.teams().Get(ctx, id, &t); err != nil {
		if errors.Is(err, errdefs.ErrUnavailable) {
			return nil, err
		}
		return nil, fmt.Errorf("team %q: %w", id, errdefs.ErrNotFound)
	}
	return &t, nil
}

func (s keyStore) ListTeams(ctx context.Context) ([]*auth.Team, error) {
	out, err := ListOf[auth.Team](ctx, s.teams())
	if err != nil {
		return nil, err
	}
	auth.SortTeams(out)
	return out, nil
}

func (s keyStore) DeleteTeam(ctx context.Context, id string) error { return s.teams().Delete(ctx, id) }
