// Package auth owns ember's API keys (E2B-shaped `e2b_<40 hex>` keys, stored only as sha256
// hashes) and the envd file-URL signatures that let a signed /files URL act as a credential. It
// must not know about HTTP routing or sandboxes; internal/api calls it and the metadata store
// implements its Backend.
package auth

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/ember-sandbox/ember/internal/datadir"
	"github.com/ember-sandbox/ember/internal/errdefs"
)

// KeyPrefix starts every API key, as in E2B (some SDKs check the format `^e2b_[0-9a-f]+$`).
const KeyPrefix = "e2b_"

// keyHexLen is the number of hex characters after the prefix (20 random bytes).
const keyHexLen = 40

var keyFormat = regexp.MustCompile(`^e2b_[0-9a-f]{40}$`)

// Key is a stored API key. The plaintext is never stored: Hash is the hex sha256 of it.
type Key struct {
	ID        string    `json:"id"`
	Name      string    `json:"name"`
	Hash      string    `json:"hash"`
	Mask      string    `json:"mask"`
	CreatedAt time.Time `json:"createdAt"`
	// Team is the team the key belongs to ("" in a record of an ember without teams: the
	// default team's, as an admin key). Admin keys manage teams and every team's keys.
	Team  string `json:"team,omitempty"`
	Admin bool   `json:"admin,omitempty"`
}

// Caller is who a request with this key acts for.
func (k *Key) Caller() Caller {
	if k.Team == "" {
		return Caller{Team: DefaultTeamID, Admin: true, KeyID: k.ID}
	}
	return Caller{Team: k.Team, Admin: k.Admin, KeyID: k.ID}
}

// Backend persists keys. GetKeyByHash and DeleteKey return an error wrapping errdefs.ErrNotFound
// when there is no such key.
type Backend interface {
	PutKey(ctx context.Context, k *Key) error
	GetKeyByHash(ctx context.Context, hash string) (*Key, error)
	ListKeys(ctx context.Context) ([]*Key, error)
	DeleteKey(ctx context.Context, id string) error
}

// Keys creates, verifies, lists and revokes API keys.
type Keys struct {
	b   Backend
	now func() time.Time

	// unknown remembers keys (by hash) the backend did not know, until when: a flood of
	// made-up keys costs one backend lookup (a linearizable etcd read in a cluster) per key
	// and negativeTTL, not one per request. Bounded: cleared when full.
	mu      sync.Mutex
	unknown map[string]time.Time
}

// negativeTTL is how long an unknown key is remembered as unknown (a key created on another
// node works here after at most this long; one created on this node at once).
const negativeTTL = 2 * time.Second

// maxUnknown bounds the unknown keys remembered.
const maxUnknown = 100000

// NewKeys returns the key service over a backend.
func NewKeys(b Backend) *Keys {
	return &Keys{b: b, now: time.Now, unknown: map[string]time.Time{}}
}

func (k *Keys) knownUnknown(hash string) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	until, ok := k.unknown[hash]
	if ok && k.now().After(until) {
		delete(k.unknown, hash)
		return false
	}
	return ok
}

func (k *Keys) rememberUnknown(hash string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if len(k.unknown) >= maxUnknown {
		clear(k.unknown)
	}
	k.unknown[hash] = k.now().Add(negativeTTL)
}

func (k *Keys) forgetUnknown(hash string) {
	k.mu.Lock()
	delete(k.unknown, hash)
	k.mu.Unlock()
}

// HashKey returns the stored form of a plaintext key (hex sha256).
func HashKey(plaintext string) string {
	sum := sha256.Sum256([]byte(plaintext))
	return hex.EncodeToString(sum[:])
}

// ValidKeyFormat reports whether s looks like a key ember issues.
func ValidKeyFormat(s string) bool { return keyFormat.MatchString(s) }

// MaskKey returns the display form of a key, e.g. "e2b_ab…ef12".
func MaskKey(plaintext string) string {
	body := strings.TrimPrefix(plaintext, KeyPrefix)
	if len(body) < 8 {
		return KeyPrefix + "…"
	}
	return KeyPrefix + body[:2] + "…" + body[len(body)-4:]
}

// GenerateKey returns a fresh random plaintext key.
func GenerateKey() (string, error) {
	b := make([]byte, keyHexLen/2)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("generate api key: %w", err)
	}
	return KeyPrefix + hex.EncodeToString(b), nil
}

func newKeyID() (string, error) {
	b := make([]byte, 8)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("generate key id: %w", err)
	}
	return hex.EncodeToString(b), nil
}

// MaxNameLen bounds a key's name.
const MaxNameLen = 128

// Create issues a new admin key of the default team. The plaintext is returned once and never
// again.
func (k *Keys) Create(ctx context.Context, name string) (string, *Key, error) {
	return k.CreateFor(ctx, name, DefaultTeamID, true)
}

// CreateFor issues a new key of a team (which must exist when the store keeps teams).
func (k *Keys) CreateFor(ctx context.Context, name, team string, admin bool) (string, *Key, error) {
	if tb, ok := k.b.(TeamBackend); ok && team != DefaultTeamID {
		if _, err := tb.GetTeam(ctx, team); err != nil {
			return "", nil, err
		}
	}
	plaintext, err := GenerateKey()
	if err != nil {
		return "", nil, err
	}
	key, err := k.register(ctx, name, team, admin, plaintext)
	if err != nil {
		return "", nil, err
	}
	return plaintext, key, nil
}

