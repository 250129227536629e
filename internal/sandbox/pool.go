package sandbox

import (
	"context"
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
// The pool follows demand (poolsize.go): each template's target covers the creates that arrive
// while a refill runs and the largest burst seen lately, at least Config.PoolSize (or what an
// explicit warm-up asks) and at most Config.PoolMax, and all pools together stay within the
// memory budget, each instance counted at its measured cost. Refills run concurrently, up to
// Config.PoolRefills at once, but only one while creates are in flight (and only after a short
// wait for a gap), so they do not starve the requests they are there to serve.
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
	// making counts refills in flight (readable without mu); cost is the measured memory
	// (MiB, float64 bits) an idle instance of this kind holds, 0 until measured.
	making atomic.Int32
	cost   atomic.Uint64
	kick   chan struct{}
	stop   chan struct{}
	wg     sync.WaitGroup
}

type pooled struct {
	owner          string // the sandbox id it is assigned with
	buildID        string
	image          string // pre-started: the image its layer came from, to restore into it
	cpu, mem, disk int
	place          Placement
	// lowered: the instance runs at the refills' CPU weight until a create takes it.
	lowered bool
}

// PoolKindResume is the kind of the PoolState of instances pre-started for resumes.
const PoolKindResume = kindResume

// Pool kinds.
const (
	kindRestored   = "restored"
	kindPrestarted = "prestarted"
	// kindResume: instances pre-started for the resume of a paused sandbox (prestart.go).
	kindResume = "resume"
)

// demand is what the pool observed of one template.
type demand struct {
	rate     float64   // creates per second, exponentially weighted
	last     time.Time // last create
	refill   float64   // seconds one refill takes, exponentially weighted
	hits     int       // creates served from the pool
	misses   int       // creates that found it empty
	lastMiss time.Time
	// run counts the creates since one last found the pool full; peak is the largest run seen,
	// as of peakAt (it holds for Config.PoolDecay, then halves every PoolDecay: poolsize.go).
	run    int
	peak   float64
	peakAt time.Time
	// warm is the explicit floor a warm-up asked for (0: none).
	warm int
	// refilling are the owners of the refills in flight; retryAt holds refills back after one
	// failed.
	refilling map[string]bool
	retryAt   time.Time
}

