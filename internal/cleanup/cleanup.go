// Package cleanup is a stack of undo steps. Register a step the moment a resource is acquired;
// on failure Run undoes everything in reverse order, on success Release forgets the steps
// (ownership passes to whoever keeps the resource).
package cleanup

import "errors"

// Stack of undo functions. The zero value is ready to use; not safe for concurrent use.
type Stack struct {
	fns []func() error
}

// Add pushes an undo step.
func (s *Stack) Add(fn func() error) { s.fns = append(s.fns, fn) }

// Run runs every step in reverse order and returns their joined errors.
func (s *Stack) Run() error {
	var errs []error
	for i := len(s.fns) - 1; i >= 0; i-- {
		if err := s.fns[i](); err != nil {
			errs = append(errs, err)
		}
	}
	s.fns = nil
	return errors.Join(errs...)
}

// Release forgets every step without running it.
func (s *Stack) Release() { s.fns = nil }
