// Package store is ember's embedded metadata store: sandboxes, templates (and named snapshots),
// API keys and volumes, in one bbolt file under the data directory. Every write is a committed,
// fsynced transaction, so what the API acknowledged survives a crash or a kill -9 of the daemon.
// Concurrent writes share a transaction (group commit): a write that arrives while another
// commits waits for that fsync and goes into the next one with every other write that came
// meanwhile, so N writers cost about two fsyncs instead of N and a lone writer waits for nothing.
// It stores records; it does not decide anything about them.
package store

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"sync"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/secret"
	"github.com/ember-sandbox/ember/internal/volume"
)

var (
	bucketSandboxes = []byte("sandboxes")
	bucketTemplates = []byte("templates")
	bucketKeys      = []byte("apikeys")
	// bucketCheckpoints: step checkpoints, keyed <sandbox id>/<checkpoint id>.
	bucketCheckpoints = []byte("checkpoints")
	bucketVolumes     = []byte("volumes")
	bucketTeams       = []byte("teams")
	// bucketSecrets: secret records, their values sealed (internal/secret).
	bucketSecrets = []byte("secrets")
)

// Store is the metadata store. Safe for concurrent use.
type Store struct {
	db *bolt.DB
	gc *groupCommit
}

// Open opens (creating if needed) the store file at path.
func Open(path string) (*Store, error) {
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: 5 * time.Second})
	if err != nil {
		return nil, fmt.Errorf("open store %s: %w", path, err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		for _, b := range [][]byte{bucketSandboxes, bucketTemplates, bucketKeys, bucketCheckpoints, bucketVolumes, bucketTeams, bucketSecrets} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("init store: %w", err)
	}
	return &Store{db: db, gc: &groupCommit{db: db}}, nil
}

// Close closes the store file.
func (s *Store) Close() error { return s.db.Close() }

// groupCommit runs write functions in shared bolt transactions. A writer that finds no commit
// under way leads: it commits every queued write in one transaction (one fsync). Writes that
// arrive meanwhile queue up; when the commit ends, the first of them leads the next one with all
// of them. Each writer returns once the transaction holding its write is committed (on disk),
// with its own error, and leads at most one commit.
//
// bolt's db.Batch does the same but waits up to MaxBatchDelay (10 ms) for company before it
// commits, which a lone writer (the common case: one create) would pay on every write.
type groupCommit struct {
	db      *bolt.DB
	mu      sync.Mutex
	queue   []*write
	leading bool
}

type write struct {
	fn       func(*bolt.Tx) error
	finished bool
	err      error
	// wake gets one value: when the write is finished, or when its writer is to lead.
	wake chan struct{}
}

// update runs fn in a write transaction shared with concurrent callers and returns once that
// transaction is committed. fn may run more than once (when another write of its transaction
// fails, the others run again without it), so it must only depend on the transaction.
func (g *groupCommit) update(fn func(*bolt.Tx) error) error {
	w := &write{fn: fn, wake: make(chan struct{}, 1)}
	g.mu.Lock()
	g.queue = append(g.queue, w)
	if g.leading {
		g.mu.Unlock()
		<-w.wake
		if w.finished {
			return w.err
		}
		g.mu.Lock()
	}
	g.leading = true
	batch := g.queue
	g.queue = nil
	g.mu.Unlock()

	g.commit(batch)

	g.mu.Lock()
	if len(g.queue) > 0 {
		g.queue[0].wake <- struct{}{} // it leads the next commit
	} else {
		g.leading = false
	}
	g.mu.Unlock()
	return w.err
}

// commit commits batch in one transaction. A write whose fn fails gets its error and the
// transaction is rolled back and retried without it, so one failed write (a delete of a missing
// record) neither fails nor partly applies the others.
func (g *groupCommit) commit(batch []*write) {
	finish := func(w *write, err error) {
		w.err, w.finished = err, true
		w.wake <- struct{}{}
	}
	for len(batch) > 0 {
		failed := -1
		err := g.db.Update(func(tx *bolt.Tx) error {
			for i, w := range batch {
				if err := w.fn(tx); err != nil {
					failed = i
					return err
				}
			}
			return nil
		})
		if failed < 0 {
			// Committed (err == nil) or the commit itself failed: the same answer for all.
			for _, w := range batch {
				finish(w, err)
			}
			return
		}
		finish(batch[failed], err)
		batch = append(batch[:failed:failed], batch[failed+1:]...)
	}
}

func put(g *groupCommit, bucket []byte, key string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return g.update(func(tx *bolt.Tx) error { return tx.Bucket(bucket).Put([]byte(key), b) })
}

