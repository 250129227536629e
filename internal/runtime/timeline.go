package runtime

import (
	"context"
	"log/slog"
	"time"
)

// Timeline records the stages of one operation (a pause, a resume, a create) and logs them as one
// Debug line of "<stage>_ms" durations, so that where an operation's time goes beyond the runtime
// call itself can be read from the debug log. The zero value is not usable: start with
// NewTimeline. Not safe for concurrent use.
type Timeline struct {
	start, last time.Time
	attrs       []any
}

// NewTimeline starts a timeline now.
func NewTimeline() *Timeline {
	now := time.Now()
	return &Timeline{start: now, last: now}
}

// Mark ends the current stage, named stage, and starts the next one.
func (t *Timeline) Mark(stage string) {
	now := time.Now()
	t.attrs = append(t.attrs, stage+"_ms", msOf(now.Sub(t.last)))
	t.last = now
}

// Total is the time since the timeline started.
func (t *Timeline) Total() time.Duration { return time.Since(t.start) }

// Log writes the timeline at Debug level as msg, with attrs first, each stage, then total_ms.
func (t *Timeline) Log(l *slog.Logger, msg string, attrs ...any) {
	if !l.Enabled(context.Background(), slog.LevelDebug) {
		return
	}
	args := append(append(attrs, t.attrs...), "total_ms", msOf(t.Total()))
	l.Debug(msg, args...)
}

func msOf(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
