package sandbox

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"time"
)

// pool keeps, per template, up to Config.PoolSize sandboxes restored from the template's
// checkpoint but not yet assigned, so that Create is an assignment plus envd /init. It refills
// in the background. Pooled instances have internet access enabled (the default); a create
// that asks for none restores normally.
type pool struct {
	m     *Manager
	mu    sync.Mutex
	ready map[string][]*pooled // by template id
	kick  chan struct{}
	stop  chan struct{}
	wg    sync.WaitGroup
}

type pooled struct {
	buildID  string
	instance string
	slot     Slot
	stateDir string
}

func newPool(m *Manager) *pool {
	return &pool{m: m, ready: map[string][]*pooled{}, kick: make(chan struct{}, 1), stop: make(chan struct{})}
}

func (p *pool) start() {
	if p.m.cfg.PoolSize <= 0 {
		return
	}
	p.wg.Add(1)
	go p.loop()
	p.poke()
}

func (p *pool) poke() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

func (p *pool) close() {
	close(p.stop)
	p.wg.Wait()
	p.mu.Lock()
	defer p.mu.Unlock()
	for id, list := range p.ready {
		for _, pe := range list {
			p.discard(pe)
		}
		delete(p.ready, id)
	}
}

func (p *pool) discard(pe *pooled) {
	ctx := context.Background()
	p.m.cfg.Driver.Delete(ctx, pe.instance)
	p.m.cfg.Network.Release(ctx, pe.slot.Index)
	os.RemoveAll(pe.stateDir)
}

// take returns a ready sandbox of tpl's current build, or nil.
func (p *pool) take(tpl *Template, allowInternet bool) *pooled {
	if p.m.cfg.PoolSize <= 0 || !allowInternet || tpl.Kind != "template" {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	list := p.ready[tpl.ID]
	for len(list) > 0 {
		pe := list[0]
		list = list[1:]
		if pe.buildID == tpl.BuildID {
			p.ready[tpl.ID] = list
			p.poke()
			return pe
		}
		go p.discard(pe)
	}
	p.ready[tpl.ID] = list
	p.poke()
	return nil
}

// templateChanged drops pooled sandboxes of a rebuilt or deleted template.
func (p *pool) templateChanged(tpl *Template) {
	p.mu.Lock()
	list := p.ready[tpl.ID]
	delete(p.ready, tpl.ID)
	p.mu.Unlock()
	for _, pe := range list {
		p.discard(pe)
	}
	p.poke()
}

func (p *pool) loop() {
	defer p.wg.Done()
	t := time.NewTicker(2 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-p.stop:
			return
		case <-p.kick:
		case <-t.C:
		}
		p.fill()
	}
}

func (p *pool) fill() {
	ctx := context.Background()
	tpls, err := p.m.cfg.Store.ListTemplates(ctx)
	if err != nil {
		return
	}
	for _, tpl := range tpls {
		if tpl.Kind != "template" || !tpl.Ready || tpl.Image == "" {
			continue
		}
		for {
			select {
			case <-p.stop:
				return
			default:
			}
			p.mu.Lock()
			n := len(p.ready[tpl.ID])
			p.mu.Unlock()
			if n >= p.m.cfg.PoolSize {
				break
			}
			pe, err := p.restore(ctx, tpl)
			if err != nil {
				p.m.log.Warn("pool refill failed", "template_id", tpl.ID, "err", err)
				break
			}
			p.mu.Lock()
			p.ready[tpl.ID] = append(p.ready[tpl.ID], pe)
			p.mu.Unlock()
		}
	}
}

func (p *pool) restore(ctx context.Context, tpl *Template) (*pooled, error) {
	m := p.m
	slot, err := m.cfg.Network.Acquire(ctx, Egress{AllowInternet: true})
	if err != nil {
		return nil, err
	}
	sb := &Sandbox{ID: "p" + newID()[1:], CPUCount: orDefault(tpl.CPUCount, m.cfg.CPUCount), MemoryMB: orDefault(tpl.MemoryMB, m.cfg.MemoryMB)}
	inst := instanceID(sb.ID)
	spec := m.spec(sb, tpl, slot, inst)
	spec.StateDir = filepath.Join(m.cfg.DataDir, "pool", inst)
	pe := &pooled{buildID: tpl.BuildID, instance: inst, slot: slot, stateDir: spec.StateDir}
	if err := os.MkdirAll(spec.StateDir, 0o755); err != nil {
		p.discard(pe)
		return nil, err
	}
	if err := m.cfg.Driver.Restore(ctx, spec, tpl.Image); err != nil {
		p.discard(pe)
		return nil, err
	}
	if err := m.waitEnvd(ctx, fmt.Sprintf("http://%s", netip.AddrPortFrom(slot.GuestIP, EnvdPort))); err != nil {
		p.discard(pe)
		return nil, err
	}
	return pe, nil
}

// assign makes a pooled instance sandbox sb: /init gives it sb's identity.
func (m *Manager) assign(ctx context.Context, sb *Sandbox, pe *pooled, initToken string) error {
	base := fmt.Sprintf("http://%s", netip.AddrPortFrom(pe.slot.GuestIP, EnvdPort))
	if err := m.initEnvd(ctx, base, sb, initToken); err != nil {
		m.pool.discard(pe)
		return err
	}
	sb.Runtime = Placement{
		Driver:     m.cfg.Driver.Name(),
		InstanceID: pe.instance,
		SlotIndex:  pe.slot.Index,
		GuestIP:    pe.slot.GuestIP.String(),
		StateDir:   pe.stateDir,
	}
	m.guestT.open(sb.Runtime.GuestIP)
	return nil
}
