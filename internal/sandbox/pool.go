package sandbox

import (
	"context"
	"sync"
	"time"
)

// pool keeps, per template, up to Config.PoolSize instances restored from the template's
// checkpoint but not yet assigned, so that Create is an assignment plus envd /init. It refills
// in the background. Each pool instance is launched for the sandbox id it will have (its owner),
// so its state already lives where the sandbox's will: assigning it moves nothing. Pool
// instances have internet access enabled (the default); a create that asks otherwise restores
// normally. Pool instances are never persisted: after a crash, reconcile finds them without a
// record and removes them.
type pool struct {
	m     *Manager
	mu    sync.Mutex
	ready map[string][]*pooled // by template id
	kick  chan struct{}
	stop  chan struct{}
	wg    sync.WaitGroup
}

type pooled struct {
	owner    string // the sandbox id it is assigned with
	buildID  string
	cpu, mem int
	place    Placement
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

// close stops refilling and destroys every unassigned instance; it returns how many.
func (p *pool) close() int {
	close(p.stop)
	p.wg.Wait()
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for id, list := range p.ready {
		for _, pe := range list {
			p.discard(pe)
			n++
		}
		delete(p.ready, id)
	}
	return n
}

func (p *pool) discard(pe *pooled) {
	p.m.teardown(context.Background(), pe.owner, pe.place)
	p.m.removeSandboxDir(pe.owner)
}

// take returns a ready instance of tpl's current build with the given resources, or nil.
func (p *pool) take(tpl *Template, allowInternet bool, cpu, mem int) *pooled {
	if p.m.cfg.PoolSize <= 0 || !allowInternet || tpl.Kind != "template" {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	defer p.poke()
	list := p.ready[tpl.ID]
	for i, pe := range list {
		if pe.buildID != tpl.BuildID {
			continue
		}
		if pe.cpu != cpu || pe.mem != mem {
			continue
		}
		p.ready[tpl.ID] = append(list[:i:i], list[i+1:]...)
		return pe
	}
	return nil
}

// templateChanged drops pooled instances of a rebuilt or deleted template.
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
	ctx := p.m.bg
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
			n, stale := 0, []*pooled{}
			keep := p.ready[tpl.ID][:0]
			for _, pe := range p.ready[tpl.ID] {
				if pe.buildID == tpl.BuildID {
					keep = append(keep, pe)
					n++
				} else {
					stale = append(stale, pe)
				}
			}
			p.ready[tpl.ID] = keep
			p.mu.Unlock()
			for _, pe := range stale {
				p.discard(pe)
			}
			if n >= p.m.cfg.PoolSize {
				break
			}
			pe, err := p.restore(ctx, tpl)
			if err != nil {
				if ctx.Err() == nil {
					p.m.log.Warn("pool refill failed", "template_id", tpl.ID, "err", err)
				}
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
	pe := &pooled{owner: newID(), buildID: tpl.BuildID,
		cpu: orDefault(tpl.CPUCount, m.cfg.CPUCount), mem: orDefault(tpl.MemoryMB, m.cfg.MemoryMB)}
	place, err := m.launch(ctx, launchSpec{owner: pe.owner, tpl: tpl, image: tpl.Image,
		cpu: pe.cpu, memMB: pe.mem, diskMB: orDefault(tpl.DiskMB, m.cfg.DiskMB), allowInternet: true})
	if err != nil {
		m.removeSandboxDir(pe.owner)
		return nil, err
	}
	pe.place = place
	return pe, nil
}
