package api

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/sandbox/sandboxtest"
	"github.com/ember-sandbox/ember/internal/store"
	"github.com/ember-sandbox/ember/internal/template/build"
)

// service is the real sandbox Manager over the sandbox package's test doubles (a fake driver
// and network, the real store), so the API is tested against the domain core itself rather
// than a second state machine. Every guest connection (envd's /health and /init during a
// launch, and everything the sandbox plane proxies) reaches the test's guest server; GuestURL
// calls are recorded. fork and build, when set, replace the Manager's for the edge's own error
// paths (a panic, an internal error).
type service struct {
	*sandbox.Manager
	// Builds runs template builds on the Manager (Config.Builds: s.builds()).
	Builds  *build.Manager
	t       testing.TB
	rig     *sandboxtest.Rig
	dataDir string

	mu        sync.Mutex
	guestHits []string                       // "id:port" per GuestURL call that succeeded
	down      map[string]bool                // guest IPs whose connections are refused
	conns     map[string]map[net.Conn]string // guest IP -> its open connections

	fork  func(ctx context.Context, id string, count int, timeout time.Duration) ([]sandbox.ForkResult, error)
	build func(ctx context.Context, req sandbox.BuildRequest, progress func(string)) (*sandbox.Template, error)
}

// newService starts a Manager with the `base` template built; guestAddr is where every guest
// connection goes.
func newService(t testing.TB, guestAddr string) *service {
	t.Helper()
	return newServiceWith(t, guestAddr, nil)
}

// newServiceWith is newService with the Manager's configuration changed by mod.
func newServiceWith(t testing.TB, guestAddr string, mod func(*sandbox.Config)) *service {
	t.Helper()
	return newServiceBuilds(t, guestAddr, mod, nil)
}

// newServiceBuilds is newServiceWith with the build Manager's configuration changed by bmod.
func newServiceBuilds(t testing.TB, guestAddr string, mod func(*sandbox.Config), bmod func(*build.Config)) *service {
	t.Helper()
	dir := t.TempDir()
	st, err := store.Open(filepath.Join(dir, "ember.db"))
	if err != nil {
		t.Fatal(err)
	}
	rig := sandboxtest.NewRig(256)
	s := &service{t: t, rig: rig, down: map[string]bool{}, conns: map[string]map[net.Conn]string{}, dataDir: filepath.Join(dir, "data")}
	var d net.Dialer
	cfg := sandbox.Config{
		DataDir: filepath.Join(dir, "data"), Driver: rig.Driver, Network: rig.Network, Store: st,
		Builder: sandboxtest.Builder{}, Logger: slog.New(slog.DiscardHandler),
		Dial: func(ctx context.Context, network, addr string) (net.Conn, error) {
			host, _, _ := net.SplitHostPort(addr)
			s.mu.Lock()
			down, closed := s.down[host], s.down[addr]
			s.mu.Unlock()
			if down {
				return nil, fmt.Errorf("dial %s: connection refused", addr)
			}
			if closed { // as a guest with nothing listening on the port answers
				return nil, &net.OpError{Op: "dial", Net: network, Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}
			}
			c, err := d.DialContext(ctx, network, guestAddr)
			if err == nil {
				s.mu.Lock()
				if s.conns[host] == nil {
					s.conns[host] = map[net.Conn]string{}
				}
				s.conns[host][c] = addr
				s.mu.Unlock()
			}
			return c, err
		},
		EnvdTimeout: 2 * time.Second, DrainTimeout: time.Second, CPUCount: 2, MemoryMB: 512, DiskMB: 1024,
	}
	if mod != nil {
		mod(&cfg)
	}
	m, err := sandbox.New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		m.Close()
		rig.Driver.Close()
		st.Close()
	})
	bcfg := build.Config{DataDir: cfg.DataDir, Driver: cfg.Driver, Store: cfg.Store, Builder: cfg.Builder, Logger: cfg.Logger}
	if bmod != nil {
		bmod(&bcfg)
	}
	b, err := build.New(bcfg, m.BuildHost())
	if err != nil {
		t.Fatal(err)
	}
	m.SetBuiltins(b)
	if _, err := b.BuildTemplate(context.Background(), sandbox.BuildRequest{Name: "base"}, nil); err != nil {
		t.Fatal(err)
	}
	s.Manager, s.Builds = m, b
	return s
}

