package sandbox

import (
	"context"
	"errors"
)

// Lifecycle events: the Manager reports every change of its sandboxes and templates where the
// change commits (after its store write), whoever caused it — an API call, the reaper (a
// timeout's kill or auto-pause), traffic waking an autoResume sandbox, an instance found dead,
// the start-up reconcile. The cluster keeps its routing by them; metrics and logs may listen
// too.

// EventKind is what changed.
type EventKind int

const (
	// EventStarted: a sandbox runs here that did not (Reason StartCreated, StartForked, or
	// StartAdopted: found running by the start-up reconcile).
	EventStarted EventKind = iota + 1
	// EventPaused: a sandbox was paused; its state is in its local pause image
	// (Sandbox.Runtime.Image; its memory too unless Sandbox.PausedFilesOnly). Also a paused
	// sandbox adopted from the image store (Reason StartAdopted).
	EventPaused
	// EventResumed: a paused sandbox runs again (an API resume, or traffic waking it).
	EventResumed
	// EventStored: a paused sandbox's pause image is in the image store too (Event.Stored):
	// another node can resume it. In Config.StorePauses mode every memory pause is followed by
	// it before the pause answers.
	EventStored
	// EventEnded: a sandbox ended (Reason: Sandbox.EndReason — EndKilled, EndTimeout, the
	// runtime's exit reason for an instance that died, EndLost, ...).
	EventEnded
	// EventTemplateReady: a template or snapshot became ready here (built, step-built, a
	// snapshot stored).
	EventTemplateReady
	// EventTemplateGone: a template or snapshot was deleted here.
	EventTemplateGone
)

var kindNames = [...]string{"", "started", "paused", "resumed", "stored", "ended", "template-ready", "template-gone"}

func (k EventKind) String() string {
	if k > 0 && int(k) < len(kindNames) {
		return kindNames[k]
	}
	return "unknown"
}

// How a sandbox started (Event.Reason of EventStarted).
const (
	StartCreated = "created"
	StartForked  = "forked"
	StartAdopted = "adopted"
)

// Event is one change.
type Event struct {
	Kind EventKind
	// Sandbox is the sandbox after the change (a copy), for sandbox events.
	Sandbox *Sandbox
	// Reason: how it started (EventStarted), why it ended (EventEnded).
	Reason string
	// Reservation is the cluster placement a create or fork child consumes (EventStarted;
	// CreateRequest.Reservation).
	Reservation string
	// Stored is the sandbox as another node adopts it from the image store (EventStored).
	Stored *PortableSandbox
	// Template is the template (a copy), for template events.
	Template *Template
}

// Listener is told every change.
//
// Sandbox events come synchronously, in the order of the changes, under the sandbox's lock and
// before the operation that made the change answers: a listener keeps them short. An error
// from EventStarted or EventResumed ends the sandbox (nothing runs that the listener — the
// cluster — does not route here) and fails the operation; an error from EventStored leaves the
// sandbox paused on this node only; other errors are logged. Template events come in the
// background.
type Listener interface {
	Changed(ctx context.Context, ev Event) error
}

// Listen adds l to the listeners (Config.Listeners are the first). Call it before serving:
// for a listener that needs the Manager first (the cluster).
func (m *Manager) Listen(l Listener) {
	m.lmu.Lock()
	defer m.lmu.Unlock()
	ls := append(append([]Listener(nil), m.listeners()...), l)
	m.ls.Store(&ls)
}

func (m *Manager) listeners() []Listener {
	if p := m.ls.Load(); p != nil {
		return *p
	}
	return nil
}

// emit tells every listener ev (all of them, even when one fails) and returns their errors.
func (m *Manager) emit(ctx context.Context, ev Event) error {
	var errs []error
	for _, l := range m.listeners() {
		if err := l.Changed(ctx, ev); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// emitLocked reports a change of e's sandbox (e.mu held); errors are logged.
func (m *Manager) emitLocked(ctx context.Context, e *entry, kind EventKind, reason string) {
	if err := m.emit(context.WithoutCancel(ctx), Event{Kind: kind, Sandbox: m.snapshotOf(e), Reason: reason}); err != nil {
		m.logger(e.sb.ID).Warn("lifecycle listener", "event", kind.String(), "err", err)
	}
}

// startedLocked reports that e's sandbox now runs here (EventStarted or EventResumed, e.mu
// held). When a listener refuses it, the sandbox ends and the error is returned.
func (m *Manager) startedLocked(ctx context.Context, e *entry, kind EventKind, reason, reservation string) error {
	err := m.emit(ctx, Event{Kind: kind, Sandbox: m.snapshotOf(e), Reason: reason, Reservation: reservation})
	if err != nil {
		m.logger(e.sb.ID).Warn("lifecycle listener refused the sandbox: ending it", "event", kind.String(), "err", err)
		m.endLocked(ctx, e, EndKilled)
	}
	return err
}

// templateEvent reports a template change in the background.
func (m *Manager) templateEvent(kind EventKind, tpl *Template) {
	if len(m.listeners()) == 0 {
		return
	}
	c := *tpl
	m.goBG(func() {
		if err := m.emit(m.bg, Event{Kind: kind, Template: &c}); err != nil {
			m.log.Warn("lifecycle listener", "event", kind.String(), "template", c.ID, "err", err)
		}
	})
}
