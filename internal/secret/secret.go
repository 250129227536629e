// Package secret is ember's secrets (E2B's Secret API): named values that code in a sandbox
// never sees. A value is written once through the API (create, update), never returned by any
// read, and used only by the node's egress proxy, which puts it into the headers of a
// sandbox's outbound requests where a network rule's transform names it as
// `${e2b.secrets.<name>}` (Resolve, Expand).
//
// At rest a record (<data-dir>/store.db, bucket "secrets") holds the value sealed with the
// node's secrets key (AES-256-GCM, the sealing helpers of internal/cluster, the record's id as
// additional data), which lives in <data-dir>/secrets.key (0600, made on first start) and
// nowhere else: a copy of the store alone reveals no value.
//
// In a cluster (UseCluster) the records are the cluster's instead, so that a secret made
// through any node resolves on every node: etcd records under secrets/<id>, sealed whole with
// the cluster key (cluster.SealedRecords), the value inside sealed again with a key derived
// from the cluster secret (HKDF-SHA256), which every node has and etcd holds only sealed (or
// not at all, with --cluster-secret-file). A node's own secrets from before it joined are
// copied to the cluster when it joins (those whose owner has no secret of that name there).
//
// Records are owned: every call takes the owner string internal/api derives from the request
// (the team, once ember has teams), and a secret of another owner is not found.
package secret

import (
	"context"
	"crypto/hkdf"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"regexp"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/errdefs"
)

// Limits of one secret and of an owner's secrets.
const (
	MaxValueBytes = 16 << 10
	MaxMetadata   = 64
	MaxPerOwner   = 1000
)

// Secret is one secret's record. Sealed is the value sealed with the node's key; nothing else
// in the record is secret.
type Secret struct {
	ID        string            `json:"id"`
	Name      string            `json:"name"`
	Owner     string            `json:"owner,omitempty"`
	Version   int               `json:"version"`
	Metadata  map[string]string `json:"metadata,omitempty"`
	CreatedAt time.Time         `json:"createdAt"`
	UpdatedAt time.Time         `json:"updatedAt"`
	Sealed    []byte            `json:"sealed"`
}

// Store keeps secret records (internal/store implements it).
type Store interface {
	PutSecret(ctx context.Context, s *Secret) error
	GetSecret(ctx context.Context, id string) (*Secret, error)
	DeleteSecret(ctx context.Context, id string) error
	ListSecrets(ctx context.Context) ([]*Secret, error)
}

// Manager creates, finds, updates and destroys secrets and resolves them for the egress proxy.
type Manager struct {
	be  atomic.Pointer[backend]
	log *slog.Logger
	// mu serialises writes (names are unique per owner).
	mu sync.Mutex
}

// backend is where records are and the key their values are sealed with.
type backend struct {
	st  Store
	key *cluster.SealKey
}

// Open returns the secrets of st, sealed with the key in keyFile (made, 0600, if absent).
func Open(st Store, keyFile string, log *slog.Logger) (*Manager, error) {
	if log == nil {
		log = slog.Default()
	}
	if _, err := os.Stat(keyFile); errors.Is(err, os.ErrNotExist) {
		b := make([]byte, 32)
		if _, err := rand.Read(b); err != nil {
			return nil, err
		}
		f, err := os.OpenFile(keyFile, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			return nil, fmt.Errorf("secrets key: %w", err)
		}
		_, werr := f.WriteString(hex.EncodeToString(b) + "\n")
		if err := errors.Join(werr, f.Sync(), f.Close()); err != nil {
			return nil, fmt.Errorf("secrets key: %w", err)
		}
	}
	key, err := cluster.LoadSealKey(keyFile)
	if err != nil {
		return nil, err
	}
	m := &Manager{log: log}
	m.be.Store(&backend{st: st, key: key})
	return m, nil
}

// clusterKeyInfo is the HKDF info of the key secrets' values are sealed with in a cluster.
const clusterKeyInfo = "ember secrets v1"

// clusterBackend is the cluster's secrets: sealed records in etcd, values sealed with a key
// derived from the cluster secret.
func clusterBackend(cl *cluster.Cluster) (*backend, error) {
	k, err := hkdf.Key(sha256.New, cl.Secret(), nil, clusterKeyInfo, 32)
	if err != nil {
		return nil, err
	}
	key, err := cluster.NewSealKey(k)
	if err != nil {
		return nil, err
	}
	return &backend{st: clusterStore{cl.SealedRecords("secrets", "secret")}, key: key}, nil
}

// NewCluster returns the secrets of cl.
func NewCluster(cl *cluster.Cluster, log *slog.Logger) (*Manager, error) {
	if log == nil {
		log = slog.Default()
	}
	be, err := clusterBackend(cl)
	if err != nil {
		return nil, err
	}
	m := &Manager{log: log}
	m.be.Store(be)
	return m, nil
}

