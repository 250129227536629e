package cluster

import (
	"context"
	"crypto/rand"
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
	_, err := s.deleteVolume(ctx, id)
	return err
}

// deleteVolume deletes volume id's record, name and limit mark if cmps hold (false if not).
func (s volumeStore) deleteVolume(ctx context.Context, id string, cmps ...clientv3.Cmp) (bool, error) {
	v, err := s.GetVolume(ctx, id)
	if errors.Is(err, errdefs.ErrNotFound) {
		return true, nil
	}
	if err != nil {
		return false, err
	}
	return s.records().DeleteNamedIf(ctx, id, []string{v.Owner, v.Name}, cmps, clientv3.OpDelete(s.cl.key("vollimited", id)))
}

func (s volumeStore) ListVolumes(ctx context.Context) ([]*volume.Volume, error) {
	out, err := ListOf[volume.Volume](ctx, s.records())
	if err != nil {
		return nil, err
	}
	sort.Slice(out, func(i, j int) bool { return out[i].CreatedAt.Before(out[j].CreatedAt) })
	return out, nil
}

// Claims (volume.Claims): a create claims each volume it mounts with a key
// volclaims/<id>/<node>/<random> under the node's lease (a node that dies drops its claims with it)
// and, in the same transaction, touches the volume's record (a put that keeps its value), whose
// mod revision is then the volume's claim version. A destroy reads that version before the
// routes and deletes in one transaction only if the version is unchanged and no claim is left:
// a create that claimed after the destroy read its users is refused by it, or refuses it.

var _ volume.Claims = volumeStore{}

func (s volumeStore) claimsKey(id string) string { return s.cl.key("volclaims", id) + "/" }

// ClaimVolume records that a sandbox being made on this node mounts volume id.
func (s volumeStore) ClaimVolume(ctx context.Context, id string) (func(), error) {
	epoch := s.cl.epoch.Load()
	if epoch == 0 {
		return nil, fmt.Errorf("this node is cut off from the cluster: %w", errdefs.ErrUnavailable)
	}
	ck := s.claimsKey(id) + s.cl.cfg.NodeID + "/" + rand.Text()
	k := s.cl.key("volumes", id)
	octx, done := s.cl.opCtx(ctx, s.cl.cfg.OpTimeout)
	defer done()
	resp, err := s.cl.c.Txn(octx).If(clientv3.Compare(clientv3.CreateRevision(k), ">", 0)).
		Then(clientv3.OpPut(ck, "", clientv3.WithLease(clientv3.LeaseID(epoch))), clientv3.OpPut(k, "", clientv3.WithIgnoreValue())).Commit()
	if err != nil {
		return nil, fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	if !resp.Succeeded {
		return nil, fmt.Errorf("volume %q: %w", id, errdefs.ErrNotFound)
	}
	return func() {
		// Not the request's context: the claim goes even when the create was cancelled.
		ctx, done := s.cl.opCtx(context.WithoutCancel(ctx), s.cl.cfg.OpTimeout)
		defer done()
		if _, err := s.cl.c.Delete(ctx, ck); err != nil {
			s.cl.log.Warn("cluster: release volume claim (it goes with the node's lease)", "key", ck, "err", err)
		}
	}, nil
}

// VolumeVersion is the mod revision of volume id's record.
func (s volumeStore) VolumeVersion(ctx context.Context, id string) (int64, error) {
	ctx, done := s.cl.opCtx(ctx, s.cl.cfg.OpTimeout)
	defer done()
	r, err := s.cl.c.Get(ctx, s.cl.key("volumes", id))
	if err != nil {
		return 0, fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	if len(r.Kvs) == 0 {
		return 0, fmt.Errorf("volume %q: %w", id, errdefs.ErrNotFound)
	}
	return r.Kvs[0].ModRevision, nil
}

// DeleteVolumeIf deletes volume id if its record is at version and no claim of it is left.
func (s volumeStore) DeleteVolumeIf(ctx context.Context, id string, version int64) error {
	ok, err := s.deleteVolume(ctx, id, clientv3.Compare(clientv3.ModRevision(s.cl.key("volumes", id)), "=", version),
		clientv3.Compare(clientv3.CreateRevision(s.claimsKey(id)), "=", 0).WithPrefix())
	if err == nil && !ok {
		err = fmt.Errorf("volume %q claimed by a sandbox being created: %w", id, errdefs.ErrConflict)
	}
	return err
}

// Disk limits (volume.LimitStore): volholder is the node that holds them (no lease: while it
// is down, creates wait for it and fail rather than make a volume without a limit);
// vollimited/<id> says it has mounted volume id's image.

var _ volume.LimitStore = volumeStore{}

func (s volumeStore) HoldLimits(ctx context.Context) error {
	ctx, done := s.cl.opCtx(ctx, s.cl.cfg.OpTimeout)
	defer done()
	k, self := s.cl.key("volholder"), s.cl.cfg.NodeID
	resp, err := s.cl.c.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(k), "=", 0)).
		Then(clientv3.OpPut(k, self)).Else(clientv3.OpGet(k)).Commit()
	if err != nil {
		return fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	if !resp.Succeeded {
		if kvs := resp.Responses[0].GetResponseRange().Kvs; len(kvs) == 1 && string(kvs[0].Value) != self {
			return fmt.Errorf("node %s holds the volumes' disk limits already (one node does, on the S3 server's host): %w", kvs[0].Value, errdefs.ErrConflict)
		}
	}
	return nil
}

func (s volumeStore) LetGoLimits(ctx context.Context) error {
	ctx, done := s.cl.opCtx(ctx, s.cl.cfg.OpTimeout)
	defer done()
	k := s.cl.key("volholder")
	if _, err := s.cl.c.Txn(ctx).If(clientv3.Compare(clientv3.Value(k), "=", s.cl.cfg.NodeID)).Then(clientv3.OpDelete(k)).Commit(); err != nil {
		return fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	return nil
}

func (s volumeStore) LimitHeld(ctx context.Context) (bool, error) {
	return s.exists(ctx, s.cl.key("volholder"))
}

func (s volumeStore) MarkLimited(ctx context.Context, id string) error {
	ctx, done := s.cl.opCtx(ctx, s.cl.cfg.OpTimeout)
	defer done()
	// Only while the volume is there: a destroy deletes both.
	if _, err := s.cl.c.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(s.cl.key("volumes", id)), ">", 0)).
		Then(clientv3.OpPut(s.cl.key("vollimited", id), s.cl.cfg.NodeID)).Commit(); err != nil {
		return fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	return nil
}

func (s volumeStore) Limited(ctx context.Context, id string) (bool, error) {
	return s.exists(ctx, s.cl.key("vollimited", id))
}

func (s volumeStore) exists(ctx context.Context, k string) (bool, error) {
	ctx, done := s.cl.opCtx(ctx, s.cl.cfg.OpTimeout)
	defer done()
	r, err := s.cl.c.Get(ctx, k, clientv3.WithCountOnly())
	if err != nil {
		return false, fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	return r.Count > 0, nil
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
