package sandbox

import (
	"context"
	"math"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ember-sandbox/ember/internal/runtime"
)

// pool keeps, per template, instances restored from the template's checkpoint but not yet
// assigned, so that Create is an assignment plus envd /init. Each pool instance is launched
// for the sandbox id it will have (its owner), so its state already lives where the sandbox's
// will: assigning it moves nothing. Pool instances have internet access enabled (the
// default); a create that asks otherwise restores normally. They are never persisted: after a
// crash, reconcile finds them without a record and removes them.
//
// The pool follows demand: each template's target is the observed create rate times the time
// a refill takes (with headroom), at least Config.PoolSize and at most Config.PoolMax, and all
// pools together stay within Config.PoolMemoryMB. Refills run one at a time and wait while
// creates are in flight, so they never compete with the requests they are there to serve.
//
// A second pool of the same kind of machinery keeps pre-started instances (kindPrestarted,
// prestart.go): created by the runtime with the template image's layer and a network slot,
// nothing restored into them yet. A create the restored pool cannot serve restores into one;
// its demand is the rate of those misses, and its instances share the memory budget.
type pool struct {
	m     *Manager
	kind  string       // kindRestored or kindPrestarted
	other *pool        // the pool of the other kind, whose instances share the memory budget
	n     atomic.Int32 // ready instances, readable without mu (for the other pool's budget)
	mu    sync.Mutex
	ready map[string][]*pooled // by template id
	stats map[string]*demand   // by template id
	kick  chan struct{}
	stop  chan struct{}
	wg    sync.WaitGroup
}

type pooled struct {
	owner          string // the sandbox id it is assigned with
	buildID        string
	image          string // pre-started: the image its layer came from, to restore into it
	cpu, mem, disk int
	place          Placement
}

// Pool kinds.
const (
	kindRestored   = "restored"
	kindPrestarted = "prestarted"
	// kindResume: instances pre-started for the resume of a paused sandbox (prestart.go).
	kindResume = "resume"
)

// demand is what the pool observed of one template.
type demand struct {
	rate      float64   // creates per second, exponentially weighted
	last      time.Time // last create
	refill    float64   // seconds one refill takes, exponentially weighted
	hits      int       // creates served from the pool
	misses    int       // creates that found it empty
	lastMiss  time.Time
	refilling bool
	owner     string // the id of the instance being restored
}

// PoolState is one template's pool, as the API and CLI show it.
type PoolState struct {
	TemplateID string `json:"templateID"`
	// Kind is "restored" (sandboxes restored and waiting for an assignment), "prestarted"
	// (instances created by the runtime, waiting for a restore into them) or "resume"
	// (instances pre-started for the resume of paused sandboxes: SandboxIDs).
	Kind       string  `json:"kind"`
	Ready      int     `json:"ready"`
	Target     int     `json:"target"`
	Min        int     `json:"min"`
	Max        int     `json:"max"`
	CreateRate float64 `json:"createsPerSecond"`
	RefillMs   float64 `json:"refillMs"`
	Hits       int     `json:"hits"`
	Misses     int     `json:"misses"`
	Refilling  bool    `json:"refilling"`
	// SandboxIDs are the ids the pool's instances (ready, and the one being restored) will be
	// assigned with: their state already lives under sandboxes/<id>.
	SandboxIDs []string `json:"sandboxIDs"`
}

func newPool(m *Manager, kind string) *pool {
	return &pool{m: m, kind: kind, ready: map[string][]*pooled{}, stats: map[string]*demand{}, kick: make(chan struct{}, 1), stop: make(chan struct{})}
}

func (p *pool) enabled() bool {
	if p.kind == kindPrestarted {
		_, ok := p.m.cfg.Driver.(runtime.Prestarter)
		return ok && p.m.cfg.PrestartMax > 0
	}
	return p.m.cfg.PoolSize > 0
}

// limits are the least and most instances per template, and what one counts in the budget.
func (p *pool) limits() (least, most, instanceMB int) {
	cfg := p.m.cfg
	if p.kind == kindPrestarted {
		return cfg.PrestartSize, cfg.PrestartMax, cfg.PrestartInstanceMB
	}
	return cfg.PoolSize, cfg.PoolMax, cfg.PoolInstanceMB
}

// setReadyLocked replaces template id's ready list and keeps the count.
func (p *pool) setReadyLocked(id string, list []*pooled) {
	p.n.Add(int32(len(list) - len(p.ready[id])))
	if len(list) == 0 {
		delete(p.ready, id)
		return
	}
	p.ready[id] = list
}

func (p *pool) start() {
	if !p.enabled() {
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
		p.setReadyLocked(id, nil)
	}
	return n
}

func (p *pool) discard(pe *pooled) {
	p.m.teardown(context.Background(), pe.owner, pe.place)
	p.m.removeSandboxDir(pe.owner)
}

