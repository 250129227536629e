// Command envd is the in-sandbox agent that serves E2B's envd protocol on :49983 (envdclient.Port,
// the port's one definition). It runs as the sandbox's init (pid 1), so it also reaps orphaned
// processes. Build it static: CGO_ENABLED=0.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/ember-sandbox/ember/internal/envd"
	"github.com/ember-sandbox/ember/internal/envdclient"
)

func main() {
	port := flag.Int("port", envdclient.Port, "TCP port to listen on (all addresses)")
	defaultUser := flag.String("default-user", "user", "user that runs commands when a request names none")
	workdir := flag.String("default-workdir", "", "cwd of commands that name none (default: the user's home)")
	debug := flag.Bool("debug", false, "log at debug level")
	oomGuard := flag.Bool("oom-guard", true, "as pid 1, SIGKILL the largest process when the guest runs out of memory")
	flag.Parse()

	level := slog.LevelInfo
	if *debug {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))

	// The image environment (the runtime spec's env) is the base of every command's environment.
	var base []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		switch k {
		case "HOME", "USER", "LOGNAME", "PWD", "OLDPWD", "SHLVL", "_":
			continue
		}
		base = append(base, kv)
	}

	srv := envd.New(envd.Config{
		DefaultUser:    *defaultUser,
		DefaultWorkdir: *workdir,
		BaseEnv:        base,
		ReapOrphans:    true,
		OOMGuard:       *oomGuard && os.Getpid() == 1,
		Logger:         log,
	})
	defer srv.Close()

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	addr := fmt.Sprintf("0.0.0.0:%d", *port)
	log.Info("envd listening", "addr", addr)
	if err := srv.ListenAndServe(ctx, addr); err != nil && ctx.Err() == nil {
		log.Error("envd stopped", "err", err)
		os.Exit(1)
	}
}
