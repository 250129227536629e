package cli

import (
	"io"
	"log/slog"
)

type slogLevel = slog.Level

func newLogger(w io.Writer, level *slogLevel) *slog.Logger {
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: *level}))
}
