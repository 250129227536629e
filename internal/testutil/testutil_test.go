package testutil

import (
	"fmt"
	"runtime"
	"testing"
	"time"
)

// fatalRecorder records the first Fatalf and ends its goroutine the way testing.T does.
type fatalRecorder struct {
	testing.TB
	msg string
}

func (r *fatalRecorder) Helper() {}

func (r *fatalRecorder) Fatalf(format string, args ...any) {
	r.msg = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

func TestEventuallyOrFailsWithWhatWasSeenLast(t *testing.T) {
	r := &fatalRecorder{TB: t}
	n := 0
	done := make(chan struct{})
	go func() {
		defer close(done)
		EventuallyOr(r, 50*time.Millisecond, func() bool { n++; return false },
			func() string { return fmt.Sprintf("n reaches -1: n=%d", n) })
	}()
	<-done
	want := fmt.Sprintf("not within 50ms: n reaches -1: n=%d", n)
	if n < 2 || r.msg != want {
		t.Fatalf("after %d polls: failure %q, want %q", n, r.msg, want)
	}
}

func TestEventuallyOrReturnsOnceTrue(t *testing.T) {
	n := 0
	EventuallyOr(t, 5*time.Second, func() bool { n++; return n == 3 },
		func() string { return "never called" })
	if n != 3 {
		t.Fatalf("polled %d times, want 3", n)
	}
}