func (k *Keys) register(ctx context.Context, name, team string, admin bool, plaintext string) (*Key, error) {
	name = strings.TrimSpace(name)
	if name == "" {
		name = "default"
	}
	if len(name) > MaxNameLen {
		return nil, fmt.Errorf("key name longer than %d bytes: %w", MaxNameLen, errdefs.ErrInvalid)
	}
	id, err := newKeyID()
	if err != nil {
		return nil, err
	}
	key := &Key{
		ID:        id,
		Name:      name,
		Hash:      HashKey(plaintext),
		Mask:      MaskKey(plaintext),
		CreatedAt: k.now().UTC(),
		Team:      team,
		Admin:     admin,
	}
	if err := k.b.PutKey(ctx, key); err != nil {
		return nil, fmt.Errorf("store api key: %w", err)
	}
	k.forgetUnknown(key.Hash)
	return key, nil
}

// Verify returns the key when plaintext is a live key, else an error wrapping
// errdefs.ErrUnauthorized (or the backend's failure).
func (k *Keys) Verify(ctx context.Context, plaintext string) (*Key, error) {
	if !ValidKeyFormat(plaintext) {
		return nil, fmt.Errorf("malformed api key: %w", errdefs.ErrUnauthorized)
	}
	hash := HashKey(plaintext)
	if k.knownUnknown(hash) {
		return nil, fmt.Errorf("unknown api key: %w", errdefs.ErrUnauthorized)
	}
	key, err := k.b.GetKeyByHash(ctx, hash)
	if errors.Is(err, errdefs.ErrNotFound) {
		k.rememberUnknown(hash)
		return nil, fmt.Errorf("unknown api key: %w", errdefs.ErrUnauthorized)
	}
	if err != nil {
		return nil, fmt.Errorf("look up api key: %w", err)
	}
	// The lookup is by hash; compare again in constant time so a backend that matches loosely
	// (prefix, case) cannot let a wrong key through.
	if subtle.ConstantTimeCompare([]byte(key.Hash), []byte(hash)) != 1 {
		return nil, fmt.Errorf("unknown api key: %w", errdefs.ErrUnauthorized)
	}
	return key, nil
}

// List returns the keys (without plaintext) of team ("" = every team's), oldest first as the
// backend orders them.
func (k *Keys) List(ctx context.Context, team string) ([]*Key, error) {
	all, err := k.b.ListKeys(ctx)
	if err != nil || team == "" {
		return all, err
	}
	out := all[:0]
	for _, key := range all {
		if key.Caller().Team == team {
			out = append(out, key)
		}
	}
	return out, nil
}

// Revoke deletes a key of team ("" = of any team; a key of another team is not found).
// Revoking the last remaining admin key is refused (errdefs.ErrConflict) so the daemon cannot
// be locked out by accident.
func (k *Keys) Revoke(ctx context.Context, id, team string) error {
	keys, err := k.b.ListKeys(ctx)
	if err != nil {
		return err
	}
	var found *Key
	admins := 0
	for _, key := range keys {
		if key.Caller().Admin {
			admins++
		}
		if key.ID == id && (team == "" || key.Caller().Team == team) {
			found = key
		}
	}
	if found == nil {
		return fmt.Errorf("api key %q: %w", id, errdefs.ErrNotFound)
	}
	if found.Caller().Admin && admins == 1 {
		return fmt.Errorf("api key %q is the last admin key; create another first: %w", id, errdefs.ErrConflict)
	}
	return k.b.DeleteKey(ctx, id)
}

// EnsureInitialKey makes sure the default team exists (moving the keys of an ember without
// teams into it as its admin keys) and at least one key exists. When the store has none it issues one
// (or re-registers the key already written in <dataDir>/api-key, so a wiped store keeps the
// user's configured key working) as the default team's admin key, writes it to <dataDir>/api-key with mode 0600 and returns it
// with created=true so the daemon can print it once. When keys exist it returns "", false.
func (k *Keys) EnsureInitialKey(ctx context.Context, dataDir string) (plaintext string, created bool, err error) {
	if err := k.ensureDefaultTeam(ctx); err != nil {
		return "", false, err
	}
	keys, err := k.b.ListKeys(ctx)
	if err != nil {
		return "", false, fmt.Errorf("list api keys: %w", err)
	}
	if len(keys) > 0 {
		return "", false, nil
	}
	path := datadir.APIKey(dataDir)
	if b, rerr := os.ReadFile(path); rerr == nil && ValidKeyFormat(strings.TrimSpace(string(b))) {
		plaintext = strings.TrimSpace(string(b))
	} else {
		if plaintext, err = GenerateKey(); err != nil {
			return "", false, err
		}
	}
	if err := writeFileAtomic(path, []byte(plaintext+"\n"), 0o600); err != nil {
		return "", false, err
	}
	if _, err := k.register(ctx, "initial", DefaultTeamID, true, plaintext); err != nil {
		return "", false, err
	}
	return plaintext, true, nil
}

func writeFileAtomic(path string, data []byte, mode os.FileMode) error {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	f, err := os.CreateTemp(dir, ".api-key-*")
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	tmp := f.Name()
	defer os.Remove(tmp) // no-op after a successful rename
	if err := f.Chmod(mode); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}
