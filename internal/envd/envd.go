// Package envd is the in-sandbox agent: it implements E2B's envd protocol (the process.Process
// and filesystem.Filesystem Connect services, /files, /health, /envs, /metrics and /init) so the
// unmodified E2B SDKs can run commands and move files inside a sandbox. It owns the processes it
// starts, the filesystem watchers it creates and, when it is the sandbox's init, the reaping of
// orphans. It knows nothing of the daemon, sandboxes' lifecycles or the host.
package envd

import (
	"context"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"sync"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/api/gen/filesystem/filesystemconnect"
	"github.com/ember-sandbox/ember/api/gen/process/processconnect"
)

// Config presets a Server. Every field is optional; /init can change the same settings later.
type Config struct {
	// DefaultUser runs commands and owns written files when a request names no user. Default "user".
	DefaultUser string
	// DefaultWorkdir is the cwd of commands that name none. Empty means the user's home.
	DefaultWorkdir string
	// AccessToken, when set, is required in X-Access-Token on every request but /health
	// (or a valid signature on /files).
	AccessToken string
	// EnvVars are the default environment variables of every process (reported by GET /envs).
	EnvVars map[string]string
	// BaseEnv is the image environment ("K=V"), below the user's HOME/USER/LOGNAME and EnvVars.
	// It is not reported by /envs. When PATH is absent a standard one is used.
	BaseEnv []string
	// ReapOrphans makes envd reap zombies that are not its own commands (it must when it is pid 1).
	// When envd is not pid 1 it also becomes a child subreaper, so orphans reparent to it.
	ReapOrphans bool
	// OOMGuard makes envd the guest's out-of-memory killer (oomguard.go): when the memory in use
	// nears the total (/proc/meminfo), the largest process but envd is SIGKILLed. Only for envd
	// as a sandbox's init: on a host it would kill the host's processes.
	OOMGuard bool
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

// InitRequest is the body of POST /init. Absent fields leave the current setting unchanged;
// EnvVars are merged into the current defaults.
type InitRequest struct {
	EnvVars        map[string]string `json:"envVars,omitempty"`
	AccessToken    *string           `json:"accessToken,omitempty"`
	DefaultUser    *string           `json:"defaultUser,omitempty"`
	DefaultWorkdir *string           `json:"defaultWorkdir,omitempty"`
	Hostname       *string           `json:"hostname,omitempty"`
	Timestamp      *time.Time        `json:"timestamp,omitempty"`
}

// Server is one envd instance. Create it with New; serve Handler() or call Serve.
type Server struct {
	log *slog.Logger

	mu             sync.RWMutex
	defaultUser    string
	defaultWorkdir string
	accessToken    string
	envVars        map[string]string
	baseEnv        []string

	procs    *processManager
	watchers *watcherRegistry
	reaper   *reaper
	cpu      cpuSampler
	stopOOM  context.CancelFunc // nil without the guard
	oom      *oomGuard

	handler http.Handler
}

// New builds a Server from cfg. With cfg.ReapOrphans it starts the orphan reaper (stopped by Close).
func New(cfg Config) *Server {
	s := &Server{
		log:            cfg.Logger,
		defaultUser:    cfg.DefaultUser,
		defaultWorkdir: cfg.DefaultWorkdir,
		accessToken:    cfg.AccessToken,
		envVars:        maps.Clone(cfg.EnvVars),
		baseEnv:        append([]string(nil), cfg.BaseEnv...),
		watchers:       newWatcherRegistry(),
	}
	if s.log == nil {
		s.log = slog.Default()
	}
	if s.defaultUser == "" {
		s.defaultUser = "user"
	}
	if s.envVars == nil {
		s.envVars = map[string]string{}
	}
	s.procs = newProcessManager(s.log)
	if cfg.ReapOrphans {
		s.reaper = startReaper(s.log, s.procs)
		s.procs.reaper = s.reaper
	}
	if cfg.OOMGuard {
		ctx, cancel := context.WithCancel(context.Background())
		s.stopOOM, s.oom = cancel, newOOMGuard(s.log, oomGuardConfig{})
		s.procs.oom = s.oom
		go s.oom.run(ctx)
	}
	s.handler = s.routes()
	return s
}

// Handler serves the whole envd protocol.
func (s *Server) Handler() http.Handler { return s.handler }

func (s *Server) routes() http.Handler {
	opts := []connect.HandlerOption{
		connect.WithInterceptors(&authInterceptor{s: s}),
		// Never compress responses: connect-web rejects compressed stream envelopes.
		connect.WithCompressMinBytes(1 << 62),
	}
	mux := http.NewServeMux()
	mux.Handle(processconnect.NewProcessHandler(&processService{s: s}, opts...))
	mux.Handle(filesystemconnect.NewFilesystemHandler(&filesystemService{s: s}, opts...))
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusNoContent) })
	mux.Handle("GET /files", s.httpAuth(http.HandlerFunc(s.getFile)))
	mux.Handle("POST /files", s.httpAuth(http.HandlerFunc(s.postFiles)))
	mux.Handle("GET /envs", s.httpAuth(http.HandlerFunc(s.getEnvs)))
	mux.Handle("GET /metrics", s.httpAuth(http.HandlerFunc(s.getMetrics)))
	mux.Handle("POST /init", s.httpAuth(http.HandlerFunc(s.postInit)))
	return mux
}

