package sandbox

import (
	"context"
)

// A fork's children need a network slot each. The node keeps a few made ahead
// (--slot-pool-size, 4 by default); the others of a fork into 16 used to be made by the
// children's own launches after the source's checkpoint, each a network namespace, a veth
// pair and nftables rules (issue 18: where a fork child's time goes beyond a raw restore).
// They are acquired while the source is checkpointed instead, and each child's launch takes
// its own (launchSpec.slot).

// slotsAhead holds the slots acquired for a fork's children: child i's arrives on its
// channel (nil when the acquisition failed: the child acquires its own). A nil slotsAhead
// holds none.
type slotsAhead []chan *Slot

// acquireSlotsAhead starts acquiring count slots for egress, as many at once as a fork
// restores children.
func (m *Manager) acquireSlotsAhead(ctx context.Context, count int, egress Egress) slotsAhead {
	ahead := make(slotsAhead, count)
	sem := make(chan struct{}, forkParallelism)
	for i := range ahead {
		ahead[i] = make(chan *Slot, 1)
		go func(ch chan *Slot) {
			sem <- struct{}{}
			defer func() { <-sem }()
			s, err := m.cfg.Network.Acquire(context.WithoutCancel(ctx), egress)
			if err != nil {
				m.log.Debug("fork: a slot acquired ahead failed; the child acquires its own", "err", err)
				ch <- nil
				return
			}
			ch <- &s
		}(ahead[i])
	}
	return ahead
}

// take waits for child i's slot (nil: none); the caller owns it from then on.
func (a slotsAhead) take(i int) *Slot {
	if i >= len(a) {
		return nil
	}
	return <-a[i]
}

// releaseAll waits for every slot of a fork that starts no child and releases it.
func (a slotsAhead) releaseAll(ctx context.Context, m *Manager) {
	for i := range a {
		if s := a.take(i); s != nil {
			if err := m.cfg.Network.Release(context.WithoutCancel(ctx), s.Index); err != nil {
				m.log.Warn("release a fork's slot acquired ahead", "slot", s.Index, "err", err)
			}
		}
	}
}