// PoolState is one template's pool, as the API and CLI show it.
type PoolState struct {
	TemplateID string `json:"templateID"`
	// Kind is "restored" (sandboxes restored and waiting for an assignment), "prestarted"
	// (instances created by the runtime, waiting for a restore into them) or "resume"
	// (instances pre-started for the resume of paused sandboxes: SandboxIDs).
	Kind  string `json:"kind"`
	Ready int    `json:"ready"`
	// Target is the size the pool is kept at now: max(Min, Warm, min(Max, the demand)), within
	// the memory budget (BudgetMB over every pool, of which UsedMB is held or being made).
	Target int `json:"target"`
	Min    int `json:"min"`
	Max    int `json:"max"`
	// Warm is the floor an explicit warm-up set (0: none).
	Warm       int     `json:"warm"`
	CreateRate float64 `json:"createsPerSecond"`
	// Burst is the largest run of creates the pool could not absorb lately (decaying).
	Burst    float64 `json:"burst"`
	RefillMs float64 `json:"refillMs"`
	Hits     int     `json:"hits"`
	Misses   int     `json:"misses"`
	// Refilling: a refill is in flight; RefillsInFlight how many.
	Refilling       bool `json:"refilling"`
	RefillsInFlight int  `json:"refillsInFlight"`
	// InstanceMB is what one instance of this kind is counted at in the budget: its measured
	// idle cost once measured, the configured estimate before.
	InstanceMB float64 `json:"instanceMB"`
	BudgetMB   int     `json:"budgetMB"`
	UsedMB     float64 `json:"usedMB"`
	// SandboxIDs are the ids the pool's instances (ready, and those being restored) will be
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
	p.m.teardownSandbox(context.Background(), pe.owner, pe.place)
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
	list := p.ready[tpl.ID]
	d.observe(now, len(list) >= p.targetLocked(tpl.ID, now), p.m.cfg.PoolDecay)
	for i, pe := range list {
		if pe.buildID != tpl.BuildID || pe.cpu != cpu || pe.mem != mem || (p.kind == kindPrestarted && pe.disk != disk) {
			continue
		}
		p.setReadyLocked(tpl.ID, append(list[:i:i], list[i+1:]...))
		d.hits++
		if pe.lowered {
			p.setWeight(context.Background(), pe.owner, pe.place.InstanceID, normalCPUWeight)
		}
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

// state returns every template's pool.
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
	budget, used := p.budgetLocked()
	cost := p.instanceMB()
	out := make([]PoolState, 0, len(ids))
	for id := range ids {
		d := p.demandLocked(id)
		owners := []string{}
		for _, pe := range p.ready[id] {
			owners = append(owners, pe.owner)
		}
		for o := range d.refilling {
			owners = append(owners, o)
		}
		sort.Strings(owners[len(p.ready[id]):])
		least, most, _ := p.limits()
		out = append(out, PoolState{TemplateID: id, Kind: p.kind, Ready: len(p.ready[id]), Target: p.targetLocked(id, now),
			Min: least, Max: most, Warm: d.warm, CreateRate: d.decayed(now, p.m.cfg.PoolDecay), Burst: d.peakNow(now, p.m.cfg.PoolDecay),
			RefillMs: d.refill * 1000, Hits: d.hits, Misses: d.misses, Refilling: len(d.refilling) > 0, RefillsInFlight: len(d.refilling),
			InstanceMB: cost, BudgetMB: budget, UsedMB: used, SandboxIDs: owners})
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

// fill starts refills towards every template's target, most needed first: up to
// Config.PoolRefills at once, one while creates are in flight (after waiting up to 100 ms for
// them, and for the first requests of the sandboxes just created, to finish: firstreq.go). A
// refill that ends pokes the loop, which calls fill again.
func (p *pool) fill() {
	ctx := p.m.bg
	for {
		select {
		case <-p.stop:
			return
		default:
		}
		// Creates in flight go first: a refill competes with them for the CPU (for about 100 ms
		// at most). Then the first requests of the sandboxes just created (the caller's first
		// command), for about firstRequestGrace at most, so that a steady stream of creates
		// does not starve the pool.
		if !p.waitWhile(50, p.m.busy) || !p.waitWhile(int(firstRequestGrace/(2*time.Millisecond)), p.m.firstReqs.pending) {
			return
		}
		limit := p.parallel()
		if p.m.busy() {
			limit = 1
		}
		tpl, owner := p.next(ctx, limit)
		if tpl == nil {
			return
		}
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			defer p.poke()
			p.refill(ctx, tpl, owner)
		}()
	}
}

// waitWhile polls cond every 2 ms, up to n times, while it holds; false when the pool stops.
func (p *pool) waitWhile(n int, cond func() bool) bool {
	for i := 0; i < n && cond(); i++ {
		select {
		case <-p.stop:
			return false
		case <-time.After(2 * time.Millisecond):
		}
	}
	return true
}

// refill makes one instance of tpl for the pool, as owner (already counted as in flight).
func (p *pool) refill(ctx context.Context, tpl *Template, owner string) {
	start := time.Now()
	pe, err := p.restore(ctx, tpl, owner)
	p.mu.Lock()
	defer p.mu.Unlock()
	d := p.demandLocked(tpl.ID)
	p.markLocked(d, owner, true)
	if err != nil {
		d.retryAt = time.Now().Add(time.Second)
		if ctx.Err() == nil {
			p.m.log.Warn("pool refill failed", "template_id", tpl.ID, "err", err)
		}
		return
	}
	took := time.Since(start).Seconds()
	if d.refill == 0 {
		d.refill = took
	} else {
		d.refill = 0.75*d.refill + 0.25*took
	}
	p.setReadyLocked(tpl.ID, append(p.ready[tpl.ID], pe))
}

// next picks the template whose pool is furthest below its target (counting refills in
// flight; stale builds discarded) and marks a refill of it in flight, as the returned owner.
// It returns nil when limit refills run already, every pool is full or the budget is spent.
func (p *pool) next(ctx context.Context, limit int) (*Template, string) {
	tpls, err := p.m.cfg.Store.ListTemplates(ctx)
	if err != nil {
		return nil, ""
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
			p.setReadyLocked(id, nil)
		}
	}
	inflight := 0
	for _, d := range p.stats {
		inflight += len(d.refilling)
	}
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
		d := p.demandLocked(tpl.ID)
		target := p.targetLocked(tpl.ID, now)
		// Demand fell: instances beyond the target are given back (the oldest first), one a
		// round, so the pool shrinks as it grew.
		if len(keep) > target {
			stale = append(stale, keep[0])
			keep = keep[1:]
		}
		p.setReadyLocked(tpl.ID, keep)
		if now.Before(d.retryAt) {
			continue
		}
		if gap := target - len(keep) - len(d.refilling); gap > bestGap {
			best, bestGap = tpl, gap
		}
	}
	if best == nil || inflight >= limit || !p.roomLocked() {
		return nil, ""
	}
	owner := newID()
	p.markLocked(p.demandLocked(best.ID), owner, false)
	return best, owner
}

// restore makes one instance for the pool: a sandbox restored from tpl's image, or (the
// pre-started kind) an instance created with that image's layer and nothing restored yet.
func (p *pool) restore(ctx context.Context, tpl *Template, owner string) (*pooled, error) {
	m := p.m
	pe := &pooled{owner: owner, buildID: tpl.BuildID, image: tpl.Image,
		cpu: orDefault(tpl.CPUCount, m.cfg.CPUCount), mem: orDefault(tpl.MemoryMB, m.cfg.MemoryMB), disk: orDefault(tpl.DiskMB, m.cfg.DiskMB)}
	prestart := p.kind == kindPrestarted
	// A restored instance's launch requests go through its guest transport, so the connection
	// they leave idle serves its first request (guest.go).
	spec := launchSpec{owner: pe.owner, tpl: tpl, image: tpl.Image, prestart: prestart, guest: !prestart,
		cpu: pe.cpu, memMB: pe.mem, diskMB: pe.disk, egress: Egress{AllowInternet: true}}
	var place Placement
	var err error
	if w := p.refillWeight(); w > 0 {
		// In two steps, to restore at a low CPU weight: pre-started, lowered, restored into.
		spec.prestart, spec.guest = true, false
		if place, err = m.launch(ctx, spec); err == nil {
			pe.lowered = p.setWeight(ctx, pe.owner, place.InstanceID, w)
			spec.prestart, spec.guest, spec.into = false, !prestart, &place
			place, err = m.launch(ctx, spec)
		}
	} else {
		place, err = m.launch(ctx, spec)
	}
	if err != nil {
		m.removeSandboxDir(pe.owner)
		return nil, err
	}
	pe.place = place
	// A pre-started instance runs nothing yet: its warm-up is the create's restore.
	if p.kind == kindRestored {
		if err := m.warmGuest(ctx, place.GuestIP, tpl.InitToken); err != nil {
			m.logger(pe.owner).Debug("pool instance warm-up", "err", err)
		}
	}
	p.measure(ctx, place.InstanceID)
	return pe, nil
}