// demandLocked returns the stats of a template, creating them.
func (p *pool) demandLocked(id string) *demand {
	d := p.stats[id]
	if d == nil {
		d = &demand{}
		p.stats[id] = d
	}
	return d
}

// observe records a create of template id (for the rate).
func (d *demand) observe(p *pool, now time.Time) {
	if !d.last.IsZero() {
		gap := now.Sub(d.last).Seconds()
		if gap < 1e-3 {
			gap = 1e-3
		}
		// An EWMA of the instantaneous rate, weighted towards the last ~8 creates.
		d.rate = 0.875*d.decayed(now, p.m.cfg.PoolDecay) + 0.125/gap
	}
	d.last = now
}

// decayed is the rate as of now: it falls off (time constant tau) when no create came.
func (d *demand) decayed(now time.Time, tau time.Duration) float64 {
	if d.last.IsZero() {
		return 0
	}
	idle := now.Sub(d.last).Seconds()
	return d.rate * math.Exp(-idle/tau.Seconds())
}

// targetLocked is how many ready instances template id should have now.
func (p *pool) targetLocked(id string, now time.Time) int {
	cfg := p.m.cfg
	d := p.demandLocked(id)
	refill := d.refill
	if refill == 0 {
		refill = 0.25
	}
	// Enough to cover the creates that arrive while one refill runs, twice over.
	want := int(math.Ceil(2 * d.decayed(now, cfg.PoolDecay) * refill))
	if !d.lastMiss.IsZero() && now.Sub(d.lastMiss) < cfg.PoolDecay {
		want++ // a recent miss: one more than the rate alone says
	}
	least, most, _ := p.limits()
	return max(least, min(want, most))
}

// totalLocked counts ready instances of every template.
func (p *pool) totalLocked() int {
	n := 0
	for _, l := range p.ready {
		n += len(l)
	}
	return n
}

// take returns a ready instance of tpl's current build with the given resources, or nil.
// Only creates with the default egress rules take one.
func (p *pool) take(tpl *Template, cpu, mem, disk int) *pooled {
	if !p.enabled() || tpl.Kind != "template" {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	defer p.poke()
	d := p.demandLocked(tpl.ID)
	now := time.Now()
	d.observe(p, now)
	list := p.ready[tpl.ID]
	for i, pe := range list {
		if pe.buildID != tpl.BuildID || pe.cpu != cpu || pe.mem != mem || (p.kind == kindPrestarted && pe.disk != disk) {
			continue
		}
		p.setReadyLocked(tpl.ID, append(list[:i:i], list[i+1:]...))
		d.hits++
		return pe
	}
	d.misses++
	d.lastMiss = now
	return nil
}

// templateChanged drops pooled instances of a rebuilt or deleted template.
func (p *pool) templateChanged(tpl *Template) {
	p.mu.Lock()
	list := p.ready[tpl.ID]
	p.setReadyLocked(tpl.ID, nil)
	p.mu.Unlock()
	for _, pe := range list {
		p.discard(pe)
	}
	p.poke()
}

// State returns every template's pool.
func (p *pool) state() []PoolState {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	ids := map[string]bool{}
	for id := range p.ready {
		ids[id] = true
	}
	for id := range p.stats {
		ids[id] = true
	}
	out := make([]PoolState, 0, len(ids))
	for id := range ids {
		d := p.demandLocked(id)
		owners := []string{}
		for _, pe := range p.ready[id] {
			owners = append(owners, pe.owner)
		}
		if d.refilling {
			owners = append(owners, d.owner)
		}
		least, most, _ := p.limits()
		out = append(out, PoolState{TemplateID: id, Kind: p.kind, Ready: len(p.ready[id]), Target: p.targetLocked(id, now),
			Min: least, Max: most, CreateRate: d.decayed(now, p.m.cfg.PoolDecay), RefillMs: d.refill * 1000,
			Hits: d.hits, Misses: d.misses, Refilling: d.refilling, SandboxIDs: owners})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].TemplateID < out[j].TemplateID })
	return out
}

// Pools returns the state of the warm pools, restored then pre-started (empty when both are
// disabled).
func (m *Manager) Pools(ctx context.Context) []PoolState {
	out := []PoolState{}
	for _, p := range []*pool{m.pool, m.prestarts} {
		if p.enabled() {
			out = append(out, p.state()...)
		}
	}
	return append(out, m.resumeStates()...)
}

