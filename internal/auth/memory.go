package auth

import (
	"context"
	"fmt"
	"sort"
	"sync"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// MemoryBackend keeps keys in memory. It is for tests and for running without a store.
type MemoryBackend struct {
	mu    sync.Mutex
	keys  map[string]*Key  // by id
	teams map[string]*Team // by id
}

// NewMemoryBackend returns an empty in-memory Backend.
func NewMemoryBackend() *MemoryBackend {
	return &MemoryBackend{keys: map[string]*Key{}, teams: map[string]*Team{}}
}

// PutKey stores (or replaces) a key.
func (m *MemoryBackend) PutKey(_ context.Context, k *Key) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	c := *k
	m.keys[k.ID] = &c
	return nil
}

// GetKeyByHash finds a key by its hash.
func (m *MemoryBackend) GetKeyByHash(_ context.Context, hash string) (*Key, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, k := range m.keys {
		if k.Hash == hash {
			c := *k
			return &c, nil
		}
	}
	return nil, fmt.Errorf("api key: %w", errdefs.ErrNotFound)
}

// ListKeys returns all keys, oldest first.
func (m *MemoryBackend) ListKeys(_ context.Context) ([]*Key, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]*Key, 0, len(m.keys))
	for _, k := range m.keys {
		c := *k
		out = append(out, &c)
	}
	sort.Slice(out, func(i, j int) bool {
		if !out[i].CreatedAt.Equal(out[j].CreatedAt) {
			return out[i].CreatedAt.Before(out[j].CreatedAt)
		}
		return out[i].ID < out[j].ID
	})
	return out, nil
}

// DeleteKey removes a key by id.
func (m *MemoryBackend) DeleteKey(_ context.Context, id string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.keys[id]; !ok {
		return fmt.Errorf("api key %q: %w", id, errdefs.ErrNotFound)
	}
	delete(m.keys, id)
	return nil
}

// PutTeam stores (or replaces) a team.
func (m *MemoryBackend) PutTeam(_ context.Context, t *Team) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	c := *t
	m.teams[t.ID] = &c
	return nil
}

// GetTeam finds a team by id.
func (m *MemoryBackend) GetTeam(_ context.Context, id string) (*Team, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	t, ok := m.teams[id]
	if !ok {
		return nil, fmt.Errorf("team %q: %w", id, errdefs.ErrNotFound)
	}
	c := *t
	return &c, nil
}

// ListTeams returns all teams, oldest first.
func (m *MemoryBackend) ListTeams(_ context.Context) ([]*Team, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]*Team, 0, len(m.teams))
	for _, t := range m.teams {
		c := *t
		out = append(out, &c)
	}
	SortTeams(out)
	return out, nil
}

// DeleteTeam removes a team by id.
func (m *MemoryBackend) DeleteTeam(_ context.Context, id string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.teams[id]; !ok {
		return fmt.Errorf("team %q: %w", id, errdefs.ErrNotFound)
	}
	delete(m.teams, id)
	return nil
}
