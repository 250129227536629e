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
	mu   sync.Mutex
	keys map[string]*Key // by id
}

// NewMemoryBackend returns an empty in-memory Backend.
func NewMemoryBackend() *MemoryBackend {
	return &MemoryBackend{keys: map[string]*Key{}}
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