func (p *pool) loop() {
	defer p.wg.Done()
	t := time.NewTicker(time.Second)
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

// fill tops every template's pool up to its target, one instance at a time, most needed first.
func (p *pool) fill() {
	ctx := p.m.bg
	for {
		select {
		case <-p.stop:
			return
		default:
		}
		tpl := p.next(ctx)
		if tpl == nil {
			return
		}
		// Creates in flight go first: a refill competes with them for the CPU.
		for i := 0; i < 50 && p.m.busy(); i++ {
			select {
			case <-p.stop:
				return
			case <-time.After(2 * time.Millisecond):
			}
		}
		owner := newID()
		p.mu.Lock()
		p.demandLocked(tpl.ID).refilling = true
		p.demandLocked(tpl.ID).owner = owner
		p.mu.Unlock()
		start := time.Now()
		pe, err := p.restore(ctx, tpl, owner)
		p.mu.Lock()
		d := p.demandLocked(tpl.ID)
		d.refilling = false
		if err != nil {
			p.mu.Unlock()
			if ctx.Err() == nil {
				p.m.log.Warn("pool refill failed", "template_id", tpl.ID, "err", err)
			}
			return // the ticker tries again
		}
		took := time.Since(start).Seconds()
		if d.refill == 0 {
			d.refill = took
		} else {
			d.refill = 0.75*d.refill + 0.25*took
		}
		p.setReadyLocked(tpl.ID, append(p.ready[tpl.ID], pe))
		p.mu.Unlock()
	}
}

// next picks the template whose pool is furthest below its target (stale builds discarded),
// or nil when every pool is full or the memory budget is spent.
func (p *pool) next(ctx context.Context) *Template {
	tpls, err := p.m.cfg.Store.ListTemplates(ctx)
	if err != nil {
		return nil
	}
	now := time.Now()
	var stale []*pooled
	gone := false // some of stale ran on a template's earlier build, or a deleted template
	defer func() {
		for _, pe := range stale {
			p.discard(pe)
		}
		if gone {
			p.m.collectLayers(ctx, "pool instances of an old build discarded")
		}
	}()
	p.mu.Lock()
	defer p.mu.Unlock()
	// Instances a refill finished after their template was deleted.
	current := map[string]bool{}
	for _, tpl := range tpls {
		current[tpl.ID] = true
	}
	for id, list := range p.ready {
		if !current[id] {
			stale = append(stale, list...)
			gone = true
			delete(p.ready, id)
		}
	}
	_, _, instanceMB := p.limits()
	used := int(p.m.resumePre.Load()) * p.m.cfg.PrestartInstanceMB // pre-started for resumes
	if o := p.other; o != nil && o.enabled() {
		_, _, otherMB := o.limits()
		used += int(o.n.Load()) * otherMB
	}
	budget := (p.m.cfg.PoolMemoryMB - used) / instanceMB
	var best *Template
	bestGap := 0
	for _, tpl := range tpls {
		if tpl.Kind != "template" || !tpl.Ready || tpl.Image == "" {
			continue
		}
		keep := p.ready[tpl.ID][:0]
		for _, pe := range p.ready[tpl.ID] {
			if pe.buildID == tpl.BuildID {
				keep = append(keep, pe)
			} else {
				stale = append(stale, pe)
				gone = true
			}
		}
		target := p.targetLocked(tpl.ID, now)
		// Demand fell: instances beyond the target are given back (the oldest first), one a
		// round, so the pool shrinks as it grew.
		if len(keep) > target {
			stale = append(stale, keep[0])
			keep = keep[1:]
		}
		p.setReadyLocked(tpl.ID, keep)
		if gap := target - len(keep); gap > bestGap {
			best, bestGap = tpl, gap
		}
	}
	if best == nil || p.totalLocked() >= budget {
		return nil
	}
	return best
}

// restore makes one instance for the pool: a sandbox restored from tpl's image, or (the
// pre-started kind) an instance created with that image's layer and nothing restored yet.
func (p *pool) restore(ctx context.Context, tpl *Template, owner string) (*pooled, error) {
	m := p.m
	pe := &pooled{owner: owner, buildID: tpl.BuildID, image: tpl.Image,
		cpu: orDefault(tpl.CPUCount, m.cfg.CPUCount), mem: orDefault(tpl.MemoryMB, m.cfg.MemoryMB), disk: orDefault(tpl.DiskMB, m.cfg.DiskMB)}
	prestart := p.kind == kindPrestarted
	place, err := m.launch(ctx, launchSpec{owner: pe.owner, tpl: tpl, image: tpl.Image, prestart: prestart, guest: !prestart,
		cpu: pe.cpu, memMB: pe.mem, diskMB: pe.disk, egress: Egress{AllowInternet: true}})
	if err != nil {
		m.removeSandboxDir(pe.owner)
		return nil, err
	}
	pe.place = place
	if prestart {
		return pe, nil // nothing runs in it yet
	}
	if err := m.warmGuest(ctx, place.GuestIP, tpl.InitToken); err != nil {
		m.logger(pe.owner).Debug("pool instance warm-up", "err", err)
	}
	return pe, nil
}
