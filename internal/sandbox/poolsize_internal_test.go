package sandbox

import (
	"testing"
	"time"
)

// A burst of creates the pool cannot absorb asks for a pool of its size at once; the figure
// holds for a decay period (the pool refills to it), then halves every period: the pool
// shrinks slowly.
func TestSizingFollowsABurstAndHalvesPerDecay(t *testing.T) {
	const tau = 30 * time.Second
	t0 := time.Unix(1_000_000, 0)
	d := &demand{refill: 0.15}
	// 20 creates in a loop, each a pool miss of 100 ms (the steady-rate term alone would ask
	// for 2 × 10/s × 0.15 s = 3); the first finds the pool full.
	d.observe(t0, true, tau)
	for i := 1; i < 20; i++ {
		d.observe(t0.Add(time.Duration(i)*100*time.Millisecond), false, tau)
	}
	end := t0.Add(1900 * time.Millisecond)
	if got := d.want(end, tau); got != 20 {
		t.Fatalf("after a burst of 20 creates the demand asks for %d, want 20", got)
	}
	for _, c := range []struct {
		after time.Duration
		want  int
	}{{tau / 2, 20}, {tau, 20}, {2 * tau, 10}, {3 * tau, 5}, {12 * tau, 0}} {
		got := int(d.peakNow(end.Add(c.after), tau) + 0.5)
		if got != c.want {
			t.Fatalf("burst %s after it: %d, want %d", c.after, got, c.want)
		}
	}
	// The same burst again, before it decays, renews it: it holds for another period.
	again := end.Add(tau / 2)
	d.observe(again, true, tau)
	for i := 1; i < 20; i++ {
		d.observe(again.Add(time.Duration(i)*100*time.Millisecond), false, tau)
	}
	if got := int(d.peakNow(again.Add(2*time.Second+tau), tau) + 0.5); got != 20 {
		t.Fatalf("a repeated burst of 20, a decay period later: %d, want 20", got)
	}
	end = again.Add(1900 * time.Millisecond)
	// A new, larger burst raises it at once (and its rate, creates 1 ms apart, adds one).
	later := end.Add(2 * tau)
	d.observe(later, true, tau)
	for i := 1; i < 40; i++ {
		d.observe(later.Add(time.Duration(i)*time.Millisecond), false, tau)
	}
	if got := d.want(later.Add(40*time.Millisecond), tau); got != 41 {
		t.Fatalf("after a second burst of 40: %d, want 41", got)
	}
}

// A steady stream the pool keeps up with (every create finds it full) asks only for what
// arrives during a refill, twice over: the bursts are runs of one.
func TestSizingOfASteadyStream(t *testing.T) {
	const tau = 30 * time.Second
	t0 := time.Unix(1_000_000, 0)
	d := &demand{refill: 0.2}
	for i := 0; i < 200; i++ {
		d.observe(t0.Add(time.Duration(i)*500*time.Millisecond), true, tau) // 2 creates/s
	}
	now := t0.Add(100 * time.Second)
	if got := d.want(now, tau); got != 1 {
		t.Fatalf("2 creates/s with 0.2 s refills asks for %d, want 1 (2 × 2/s × 0.2 s = 0.8)", got)
	}
	// 20 creates/s the refills cannot keep up with: runs grow and so does the pool.
	d2 := &demand{refill: 0.2}
	d2.observe(t0, true, tau)
	for i := 1; i < 100; i++ {
		d2.observe(t0.Add(time.Duration(i)*50*time.Millisecond), false, tau)
	}
	if got := d2.want(t0.Add(5*time.Second), tau); got != 100 {
		t.Fatalf("a stream the pool never absorbs: %d, want its run of 100", got)
	}
}

// The target stays within [PoolSize, PoolMax], except that an explicit warm-up may exceed
// PoolMax.
func TestTargetLimitsAndWarmFloor(t *testing.T) {
	m := &Manager{cfg: Config{PoolSize: 2, PoolMax: 8, PoolDecay: 30 * time.Second}}
	p := newPool(m, kindRestored)
	now := time.Now()
	if got := p.targetLocked("t", now); got != 2 {
		t.Fatalf("no demand: target %d, want the minimum 2", got)
	}
	d := p.demandLocked("t")
	d.peak, d.peakAt = 50, now
	if got := p.targetLocked("t", now); got != 8 {
		t.Fatalf("a burst of 50: target %d, want the maximum 8", got)
	}
	d.warm = 30
	if got := p.targetLocked("t", now); got != 30 {
		t.Fatalf("warmed to 30: target %d, want 30", got)
	}
}
