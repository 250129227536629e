package auth

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// countingBackend counts the lookups that reach the backend (etcd's linearizable reads in a
// cluster).
type countingBackend struct {
	Backend
	lookups atomic.Int64
}

func (c *countingBackend) GetKeyByHash(ctx context.Context, hash string) (*Key, error) {
	c.lookups.Add(1)
	return c.Backend.GetKeyByHash(ctx, hash)
}

// An unknown key is remembered as unknown for a moment: a flood of requests with made-up keys
// costs one backend lookup per key and period, not one per request; a key created here is
// known at once, and one created elsewhere after the period.
func TestUnknownKeysAreCachedBriefly(t *testing.T) {
	b := &countingBackend{Backend: NewMemoryBackend()}
	keys := NewKeys(b)
	now := time.Now()
	keys.now = func() time.Time { return now }
	ctx := context.Background()
	bogus, _ := GenerateKey()
	for i := 0; i < 100; i++ {
		if _, err := keys.Verify(ctx, bogus); !errors.Is(err, errdefs.ErrUnauthorized) {
			t.Fatalf("unknown key: %v", err)
		}
	}
	if n := b.lookups.Load(); n != 1 {
		t.Fatalf("100 requests with one unknown key cost %d backend lookups", n)
	}
	// Registered on another node (straight into the backend): known once the period passed.
	if _, err := NewKeys(b.Backend).register(ctx, "elsewhere", DefaultTeamID, true, bogus); err != nil {
		t.Fatal(err)
	}
	now = now.Add(negativeTTL + time.Millisecond)
	if _, err := keys.Verify(ctx, bogus); err != nil {
		t.Fatalf("a key created elsewhere after the period: %v", err)
	}
	// Created on this node: known at once, even right after a miss.
	fresh, _ := GenerateKey()
	keys.Verify(ctx, fresh)
	if _, err := keys.register(ctx, "here", DefaultTeamID, true, fresh); err != nil {
		t.Fatal(err)
	}
	if _, err := keys.Verify(ctx, fresh); err != nil {
		t.Fatalf("a key created here right after a miss: %v", err)
	}
}