// Serve serves envd on ln (HTTP/1.1 and h2c) until ctx is done, then shuts down gracefully.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	var protocols http.Protocols
	protocols.SetHTTP1(true)
	protocols.SetUnencryptedHTTP2(true)
	hs := &http.Server{
		Handler:           s.handler,
		Protocols:         &protocols,
		ReadHeaderTimeout: 30 * time.Second,
		ErrorLog:          slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
	}
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		err := hs.Shutdown(sctx)
		<-errc
		return err
	}
}

// ListenAndServe listens on addr (e.g. "0.0.0.0:49983") and calls Serve.
func (s *Server) ListenAndServe(ctx context.Context, addr string) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	return s.Serve(ctx, ln)
}

// Close kills the processes envd started, removes its watchers and stops the reaper.
func (s *Server) Close() error {
	s.procs.killAll()
	s.watchers.closeAll()
	if s.reaper != nil {
		s.reaper.stop()
	}
	if s.stopOOM != nil {
		s.stopOOM()
		<-s.oom.stopped
	}
	return nil
}

// Init applies an /init request in-process (no token check).
func (s *Server) Init(req InitRequest) {
	s.mu.Lock()
	for k, v := range req.EnvVars {
		s.envVars[k] = v
	}
	if req.AccessToken != nil {
		s.accessToken = *req.AccessToken
	}
	if req.DefaultUser != nil && *req.DefaultUser != "" {
		s.defaultUser = *req.DefaultUser
	}
	if req.DefaultWorkdir != nil {
		s.defaultWorkdir = *req.DefaultWorkdir
	}
	s.mu.Unlock()
	if req.Hostname != nil && *req.Hostname != "" {
		if err := unix.Sethostname([]byte(*req.Hostname)); err != nil {
			s.log.Debug("sethostname failed", "hostname", *req.Hostname, "err", err)
		}
	}
}

// EnvVars returns a copy of the default environment variables.
func (s *Server) EnvVars() map[string]string {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return maps.Clone(s.envVars)
}

type settings struct {
	defaultUser    string
	defaultWorkdir string
	accessToken    string
	envVars        map[string]string
	baseEnv        []string
}

func (s *Server) settings() settings {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return settings{
		defaultUser:    s.defaultUser,
		defaultWorkdir: s.defaultWorkdir,
		accessToken:    s.accessToken,
		envVars:        maps.Clone(s.envVars),
		baseEnv:        s.baseEnv,
	}
}
