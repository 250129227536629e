package runtime

import (
	"context"
	"sync/atomic"
	"time"
)

// StopWatch receives, from a driver, how long a checkpoint with LeaveRunning (Checkpoint,
// CheckpointToLayer) kept the instance's processes stopped: from the moment they were stopped
// to the moment they ran again. A caller that wants the figure puts one into the context
// (WithStopWatch); drivers that stop nothing leave it at zero.
type StopWatch struct{ d atomic.Int64 }

// Stopped is the time recorded (0 when none was).
func (s *StopWatch) Stopped() time.Duration {
	if s == nil {
		return 0
	}
	return time.Duration(s.d.Load())
}

// Record adds d to the time recorded. A nil StopWatch records nothing.
func (s *StopWatch) Record(d time.Duration) {
	if s != nil {
		s.d.Add(int64(d))
	}
}

type stopWatchKey struct{}

// WithStopWatch returns ctx carrying s.
func WithStopWatch(ctx context.Context, s *StopWatch) context.Context {
	return context.WithValue(ctx, stopWatchKey{}, s)
}

// StopWatchFrom returns the StopWatch ctx carries, or nil.
func StopWatchFrom(ctx context.Context) *StopWatch {
	s, _ := ctx.Value(stopWatchKey{}).(*StopWatch)
	return s
}
