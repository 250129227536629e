package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"net/url"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// Records is one kind of JSON record the cluster keeps in etcd, under <prefix><kind>/<id>:
// API keys and teams (plain: they hold no secret), volumes and secrets (sealed with the
// cluster key, seal.go). Every store of such records (keys.go, volumes.go, internal/secret's)
// reads and writes through it, so that the etcd errors, the timeouts and the sealing are the
// same everywhere.
type Records struct {
	cl     *Cluster
	kind   string
	noun   string // in errors: "volume", "api key"
	sealed bool
	names  string // the prefix of name claims (PutNamed): <names>/<part>/...
}

// SealedRecords returns the records of kind (noun names one in errors), sealed with the
// cluster key. Their names, when PutNamed claims them, are under <kind>-names/.
func (cl *Cluster) SealedRecords(kind, noun string) *Records {
	return &Records{cl: cl, kind: kind, noun: noun, sealed: true, names: kind + "-names"}
}

func (cl *Cluster) plainRecords(kind, noun string) *Records {
	return &Records{cl: cl, kind: kind, noun: noun}
}

// Key is the etcd key of record id.
func (r *Records) Key(id string) string { return r.cl.key(r.kind, id) }

// encode is the etcd value of v under key k.
func (r *Records) encode(k string, v any) (string, error) {
	if r.sealed {
		return r.cl.sealJSON(k, v)
	}
	b, err := json.Marshal(v)
	return string(b), err
}

// decode reads the etcd value b under key k into v.
func (r *Records) decode(k string, b []byte, v any) error {
	if r.sealed {
		return r.cl.openJSON(k, b, v)
	}
	return json.Unmarshal(b, v)
}

// Put writes v as record id.
func (r *Records) Put(ctx context.Context, id string, v any) error {
	k := r.Key(id)
	val, err := r.encode(k, v)
	if err != nil {
		return err
	}
	ctx, done := r.cl.opCtx(ctx, r.cl.cfg.OpTimeout)
	defer done()
	if _, err := r.cl.c.Put(ctx, k, val); err != nil {
		return fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	return nil
}

// Get reads record id into v (ErrNotFound when there is none).
func (r *Records) Get(ctx context.Context, id string, v any) error {
	ctx, done := r.cl.opCtx(ctx, r.cl.cfg.OpTimeout)
	defer done()
	k := r.Key(id)
	resp, err := r.cl.c.Get(ctx, k)
	if err != nil {
		return fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	if len(resp.Kvs) == 0 {
		return fmt.Errorf("%s %q: %w", r.noun, id, errdefs.ErrNotFound)
	}
	return r.decode(k, resp.Kvs[0].Value, v)
}

// List calls each with every record, opened; a record that does not decode is logged and
// skipped (one bad record does not hide the others).
func (r *Records) List(ctx context.Context, each func(decode func(v any) error) error) error {
	ctx, done := r.cl.opCtx(ctx, r.cl.cfg.OpTimeout)
	defer done()
	resp, err := r.cl.c.Get(ctx, r.cl.key(r.kind)+"/", clientv3.WithPrefix())
	if err != nil {
		return fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	for _, kv := range resp.Kvs {
		var derr error
		err := each(func(v any) error {
			derr = r.decode(string(kv.Key), kv.Value, v)
			return derr
		})
		if derr != nil {
			r.cl.log.Warn("cluster: record does not decode", "key", string(kv.Key), "err", derr)
			continue
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// nameKey is the etcd key of the name claim made of parts (each path-escaped).
func (r *Records) nameKey(parts []string) string {
	esc := []string{r.names}
	for _, p := range parts {
		esc = append(esc, url.PathEscape(p))
	}
	return r.cl.key(esc...)
}

// PutNamed writes v as record id and claims the name made of parts for it, in one
// transaction, so that two nodes never give one name (an owner's, say) to two records: a name
// another record holds is ErrConflict. Writing id again under its own name is an update.
func (r *Records) PutNamed(ctx context.Context, id string, name []string, v any) error {
	k, nk := r.Key(id), r.nameKey(name)
	val, err := r.encode(k, v)
	if err != nil {
		return err
	}
	ctx, done := r.cl.opCtx(ctx, r.cl.cfg.OpTimeout)
	defer done()
	resp, err := r.cl.c.Txn(ctx).If(clientv3.Compare(clientv3.Value(nk), "=", id)).Then(clientv3.OpPut(k, val)).
		Else(clientv3.OpTxn([]clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(nk), "=", 0)},
			[]clientv3.Op{clientv3.OpPut(k, val), clientv3.OpPut(nk, id)}, nil)).Commit()
	if err != nil {
		return fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	if !resp.Succeeded && !resp.Responses[0].GetResponseTxn().Succeeded {
		return fmt.Errorf("%s name is taken: %w", r.noun, errdefs.ErrConflict)
	}
	return nil
}

// DeleteNamed removes record id and its name claim (when the claim is still id's). A record
// already gone is no error.
func (r *Records) DeleteNamed(ctx context.Context, id string, name []string) error {
	_, err := r.DeleteNamedIf(ctx, id, name, nil)
	return err
}

// DeleteNamedIf is DeleteNamed done, with the extra operations, only if cmps hold (false if
// they did not).
func (r *Records) DeleteNamedIf(ctx context.Context, id string, name []string, cmps []clientv3.Cmp, extra ...clientv3.Op) (bool, error) {
	nk := r.nameKey(name)
	ctx, done := r.cl.opCtx(ctx, r.cl.cfg.OpTimeout)
	defer done()
	ops := append([]clientv3.Op{clientv3.OpDelete(r.Key(id)),
		clientv3.OpTxn([]clientv3.Cmp{clientv3.Compare(clientv3.Value(nk), "=", id)}, []clientv3.Op{clientv3.OpDelete(nk)}, nil)}, extra...)
	resp, err := r.cl.c.Txn(ctx).If(cmps...).Then(ops...).Commit()
	if err != nil {
		return false, fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	return resp.Succeeded, nil
}

// Delete removes record id (ErrNotFound when there was none).
func (r *Records) Delete(ctx context.Context, id string) error {
	ctx, done := r.cl.opCtx(ctx, r.cl.cfg.OpTimeout)
	defer done()
	resp, err := r.cl.c.Delete(ctx, r.Key(id))
	if err != nil {
		return fmt.Errorf("etcd: %w", errdefs.ErrUnavailable)
	}
	if resp.Deleted == 0 {
		return fmt.Errorf("%s %q: %w", r.noun, id, errdefs.ErrNotFound)
	}
	return nil
}

// ListOf returns every record of r (those that decode).
func ListOf[T any](ctx context.Context, r *Records) ([]*T, error) {
	out := []*T{}
	err := r.List(ctx, func(decode func(any) error) error {
		v := new(T)
		if err := decode(v); err != nil {
			return err
		}
		out = append(out, v)
		return nil
	})
	return out, err
}
