package cluster

import (
	"context"
	"fmt"
	"sort"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/volume"
)

// Volumes returns the cluster's volume records (a volume.Store in etcd, volumes/<id>, sealed:
// they hold the volume's token), so that every node answers /volumes and the content API of
// every volume. The volumes' files are in the shared engine (volume.MountShared).
func (cl *Cluster) Volumes() volume.Store { return volumeStore{cl} }

type volumeStore struct{ cl *Cluster }

func (s volumeStore) PutVolume(ctx context.Context, v *volume.Volume) error {
	ctx, done := s.cl.opCtx(ctx, s.cl.cfg.OpTimeout)
	defer done()
	k := s.cl.key("volumes", v.ID)
	val, err := s.cl.sealJSON(k, v)
	if err != nil {
		return err
	}
	if _, err := s.cl.c.Put(ctx, k, val); err != nil {
		return fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	return nil
}

func (s volumeStore) GetVolume(ctx context.Context, id string) (*volume.Volume, error) {
	ctx, done := s.cl.opCtx(ctx, s.cl.cfg.OpTimeout)
	defer done()
	k := s.cl.key("volumes", id)
	r, err := s.cl.c.Get(ctx, k)
	if err != nil {
		return nil, fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	if len(r.Kvs) == 0 {
		return nil, fmt.Errorf("volume %q: %w", id, errdefs.ErrNotFound)
	}
	v := new(volume.Volume)
	if err := s.cl.openJSON(k, r.Kvs[0].Value, v); err != nil {
		return nil, err
	}
	return v, nil
}

func (s volumeStore) DeleteVolume(ctx context.Context, id string) error {
	ctx, done := s.cl.opCtx(ctx, s.cl.cfg.OpTimeout)
	defer done()
	if _, err := s.cl.c.Delete(ctx, s.cl.key("volumes", id)); err != nil {
		return fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	return nil
}

func (s volumeStore) ListVolumes(ctx context.Context) ([]*volume.Volume, error) {
	ctx, done := s.cl.opCtx(ctx, s.cl.cfg.OpTimeout)
	defer done()
	r, err := s.cl.c.Get(ctx, s.cl.key("volumes")+"/", clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	out := make([]*volume.Volume, 0, len(r.Kvs))
	for _, kv := range r.Kvs {
		v := new(volume.Volume)
		if err := s.cl.openJSON(string(kv.Key), kv.Value, v); err != nil {
			s.cl.log.Warn("cluster: volume record", "key", string(kv.Key), "err", err)
			continue
		}
		out = append(out, v)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].CreatedAt.Before(out[j].CreatedAt) })
	return out, nil
}

// VolumeUsers lists the sandboxes of the cluster, on any node, running or paused, that mount
// volume id (their routes name it).
func (cl *Cluster) VolumeUsers(id string) []string {
	cl.mu.RLock()
	defer cl.mu.RUnlock()
	var out []string
	for sid, r := range cl.routes {
		for _, v := range r.Volumes {
			if v == id {
				out = append(out, sid)
				break
			}
		}
	}
	sort.Strings(out)
	return out
}