// UseCluster makes m serve the secrets of cl (the node joined it), after copying there the
// secrets m held that cl lacks (same owner and name), re-sealed with the cluster's key.
func (m *Manager) UseCluster(ctx context.Context, cl *cluster.Cluster) error {
	to, err := clusterBackend(cl)
	if err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	from := m.be.Load()
	mine, err := from.st.ListSecrets(ctx)
	if err != nil {
		return err
	}
	theirs, err := to.st.ListSecrets(ctx)
	if err != nil {
		return err
	}
	have := map[[2]string]bool{}
	for _, s := range theirs {
		have[[2]string{s.Owner, s.Name}] = true
	}
	for _, s := range mine {
		if have[[2]string{s.Owner, s.Name}] {
			continue
		}
		v, err := from.key.Open(sealAD(s.ID), s.Sealed)
		if err != nil {
			m.log.Warn("secret not copied to the cluster: it does not open", "secret_id", s.ID, "err", err)
			continue
		}
		c := *s
		c.Sealed = to.key.Seal(sealAD(s.ID), v)
		if err := to.st.PutSecret(ctx, &c); errors.Is(err, errdefs.ErrConflict) {
			continue // another node copied one of that name a moment ago
		} else if err != nil {
			return err
		}
		m.log.Info("secret copied to the cluster", "secret_id", s.ID)
	}
	m.be.Store(to)
	return nil
}

// clusterStore keeps secret records in etcd (cluster.Records, sealed), each owner's names
// claimed with them: two nodes never make two secrets of one name.
type clusterStore struct{ r *cluster.Records }

func (c clusterStore) PutSecret(ctx context.Context, s *Secret) error {
	err := c.r.PutNamed(ctx, s.ID, []string{s.Owner, s.Name}, s)
	if errors.Is(err, errdefs.ErrConflict) {
		return fmt.Errorf("secret with name %q already exists: %w", s.Name, errdefs.ErrConflict)
	}
	return err
}

func (c clusterStore) GetSecret(ctx context.Context, id string) (*Secret, error) {
	s := new(Secret)
	if err := c.r.Get(ctx, id, s); err != nil {
		return nil, err
	}
	return s, nil
}

func (c clusterStore) DeleteSecret(ctx context.Context, id string) error {
	s, err := c.GetSecret(ctx, id)
	if err != nil {
		return err
	}
	return c.r.DeleteNamed(ctx, id, []string{s.Owner, s.Name})
}

func (c clusterStore) ListSecrets(ctx context.Context) ([]*Secret, error) {
	return cluster.ListOf[Secret](ctx, c.r)
}

var nameRe = regexp.MustCompile(`^[A-Za-z0-9_-]{1,128}$`)

// ValidName reports whether name can be a secret's name (and so appear in a placeholder).
func ValidName(name string) bool { return nameRe.MatchString(name) }

func validate(name, value string, meta map[string]string) error {
	if !ValidName(name) {
		return fmt.Errorf("secret name %q: 1 to 128 letters, digits, '-' or '_': %w", name, errdefs.ErrInvalid)
	}
	return validateValue(value, meta)
}

func validateValue(value string, meta map[string]string) error {
	switch {
	case value == "":
		return fmt.Errorf("secret value is required: %w", errdefs.ErrInvalid)
	case len(value) > MaxValueBytes:
		return fmt.Errorf("secret value is %d bytes, at most %d: %w", len(value), MaxValueBytes, errdefs.ErrInvalid)
	case strings.ContainsAny(value, "\r\n\x00"):
		// Values go into HTTP headers: a line break would inject headers of its own.
		return fmt.Errorf("secret value must not contain CR, LF or NUL: %w", errdefs.ErrInvalid)
	case len(meta) > MaxMetadata:
		return fmt.Errorf("secret metadata has %d entries, at most %d: %w", len(meta), MaxMetadata, errdefs.ErrInvalid)
	}
	return nil
}

func newID() string {
	b := make([]byte, 10)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return "sec_" + hex.EncodeToString(b)
}

// sealAD is the additional data a record's value is sealed with: a sealed value copied into
// another record does not open.
func sealAD(id string) string { return "ember/secret/" + id }

