package edge

import (
	"testing"
	"time"
)

// The signed-URL fan-out of an edge is a token bucket: a burst of FanoutBurst, then
// FanoutRate a second.
func TestFanoutLimit(t *testing.T) {
	now := time.Unix(1000, 0)
	l := fanoutLimit{now: func() time.Time { return now }}
	for i := 0; i < FanoutBurst; i++ {
		if !l.allow() {
			t.Fatalf("refused the %dth of a burst of %d", i+1, FanoutBurst)
		}
	}
	if l.allow() {
		t.Fatal("allowed more than the burst")
	}
	now = now.Add(100 * time.Millisecond)
	n := 0
	for l.allow() {
		n++
	}
	if n != FanoutRate/10 {
		t.Fatalf("allowed %d in 100 ms, want %d", n, FanoutRate/10)
	}
	now = now.Add(time.Hour)
	n = 0
	for l.allow() {
		n++
	}
	if n != FanoutBurst {
		t.Fatalf("allowed %d after an hour, want the burst %d", n, FanoutBurst)
	}
}