func get(db *bolt.DB, bucket []byte, key string, v any) error {
	return db.View(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucket).Get([]byte(key))
		if b == nil {
			return fmt.Errorf("%s %q: %w", bucket[:len(bucket)-1], key, errdefs.ErrNotFound)
		}
		return json.Unmarshal(b, v)
	})
}

func del(g *groupCommit, bucket []byte, key string) error {
	return g.update(func(tx *bolt.Tx) error {
		bk := tx.Bucket(bucket)
		if bk.Get([]byte(key)) == nil {
			return fmt.Errorf("%s %q: %w", bucket[:len(bucket)-1], key, errdefs.ErrNotFound)
		}
		return bk.Delete([]byte(key))
	})
}

func all[T any](db *bolt.DB, bucket []byte) ([]*T, error) {
	var out []*T
	err := db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucket).ForEach(func(k, v []byte) error {
			t := new(T)
			if err := json.Unmarshal(v, t); err != nil {
				return fmt.Errorf("decode %s %q: %w", bucket, k, err)
			}
			out = append(out, t)
			return nil
		})
	})
	return out, err
}

// PutSandbox inserts or replaces a sandbox record.
func (s *Store) PutSandbox(_ context.Context, sb *sandbox.Sandbox) error {
	return put(s.gc, bucketSandboxes, sb.ID, sb)
}

// GetSandbox returns a sandbox record (ErrNotFound if absent).
func (s *Store) GetSandbox(_ context.Context, id string) (*sandbox.Sandbox, error) {
	sb := new(sandbox.Sandbox)
	if err := get(s.db, bucketSandboxes, id, sb); err != nil {
		return nil, err
	}
	return sb, nil
}

// DeleteSandbox removes a sandbox record.
func (s *Store) DeleteSandbox(_ context.Context, id string) error {
	return del(s.gc, bucketSandboxes, id)
}

// ListSandboxes returns every sandbox record, oldest first.
func (s *Store) ListSandboxes(_ context.Context) ([]*sandbox.Sandbox, error) {
	out, err := all[sandbox.Sandbox](s.db, bucketSandboxes)
	sort.Slice(out, func(i, j int) bool { return out[i].StartedAt.Before(out[j].StartedAt) })
	return out, err
}

// PutTemplate inserts or replaces a template record.
func (s *Store) PutTemplate(_ context.Context, t *sandbox.Template) error {
	return put(s.gc, bucketTemplates, t.ID, t)
}

// GetTemplate returns a template by id (ErrNotFound if absent).
func (s *Store) GetTemplate(_ context.Context, id string) (*sandbox.Template, error) {
	t := new(sandbox.Template)
	if err := get(s.db, bucketTemplates, id, t); err != nil {
		return nil, err
	}
	return t, nil
}

// DeleteTemplate removes a template record.
func (s *Store) DeleteTemplate(_ context.Context, id string) error {
	return del(s.gc, bucketTemplates, id)
}

// ListTemplates returns every template record, oldest first.
func (s *Store) ListTemplates(_ context.Context) ([]*sandbox.Template, error) {
	out, err := all[sandbox.Template](s.db, bucketTemplates)
	sort.Slice(out, func(i, j int) bool { return out[i].CreatedAt.Before(out[j].CreatedAt) })
	return out, err
}

// PutKey stores an API key record (auth.Backend).
func (s *Store) PutKey(_ context.Context, k *auth.Key) error { return put(s.gc, bucketKeys, k.ID, k) }

// GetKeyByHash finds an API key by the hash of its plaintext (auth.Backend).
func (s *Store) GetKeyByHash(_ context.Context, hash string) (*auth.Key, error) {
	keys, err := all[auth.Key](s.db, bucketKeys)
	if err != nil {
		return nil, err
	}
	for _, k := range keys {
		if k.Hash == hash {
			return k, nil
		}
	}
	return nil, fmt.Errorf("api key: %w", errdefs.ErrNotFound)
}

// ListKeys lists API key records (auth.Backend).
func (s *Store) ListKeys(_ context.Context) ([]*auth.Key, error) {
	out, err := all[auth.Key](s.db, bucketKeys)
	sort.Slice(out, func(i, j int) bool { return out[i].CreatedAt.Before(out[j].CreatedAt) })
	return out, err
}

// DeleteKey removes an API key record (auth.Backend).
func (s *Store) DeleteKey(_ context.Context, id string) error { return del(s.gc, bucketKeys, id) }

// PutTeam stores a team (auth.TeamBackend).
func (s *Store) PutTeam(_ context.Context, t *auth.Team) error {
	return put(s.gc, bucketTeams, t.ID, t)
}

// GetTeam reads a team (auth.TeamBackend).
func (s *Store) GetTeam(_ context.Context, id string) (*auth.Team, error) {
	t := &auth.Team{}
	if err := get(s.db, bucketTeams, id, t); err != nil {
		return nil, err
	}
	return t, nil
}

