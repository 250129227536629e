package sandbox

import (
	"bufio"
	"context"
	"fmt"
	"math"
	"os"
	goruntime "runtime"
	"strconv"
	"strings"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

// How the pools size themselves. Each template's target is the larger of
//
//   - the creates that arrive while one refill runs, twice over (the observed create rate, an
//     exponentially weighted average, times the time a refill takes), plus one after a recent
//     miss, but at most one more than the bursts' figure below: what a steady stream needs;
//   - the largest burst seen lately: the longest run of creates that arrived while the pool was
//     not full (the first create that finds it full starts a new run). A burst of N creates, in
//     a loop or all at once, makes the target N at once; the figure holds for Config.PoolDecay
//     (so that the pool refills to it) and halves every PoolDecay after that: the pool grows
//     fast and shrinks slowly;
//
// then at least Config.PoolSize and at most Config.PoolMax, and at least what an explicit
// warm-up (WarmPool) asks for, beyond PoolMax. All pools of a node together stay within the
// memory budget (Config.PoolMemoryMB, by default an eighth of the host's memory), each instance
// counted at the memory an idle instance of its kind was measured to hold (the driver's
// memoryCharger; Config.PoolInstanceMB and PrestartInstanceMB until measured).

// memoryCharger is implemented by drivers that can tell what an instance holds on the host
// (its cgroup's memory charge).
type memoryCharger interface {
	MemoryCharge(ctx context.Context, id string) (uint64, error)
}

// cpuWeighter is implemented by drivers that can set an instance's CPU weight against the
// node's other instances (cgroup v2 units: 1–10000, normalCPUWeight the default).
type cpuWeighter interface {
	SetCPUWeight(ctx context.Context, id string, weight int) error
}

// normalCPUWeight is a sandbox's CPU weight; defaultRefillWeight a pool refill's (a tenth).
const (
	normalCPUWeight     = 100
	defaultRefillWeight = 10
)

// refillWeight is the CPU weight restored-pool refills run at, or 0 when they run at the
// normal weight in one step (Config.PoolRefillWeight < 0, or a driver that cannot pre-start
// instances or set weights). A refill then gives way to the creates in flight (restores that
// miss the pool, commands in new sandboxes) rather than halving their CPU.
func (p *pool) refillWeight() int {
	if p.kind != kindRestored {
		return 0
	}
	w := p.m.cfg.PoolRefillWeight
	if w < 0 {
		return 0
	}
	if w == 0 {
		w = defaultRefillWeight
	}
	if _, ok := p.m.cfg.Driver.(cpuWeighter); !ok {
		return 0
	}
	if _, ok := p.m.cfg.Driver.(runtime.Prestarter); !ok {
		return 0
	}
	return min(w, 10000)
}

// setWeight sets instance's CPU weight; it reports whether it did.
func (p *pool) setWeight(ctx context.Context, owner, instance string, w int) bool {
	cw, ok := p.m.cfg.Driver.(cpuWeighter)
	if !ok {
		return false
	}
	if err := cw.SetCPUWeight(ctx, instance, w); err != nil {
		p.m.logger(owner).Warn("set the CPU weight of a pool instance", "weight", w, "err", err)
		return false
	}
	return true
}

// observe records a create of the template (for the rate and the bursts); full tells whether it
// found the pool at its target.
func (d *demand) observe(now time.Time, full bool, tau time.Duration) {
	if !d.last.IsZero() {
		gap := now.Sub(d.last).Seconds()
		if gap < 1e-3 {
			gap = 1e-3
		}
		// An EWMA of the instantaneous rate, weighted towards the last ~8 creates.
		d.rate = 0.875*d.decayed(now, tau) + 0.125/gap
	}
	d.last = now
	if full {
		d.run = 0
	}
	d.run++
	// A run as long as the burst figure renews it: a burst that comes back keeps its pool.
	if float64(d.run) >= d.peakNow(now, tau) {
		d.peak, d.peakAt = float64(d.run), now
	}
}

// decayed is the rate as of now: it falls off (time constant tau) when no create came.
func (d *demand) decayed(now time.Time, tau time.Duration) float64 {
	if d.last.IsZero() {
		return 0
	}
	idle := now.Sub(d.last).Seconds()
	return d.rate * math.Exp(-idle/tau.Seconds())
}

// peakNow is the largest burst as of now: it holds for tau after it was seen (the pool has
// time to refill to it before it shrinks), then halves every tau.
func (d *demand) peakNow(now time.Time, tau time.Duration) float64 {
	if d.peakAt.IsZero() {
		return 0
	}
	after := now.Sub(d.peakAt) - tau
	if after <= 0 {
		return d.peak
	}
	return d.peak * math.Exp2(-after.Seconds()/tau.Seconds())
}

// want is the pool size the demand asks for, before limits.
func (d *demand) want(now time.Time, tau time.Duration) int {
	refill := d.refill
	if refill == 0 {
		refill = 0.25
	}
	steady := int(math.Ceil(2 * d.decayed(now, tau) * refill))
	if !d.lastMiss.IsZero() && now.Sub(d.lastMiss) < tau {
		steady++ // a recent miss: one more than the rate alone says
	}
	// The rate of a burst (creates milliseconds apart) says nothing of what follows it: the
	// steady term adds at most one to the bursts' figure.
	burst := int(math.Round(d.peakNow(now, tau)))
	return max(burst, min(steady, burst+1))
}

// targetLocked is how many instances template id should have now (before the budget).
func (p *pool) targetLocked(id string, now time.Time) int {
	d := p.demandLocked(id)
	least, most, _ := p.limits()
	return max(least, min(d.want(now, p.m.cfg.PoolDecay), most), d.warm)
}

// parallel is how many refills may run at once when no create is in flight.
func (p *pool) parallel() int {
	if n := p.m.cfg.PoolRefills; n > 0 {
		return n
	}
	return max(1, goruntime.NumCPU())
}

// instanceMB is what one instance of this pool's kind counts in the budget.
func (p *pool) instanceMB() float64 {
	if c := math.Float64frombits(p.cost.Load()); c > 0 {
		return c
	}
	_, _, mb := p.limits()
	return float64(mb)
}

// held is how many instances the pool holds or is making (readable without mu).
func (p *pool) held() int { return int(p.n.Load() + p.making.Load()) }

// poolMemoryUsed is the memory the pools (and the instances pre-started for resumes) hold or
// are making, in MiB.
func (m *Manager) poolMemoryUsed() float64 {
	used := float64(m.resumePre.Load()) * m.prestarts.instanceMB()
	used += float64(m.standbyMB.Load()) // rollback standbys (standby.go)
	for _, p := range []*pool{m.pool, m.prestarts} {
		if p.enabled() {
			used += float64(p.held()) * p.instanceMB()
		}
	}
	return used
}

// poolRoom reports whether one more instance of mb fits the budget.
func (m *Manager) poolRoom(mb float64) bool {
	return m.poolMemoryUsed()+mb <= float64(m.cfg.PoolMemoryMB)
}

// budgetLocked is the budget and what is used of it (MiB).
func (p *pool) budgetLocked() (int, float64) {
	return p.m.cfg.PoolMemoryMB, p.m.poolMemoryUsed()
}

// roomLocked reports whether one more instance fits the budget.
func (p *pool) roomLocked() bool { return p.m.poolRoom(p.instanceMB()) }

// measure folds the host memory instance holds into the pool's measured cost per instance.
func (p *pool) measure(ctx context.Context, instance string) {
	mc, ok := p.m.cfg.Driver.(memoryCharger)
	if !ok {
		return
	}
	b, err := mc.MemoryCharge(ctx, instance)
	if err != nil || b < 1<<20 {
		return
	}
	mb := float64(b) / (1 << 20)
	for {
		old := p.cost.Load()
		c := math.Float64frombits(old)
		if c == 0 {
			c = mb
		} else {
			c = 0.75*c + 0.25*mb
		}
		if p.cost.CompareAndSwap(old, math.Float64bits(c)) {
			return
		}
	}
}

// markLocked counts a refill of d in flight as owner, or (done) no longer.
func (p *pool) markLocked(d *demand, owner string, done bool) {
	if done {
		if d.refilling[owner] {
			delete(d.refilling, owner)
			p.making.Add(-1)
		}
		return
	}
	if d.refilling == nil {
		d.refilling = map[string]bool{}
	}
	d.refilling[owner] = true
	p.making.Add(1)
}

// WarmPool sets the least number of restored sandboxes kept ready for a template (0 returns
// the pool to following demand alone), for workloads that know their concurrency. It may
// exceed the per-template maximum, not the memory budget: PoolState tells what fits. It returns
// the pool's state.
func (m *Manager) WarmPool(ctx context.Context, templateID string, count int) (PoolState, error) {
	if count < 0 || count > m.cfg.MaxSandboxes {
		return PoolState{}, fmt.Errorf("count %d: must be between 0 and the node's maximum of %d sandboxes: %w", count, m.cfg.MaxSandboxes, errdefs.ErrInvalid)
	}
	if !m.pool.enabled() {
		return PoolState{}, fmt.Errorf("the warm pool is disabled on this node (--pool-size 0): %w", errdefs.ErrConflict)
	}
	tpl, err := m.resolveTemplate(ctx, templateID)
	if err != nil {
		return PoolState{}, err
	}
	if tpl.Kind != "template" {
		return PoolState{}, fmt.Errorf("%q is a snapshot: only templates have warm pools: %w", templateID, errdefs.ErrInvalid)
	}
	m.pool.mu.Lock()
	m.pool.demandLocked(tpl.ID).warm = count
	m.pool.mu.Unlock()
	m.pool.poke()
	m.log.Info("pool warm-up", "template_id", tpl.ID, "count", count)
	for _, st := range m.pool.state() {
		if st.TemplateID == tpl.ID {
			return st, nil
		}
	}
	return PoolState{TemplateID: tpl.ID, Kind: kindRestored, Warm: count}, nil
}

// defaultPoolMemoryMB is the pools' default budget: an eighth of the host's memory (1 GiB if
// it cannot be read).
func defaultPoolMemoryMB() int {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 1024
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 2 && fields[0] == "MemTotal:" {
			kib, err := strconv.ParseInt(fields[1], 10, 64)
			if err != nil || kib <= 0 {
				break
			}
			return max(256, int(kib/1024/8))
		}
	}
	return 1024
}
