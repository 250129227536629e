package runtime

import "fmt"

// LaunchError is a failed start or restore of an instance whose runtime logs were kept: Logs
// names where, Reason is the line of them that says why the instance died ("" when none
// does). Err is the driver's error (its errdefs category included).
type LaunchError struct {
	ID, Op string // instance and operation (run, create, restore)
	Reason string
	Logs   string
	Err    error
}

func (e *LaunchError) Error() string { return e.Summary() }
func (e *LaunchError) Unwrap() error { return e.Err }

// Summary is the error in one line, short enough for a build log or an API message.
func (e *LaunchError) Summary() string {
	why := e.Reason
	if why == "" {
		why = "no reason in its logs"
	}
	return fmt.Sprintf("the sandbox failed to %s (%s): %s (runtime logs kept in %s)", e.Op, e.ID, why, e.Logs)
}