// ListTeams lists the teams, oldest first (auth.TeamBackend).
func (s *Store) ListTeams(_ context.Context) ([]*auth.Team, error) {
	out, err := all[auth.Team](s.db, bucketTeams)
	auth.SortTeams(out)
	return out, err
}

// DeleteTeam removes a team (auth.TeamBackend).
func (s *Store) DeleteTeam(_ context.Context, id string) error { return del(s.gc, bucketTeams, id) }

// PutCheckpoint inserts or replaces a step checkpoint record.
func (s *Store) PutCheckpoint(_ context.Context, c *sandbox.Checkpoint) error {
	return put(s.gc, bucketCheckpoints, c.SandboxID+"/"+c.ID, c)
}

// PutCheckpointHead records c and sb, whose head c now is, in one transaction (one fsync
// instead of two; neither record is on disk without the other).
func (s *Store) PutCheckpointHead(_ context.Context, c *sandbox.Checkpoint, sb *sandbox.Sandbox) error {
	cb, err := json.Marshal(c)
	if err != nil {
		return err
	}
	sbb, err := json.Marshal(sb)
	if err != nil {
		return err
	}
	return s.gc.update(func(tx *bolt.Tx) error {
		if err := tx.Bucket(bucketCheckpoints).Put([]byte(c.SandboxID+"/"+c.ID), cb); err != nil {
			return err
		}
		return tx.Bucket(bucketSandboxes).Put([]byte(sb.ID), sbb)
	})
}

// DeleteCheckpoint removes a step checkpoint record (ErrNotFound if absent).
func (s *Store) DeleteCheckpoint(_ context.Context, sandboxID, id string) error {
	return del(s.gc, bucketCheckpoints, sandboxID+"/"+id)
}

// ListCheckpoints returns the step checkpoints of sandboxID ("" = of every sandbox), oldest
// first.
func (s *Store) ListCheckpoints(_ context.Context, sandboxID string) ([]*sandbox.Checkpoint, error) {
	var out []*sandbox.Checkpoint
	err := s.db.View(func(tx *bolt.Tx) error {
		c := tx.Bucket(bucketCheckpoints).Cursor()
		prefix := []byte(sandboxID + "/")
		if sandboxID == "" {
			prefix = nil
		}
		for k, v := c.Seek(prefix); k != nil && bytes.HasPrefix(k, prefix); k, v = c.Next() {
			ck := new(sandbox.Checkpoint)
			if err := json.Unmarshal(v, ck); err != nil {
				return fmt.Errorf("decode checkpoint %q: %w", k, err)
			}
			out = append(out, ck)
		}
		return nil
	})
	sort.Slice(out, func(i, j int) bool { return out[i].CreatedAt.Before(out[j].CreatedAt) })
	return out, err
}

// PutVolume inserts or replaces a volume record (volume.Store).
func (s *Store) PutVolume(_ context.Context, v *volume.Volume) error {
	return put(s.gc, bucketVolumes, v.ID, v)
}

// GetVolume returns a volume record (ErrNotFound if absent).
func (s *Store) GetVolume(_ context.Context, id string) (*volume.Volume, error) {
	v := new(volume.Volume)
	if err := get(s.db, bucketVolumes, id, v); err != nil {
		return nil, err
	}
	return v, nil
}

// DeleteVolume removes a volume record.
func (s *Store) DeleteVolume(_ context.Context, id string) error { return del(s.gc, bucketVolumes, id) }

// ListVolumes returns every volume record, oldest first.
func (s *Store) ListVolumes(_ context.Context) ([]*volume.Volume, error) {
	out, err := all[volume.Volume](s.db, bucketVolumes)
	sort.Slice(out, func(i, j int) bool { return out[i].CreatedAt.Before(out[j].CreatedAt) })
	return out, err
}

// PutSecret inserts or replaces a secret record (secret.Store; its value is sealed).
func (s *Store) PutSecret(_ context.Context, v *secret.Secret) error {
	return put(s.gc, bucketSecrets, v.ID, v)
}

// GetSecret returns a secret record (ErrNotFound if absent).
func (s *Store) GetSecret(_ context.Context, id string) (*secret.Secret, error) {
	v := new(secret.Secret)
	if err := get(s.db, bucketSecrets, id, v); err != nil {
		return nil, err
	}
	return v, nil
}

// DeleteSecret removes a secret record.
func (s *Store) DeleteSecret(_ context.Context, id string) error { return del(s.gc, bucketSecrets, id) }

// ListSecrets returns every secret record.
func (s *Store) ListSecrets(_ context.Context) ([]*secret.Secret, error) {
	return all[secret.Secret](s.db, bucketSecrets)
}
