package daemon

import (
	"context"
	"fmt"
	"net/netip"
	"sync"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/network"
	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/snapshot"
	"github.com/ember-sandbox/ember/internal/template"
)

// netAdapter presents network.Manager as sandbox.Network.
type netAdapter struct {
	m     *network.Manager
	mu    sync.Mutex
	slots map[int]*network.Slot
}

func (a *netAdapter) keep(s *network.Slot) sandbox.Slot {
	a.mu.Lock()
	a.slots[s.Index] = s
	a.mu.Unlock()
	return sandbox.Slot{Index: s.Index, NetNSPath: s.NetNSPath, GuestIP: s.GuestIP}
}

func slotOptions(e sandbox.Egress) network.SlotOptions {
	return network.SlotOptions{AllowInternet: e.AllowInternet, AllowOut: e.AllowOut, DenyOut: e.DenyOut}
}

func (a *netAdapter) Acquire(ctx context.Context, egress sandbox.Egress) (sandbox.Slot, error) {
	s, err := a.m.Acquire(ctx, slotOptions(egress))
	if err != nil {
		return sandbox.Slot{}, err
	}
	return a.keep(s), nil
}

func (a *netAdapter) Adopt(index int, egress sandbox.Egress) (sandbox.Slot, error) {
	s, err := a.m.Adopt(index, slotOptions(egress))
	if err != nil {
		return sandbox.Slot{}, err
	}
	return a.keep(s), nil
}

// Update replaces the egress rules of a held slot (sandbox.Manager.UpdateNetwork).
func (a *netAdapter) Update(ctx context.Context, index int, egress sandbox.Egress) error {
	a.mu.Lock()
	s := a.slots[index]
	a.mu.Unlock()
	if s == nil {
		return fmt.Errorf("network slot %d is not held: %w", index, errdefs.ErrNotFound)
	}
	return a.m.Update(ctx, s, slotOptions(egress))
}

func (a *netAdapter) Release(ctx context.Context, index int) error {
	a.mu.Lock()
	s := a.slots[index]
	delete(a.slots, index)
	a.mu.Unlock()
	if s == nil {
		return nil
	}
	return a.m.Release(ctx, s)
}

func (a *netAdapter) Reconcile(ctx context.Context, keep []int) error {
	return a.m.Reconcile(ctx, keep)
}

type builderAdapter struct{ b *template.Builder }

func (a *builderAdapter) BuildRootFS(ctx context.Context, req sandbox.BuildRequest, dest string, progress func(string)) (sandbox.RootFSInfo, error) {
	return sandbox.RootFSInfo{}, a.b.BuildRootFS(ctx, dest, progress)
}

// imageAdapter stores exported checkpoint images (flat directories of regular files, in the
// driver's format) in the snapshot store.
type imageAdapter struct{ s *snapshot.Store }

func (a *imageAdapter) Save(ctx context.Context, id, dir string) error {
	_, err := a.s.Save(ctx, id, dir)
	return err
}

func (a *imageAdapter) Fetch(ctx context.Context, id, dir string, unpack func(ctx context.Context, src, dst string) error) error {
	return a.s.Fetch(ctx, id, dir, snapshot.FetchImport(unpack))
}

func (a *imageAdapter) Delete(ctx context.Context, id string) error { return a.s.Delete(ctx, id) }

func parsePrefix(s string) (netip.Prefix, error) {
	p, err := netip.ParsePrefix(s)
	if err != nil {
		return p, fmt.Errorf("network.cidr: %w", err)
	}
	return p, nil
}
