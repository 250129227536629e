package testutil

import (
	"net"
	"strings"
	"sync"
	"time"
)

// WaitListening polls addr until it accepts a TCP connection (true), or the process behind it
// exits (exited is closed) or timeout passes (false).
func WaitListening(addr string, exited <-chan struct{}, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		select {
		case <-exited:
			return false
		default:
		}
		c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
		if err == nil {
			c.Close()
			return true
		}
		time.Sleep(20 * time.Millisecond)
	}
	return false
}

// LogBuffer collects a child process's output for a failure message: safe for concurrent
// writes, and it keeps only the first MiB.
type LogBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *LogBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.b.Len() > 1<<20 {
		return len(p), nil
	}
	return s.b.Write(p)
}

func (s *LogBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
