package envd

import (
	"log/slog"
	"testing"
)

func TestDbgAlive(t *testing.T) {
	f := newFakeProc(t, 1024, 40)
	f.set(100, 100)
	f.set(100, 0)
	g := newOOMGuard(slog.New(slog.DiscardHandler), oomGuardConfig{Proc: f.dir})
	t.Log(g.alive(100))
}
