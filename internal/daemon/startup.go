package daemon

import (
	"context"
	"fmt"
	"sync"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// startup tracks the start-up templates while the daemon builds them, one after the other
// (base first): the API serves meanwhile (api.Startup), and a create of one waits for its
// build.
type startup struct {
	mu      sync.Mutex
	pending []string                 // not built yet, in build order
	done    map[string]chan struct{} // closed when its build ended
	errs    map[string]error
}

func newStartup(names []string) *startup {
	s := &startup{pending: append([]string(nil), names...), done: map[string]chan struct{}{}, errs: map[string]error{}}
	for _, n := range names {
		s.done[n] = make(chan struct{})
	}
	return s
}

// run builds every pending template with build, in order; it stops at the first failure,
// which the templates not built yet share.
func (s *startup) run(build func(name string) error) error {
	for _, name := range s.Building() {
		if err := build(name); err != nil {
			s.finishAll(fmt.Errorf("template %q: its start-up build failed: %v: %w", name, err, errdefs.ErrUnavailable))
			return err
		}
		s.finish(name, nil)
	}
	return nil
}

func (s *startup) finish(name string, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, n := range s.pending {
		if n == name {
			s.pending = append(s.pending[:i:i], s.pending[i+1:]...)
			s.errs[name] = err
			close(s.done[name])
			return
		}
	}
}

func (s *startup) finishAll(err error) {
	for _, n := range s.Building() {
		s.finish(n, err)
	}
}

// Building lists the start-up templates not built yet.
func (s *startup) Building() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.pending...)
}

// Wait waits for the start-up build of template name, if it is one.
func (s *startup) Wait(ctx context.Context, name string) error {
	s.mu.Lock()
	done, ok := s.done[name]
	s.mu.Unlock()
	if !ok {
		return nil
	}
	select {
	case <-done:
	case <-ctx.Done():
		return ctx.Err()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.errs[name]
}