// unreachable makes a running sandbox's guest refuse every new connection and cuts the ones
// open to it (the guest transport keeps connections alive), as a guest that went down would.
func (s *service) unreachable(sb *sandbox.Sandbox) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.down[sb.Runtime.GuestIP] = true
	for c := range s.conns[sb.Runtime.GuestIP] {
		c.Close()
	}
	delete(s.conns, sb.Runtime.GuestIP)
}

// closePort makes a running sandbox's guest refuse connections to port, as one with nothing
// listening there does.
func (s *service) closePort(sb *sandbox.Sandbox, port int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.down[net.JoinHostPort(sb.Runtime.GuestIP, strconv.Itoa(port))] = true
}

// add creates a sandbox through the Manager and brings it to state.
func (s *service) add(state sandbox.State, md map[string]string) *sandbox.Sandbox {
	s.t.Helper()
	sb, err := s.tryAdd(state, md)
	if err != nil {
		s.t.Fatal(err)
	}
	return sb
}

func (s *service) tryAdd(state sandbox.State, md map[string]string) (*sandbox.Sandbox, error) {
	ctx := context.Background()
	sb, err := s.Create(ctx, sandbox.CreateRequest{TemplateID: "base", Metadata: md})
	if err != nil {
		return nil, fmt.Errorf("create: %w", err)
	}
	switch state {
	case sandbox.StatePaused:
		err = s.Pause(ctx, sb.ID)
	case sandbox.StateKilled:
		err = s.Kill(ctx, sb.ID)
	}
	if err != nil {
		return nil, fmt.Errorf("bring %s to %s: %w", sb.ID, state, err)
	}
	sb.State = state
	return sb, nil
}

// state is the sandbox's state as the Manager has it (StateKilled for ended ones).
func (s *service) state(id string) sandbox.State {
	list, _ := s.List(context.Background(), sandbox.ListFilter{States: []sandbox.State{sandbox.StateRunning, sandbox.StatePaused, sandbox.StateKilled}})
	for _, sb := range list {
		if sb.ID == id {
			return sb.State
		}
	}
	return sandbox.StateKilled
}

// GuestURL records which sandbox and port the sandbox plane asked for.
func (s *service) GuestURL(ctx context.Context, id string, port int) (string, error) {
	u, err := s.Manager.GuestURL(ctx, id, port)
	if err == nil {
		s.mu.Lock()
		s.guestHits = append(s.guestHits, id+":"+strconv.Itoa(port))
		s.mu.Unlock()
	}
	return u, err
}

func (s *service) hits() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.guestHits...)
}

func (s *service) Fork(ctx context.Context, id string, count int, timeout time.Duration) ([]sandbox.ForkResult, error) {
	if s.fork != nil {
		return s.fork(ctx, id, count, timeout)
	}
	return s.Manager.Fork(ctx, id, count, timeout)
}

// builds is the service's template builds as the API serves them (Config.Builds).
func (s *service) builds() build.TemplateBuilder { return serviceBuilds{s.Builds, s} }

type serviceBuilds struct {
	*build.Manager
	s *service
}

func (b serviceBuilds) BuildTemplate(ctx context.Context, req sandbox.BuildRequest, progress func(string)) (*sandbox.Template, error) {
	if b.s.build != nil {
		return b.s.build(ctx, req, progress)
	}
	return b.Manager.BuildTemplate(ctx, req, progress)
}

func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(b []byte) (int, error) { w.t.Log(string(b)); return len(b), nil }

var _ sandbox.Service = (*service)(nil)
