package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"slices"
	"sort"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/volume"
)

// Volumes returns the cluster's volume records (a volume.Store in etcd: volumes/<id>, sealed, as
// they hold the volume's token; volnames/<owner>/<name>, the id), so that every node answers /volumes and the content API of
// every volume. The volumes' files are in the shared engine (volume.MountShared).
func (cl *Cluster) Volumes() volume.Store { return volumeStore{cl} }

type volumeStore struct{ cl *Cluster }

func (s volumeStore) records() *Records { return s.cl.SealedRecords("volumes", "volume") }

// PutVolume records a new volume; its name is claimed in the same transaction
// (volnames/<owner>/<name>), so that two nodes never make two volumes of one name.
func (s volumeStore) PutVolume(ctx context.Context, v *volume.Volume) error {
	ctx, done := s.cl.opCtx(ctx, s.cl.cfg.OpTimeout)
	defer done()
	r := s.records()
	k, nk := r.Key(v.ID), s.nameKey(v)
	val, err := r.encode(k, v)
	if err != nil {
		return err
	}
	resp, err := s.cl.c.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(nk), "=", 0)).
		Then(clientv3.OpPut(k, val), clientv3.OpPut(nk, v.ID)).Commit()
	if err != nil {
		return fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	if !resp.Succeeded {
		return &volume.Error{Msg: fmt.Sprintf("volume with name '%s' already exists", v.Name), Kind: errdefs.ErrConflict}
	}
	return nil
}

func (s volumeStore) nameKey(v *volume.Volume) string {
	return s.cl.key("volnames", url.PathEscape(v.Owner), url.PathEscape(v.Name))
}

func (s volumeStore) GetVolume(ctx context.Context, id string) (*volume.Volume, error) {
	v := new(volume.Volume)
	if err := s.records().Get(ctx, id, v); err != nil {
		return nil, err
	}
	return v, nil
}

func (s volumeStore) DeleteVolume(ctx context.Context, id string) error {
	v, err := s.GetVolume(ctx, id)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil
	}
	if err != nil {
		return err
	}
	ctx, done := s.cl.opCtx(ctx, s.cl.cfg.OpTimeout)
	defer done()
	nk := s.nameKey(v)
	if _, err := s.cl.c.Txn(ctx).Then(clientv3.OpDelete(s.records().Key(id)),
		clientv3.OpTxn([]clientv3.Cmp{clientv3.Compare(clientv3.Value(nk), "=", id)}, []clientv3.Op{clientv3.OpDelete(nk)}, nil)).Commit(); err != nil {
		return fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	return nil
}

func (s volumeStore) ListVolumes(ctx context.Context) ([]*volume.Volume, error) {
	out, err := ListOf[volume.Volume](ctx, s.records())
	if err != nil {
		return nil, err
	}
	sort.Slice(out, func(i, j int) bool { return out[i].CreatedAt.Before(out[j].CreatedAt) })
	return out, nil
}

// VolumeUsers lists the sandboxes of the cluster, on any node, running or paused, that mount
// volume id (their routes name it). Nodes do not watch each other's routes, so this reads them
// all: a destroy is rare, and it must not miss a sandbox another node just made.
func (cl *Cluster) VolumeUsers(ctx context.Context, id string) ([]string, error) {
	resp, err := cl.c.Get(ctx, cl.key("sandboxes")+"/", clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("volume users: %w", errdefs.ErrUnavailable)
	}
	var out []string
	for _, kv := range resp.Kvs {
		var r Route
		if json.Unmarshal(kv.Value, &r) != nil || !slices.Contains(r.Volumes, id) {
			continue
		}
		out = append(out, strings.TrimPrefix(string(kv.Key), cl.key("sandboxes")+"/"))
	}
	sort.Strings(out)
	return out, nil
}