// Create stores a new secret (version 1). A name the owner already uses is ErrConflict.
func (m *Manager) Create(ctx context.Context, owner, name, value string, meta map[string]string) (*Secret, error) {
	if err := validate(name, value, meta); err != nil {
		return nil, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	mine, err := m.owned(ctx, owner)
	if err != nil {
		return nil, err
	}
	if len(mine) >= MaxPerOwner {
		return nil, fmt.Errorf("at most %d secrets: %w", MaxPerOwner, errdefs.ErrExhausted)
	}
	for _, s := range mine {
		if s.Name == name {
			return nil, fmt.Errorf("secret with name %q already exists: %w", name, errdefs.ErrConflict)
		}
	}
	now := time.Now().UTC()
	s := &Secret{ID: newID(), Name: name, Owner: owner, Version: 1, Metadata: meta, CreatedAt: now, UpdatedAt: now}
	s.Sealed = m.be.Load().key.Seal(sealAD(s.ID), []byte(value))
	if err := m.be.Load().st.PutSecret(ctx, s); err != nil {
		return nil, err
	}
	m.log.Info("secret created", "secret_id", s.ID, "name", name)
	return s, nil
}

// Update stores value as the secret's next version; meta, when not nil, replaces the metadata.
func (m *Manager) Update(ctx context.Context, owner, idOrName, value string, meta map[string]string) (*Secret, error) {
	if err := validateValue(value, meta); err != nil {
		return nil, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	s, err := m.find(ctx, owner, idOrName)
	if err != nil {
		return nil, err
	}
	s.Version++
	s.UpdatedAt = time.Now().UTC()
	if meta != nil {
		s.Metadata = meta
	}
	s.Sealed = m.be.Load().key.Seal(sealAD(s.ID), []byte(value))
	if err := m.be.Load().st.PutSecret(ctx, s); err != nil {
		return nil, err
	}
	m.log.Info("secret updated", "secret_id", s.ID, "version", s.Version)
	return s, nil
}

// Get returns a secret's record by id or name (ErrNotFound if the owner has none).
func (m *Manager) Get(ctx context.Context, owner, idOrName string) (*Secret, error) {
	return m.find(ctx, owner, idOrName)
}

// List returns the owner's secrets, oldest first.
func (m *Manager) List(ctx context.Context, owner string) ([]*Secret, error) {
	return m.owned(ctx, owner)
}

// Destroy removes a secret by id or name.
func (m *Manager) Destroy(ctx context.Context, owner, idOrName string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	s, err := m.find(ctx, owner, idOrName)
	if err != nil {
		return err
	}
	if err := m.be.Load().st.DeleteSecret(ctx, s.ID); err != nil {
		return err
	}
	m.log.Info("secret destroyed", "secret_id", s.ID)
	return nil
}

// Resolve returns the value of the owner's secret named name.
func (m *Manager) Resolve(ctx context.Context, owner, name string) (string, error) {
	s, err := m.find(ctx, owner, name)
	if err != nil {
		return "", err
	}
	v, err := m.be.Load().key.Open(sealAD(s.ID), s.Sealed)
	if err != nil {
		return "", err
	}
	return string(v), nil
}

// placeholderRe is `${e2b.secrets.<name>}` (Secret.fill).
var placeholderRe = regexp.MustCompile(`\$\{e2b\.secrets\.([A-Za-z0-9_-]+)\}`)

// Names returns the secret names s refers to.
func Names(s string) []string {
	var out []string
	for _, m := range placeholderRe.FindAllStringSubmatch(s, -1) {
		out = append(out, m[1])
	}
	return out
}

// Expand replaces every `${e2b.secrets.<name>}` of s with the owner's secret's value. A name
// the owner has no secret for is an error (the request is not sent half-filled).
func (m *Manager) Expand(ctx context.Context, owner, s string) (string, error) {
	var firstErr error
	out := placeholderRe.ReplaceAllStringFunc(s, func(p string) string {
		name := placeholderRe.FindStringSubmatch(p)[1]
		v, err := m.Resolve(ctx, owner, name)
		if err != nil && firstErr == nil {
			firstErr = fmt.Errorf("secret %q: %w", name, err)
		}
		return v
	})
	if firstErr != nil {
		return "", firstErr
	}
	return out, nil
}

func (m *Manager) owned(ctx context.Context, owner string) ([]*Secret, error) {
	all, err := m.be.Load().st.ListSecrets(ctx)
	if err != nil {
		return nil, err
	}
	var out []*Secret
	for _, s := range all {
		if s.Owner == owner {
			out = append(out, s)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].CreatedAt.Before(out[j].CreatedAt) })
	return out, nil
}

func (m *Manager) find(ctx context.Context, owner, idOrName string) (*Secret, error) {
	if s, err := m.be.Load().st.GetSecret(ctx, idOrName); err == nil && s.Owner == owner {
		return s, nil
	}
	mine, err := m.owned(ctx, owner)
	if err != nil {
		return nil, err
	}
	for _, s := range mine {
		if s.Name == idOrName {
			return s, nil
		}
	}
	return nil, fmt.Errorf("secret %s not found: %w", idOrName, errdefs.ErrNotFound)
}
