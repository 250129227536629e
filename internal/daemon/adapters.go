package daemon

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
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

func (a *builderAdapter) BuildRootFS(ctx context.Context, dest string, progress func(string)) error {
	return a.b.BuildRootFS(ctx, dest, progress)
}

// imageAdapter stores checkpoint images in the snapshot store. An image may hold the instance's
// writable layer (an overlayfs upper: symlinks, whiteout devices, xattrs, owners), which the
// chunk store does not represent file by file: the layer travels as one tar file, chunked and
// deduplicated like the memory image.
type imageAdapter struct{ s *snapshot.Store }

const layerTar = "layer.tar"

func (a *imageAdapter) Save(ctx context.Context, id, dir string) error {
	layer := filepath.Join(dir, "layer")
	if _, err := os.Stat(layer); err != nil {
		_, err := a.s.Save(ctx, id, dir)
		return err
	}
	stage, err := os.MkdirTemp(filepath.Dir(dir), "."+filepath.Base(dir)+".stage-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(stage)
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if e.Type().IsRegular() {
			if err := os.Link(filepath.Join(dir, e.Name()), filepath.Join(stage, e.Name())); err != nil {
				return err
			}
		}
	}
	out, err := exec.CommandContext(ctx, "tar", "--xattrs", "--xattrs-include=*", "--numeric-owner",
		"-C", layer, "-cf", filepath.Join(stage, layerTar), "upper").CombinedOutput()
	if err != nil {
		return fmt.Errorf("pack layer: %v: %s", err, out)
	}
	_, err = a.s.Save(ctx, id, stage)
	return err
}

func (a *imageAdapter) Load(ctx context.Context, id, dir string) error {
	if err := a.s.Load(ctx, id, dir); err != nil {
		return err
	}
	tarPath := filepath.Join(dir, layerTar)
	if _, err := os.Stat(tarPath); err != nil {
		return nil
	}
	layer := filepath.Join(dir, "layer")
	if err := os.MkdirAll(layer, 0o755); err != nil {
		return err
	}
	out, err := exec.CommandContext(ctx, "tar", "--xattrs", "--xattrs-include=*", "--numeric-owner",
		"-xpf", tarPath, "-C", layer).CombinedOutput()
	if err != nil {
		os.RemoveAll(dir)
		return fmt.Errorf("unpack layer: %v: %s", err, out)
	}
	return os.Remove(tarPath)
}

func (a *imageAdapter) Delete(ctx context.Context, id string) error { return a.s.Delete(ctx, id) }

func parsePrefix(s string) (netip.Prefix, error) {
	p, err := netip.ParsePrefix(s)
	if err != nil {
		return p, fmt.Errorf("network.cidr: %w", err)
	}
	return p, nil
}
