package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
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

func (s volumeStore) records() *Records {
	r := s.cl.SealedRecords("volumes", "volume")
	r.names = "volnames" // volnames/<owner>/<name>
	return r
}

// PutVolume records a new volume; its name is claimed in the same transaction
// (volnames/<owner>/<name>), so that two nodes never make two volumes of one name.
func (s volumeStore) PutVolume(ctx context.Context, v *volume.Volume) error {
	err := s.records().PutNamed(ctx, v.ID, []string{v.Owner, v.Name}, v)
	if errors.Is(err, errdefs.ErrConflict) {
		return &volume.Error{Msg: fmt.Sprintf("volume with name '%s' already exists", v.Name), Kind: errdefs.ErrConflict}
	}
	return err
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
	return s.records().DeleteNamed(ctx, id, []string{v.Owner, v.Name})
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
