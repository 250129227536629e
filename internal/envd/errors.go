package envd

import (
	"encoding/json"
	"fmt"
	"net/http"
	"sync"
)

// catError is an error whose message is exactly msg and which matches an errdefs category.
type catError struct {
	msg string
	cat error
}

func (e *catError) Error() string { return e.msg }
func (e *catError) Unwrap() error { return e.cat }

// errorf builds an error with the given message in category cat (an errdefs error).
func errorf(cat error, format string, args ...any) error {
	return &catError{msg: fmt.Sprintf(format, args...), cat: cat}
}

// writeJSONError writes the plain-HTTP error shape {"code":<status>,"message":...}.
func writeJSONError(w http.ResponseWriter, status int, msg string) {
	writeJSON(w, status, map[string]any{"code": status, "message": msg})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// queue is an unbounded FIFO with a wake-up channel, so a slow stream never stalls a producer.
type queue[T any] struct {
	mu     sync.Mutex
	items  []T
	notify chan struct{}
}

func newQueue[T any]() *queue[T] { return &queue[T]{notify: make(chan struct{}, 1)} }

func (q *queue[T]) push(v T) {
	q.mu.Lock()
	q.items = append(q.items, v)
	q.mu.Unlock()
	select {
	case q.notify <- struct{}{}:
	default:
	}
}

func (q *queue[T]) take() []T {
	q.mu.Lock()
	defer q.mu.Unlock()
	items := q.items
	q.items = nil
	return items
}
