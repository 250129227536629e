package envd_test

import (
	"context"
	"encoding/base64"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"os/user"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/ember-sandbox/ember/api/gen/filesystem/filesystemconnect"
	pb "github.com/ember-sandbox/ember/api/gen/process"
	"github.com/ember-sandbox/ember/api/gen/process/processconnect"
	"github.com/ember-sandbox/ember/internal/envd"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// testUser is a throwaway account created for the package's tests (the host has no "user").
var testUser *user.User

func TestMain(m *testing.M) {
	code := func() int {
		if os.Geteuid() == 0 {
			name := fmt.Sprintf("envdt%d", os.Getpid())
			if out, err := exec.Command("useradd", "-m", "-G", "users", "-s", "/bin/bash", name).CombinedOutput(); err != nil {
				fmt.Fprintf(os.Stderr, "useradd %s: %v: %s\n", name, err, out)
				return 1
			}
			defer exec.Command("userdel", "-r", "-f", name).Run()
			u, err := user.Lookup(name)
			if err != nil {
				fmt.Fprintf(os.Stderr, "lookup %s: %v\n", name, err)
				return 1
			}
			testUser = u
		}
		return m.Run()
	}()
	os.Exit(code)
}

// harness is one in-process envd on a loopback httptest server, with generated clients.
type harness struct {
	srv  *envd.Server
	url  string
	proc processconnect.ProcessClient
	fs   filesystemconnect.FilesystemClient
}

// newHarness needs root and the test user; the default user is the test user.
func newHarness(t *testing.T, cfg envd.Config) *harness {
	t.Helper()
	testutil.RequireRoot(t)
	if cfg.DefaultUser == "" {
		cfg.DefaultUser = testUser.Username
	}
	srv := envd.New(cfg)
	ts := httptest.NewServer(srv.Handler())
	t.Cleanup(func() {
		ts.Close()
		srv.Close()
	})
	// The SDKs speak Connect with JSON; so do these clients.
	return &harness{
		srv:  srv,
		url:  ts.URL,
		proc: processconnect.NewProcessClient(ts.Client(), ts.URL, connect.WithProtoJSON()),
		fs:   filesystemconnect.NewFilesystemClient(ts.Client(), ts.URL, connect.WithProtoJSON()),
	}
}

func basic(user string) string {
	return "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"))
}

// result collects one process stream.
type result struct {
	pid    uint32
	stdout string
	stderr string
	pty    string
	end    *pb.ProcessEvent_EndEvent
	err    error
	chunks int // stdout data events
}

// bash runs script with bash -c (the SDK adds -l; this host's login profile is slow).
func bash(script string) *pb.ProcessConfig {
	return &pb.ProcessConfig{Cmd: "/bin/bash", Args: []string{"-c", script}}
}

func ptr[T any](v T) *T { return &v }

type eventStream[T any] interface {
	Receive() bool
	Msg() T
	Err() error
}

// collect reads a Start/Connect stream, whose first event must be start, to its end.
func collect[T interface{ GetEvent() *pb.ProcessEvent }](s eventStream[T]) result {
	return collectFrom(s, true)
}

// collectRest reads the rest of a stream whose start event was already read.
func collectRest[T interface{ GetEvent() *pb.ProcessEvent }](s eventStream[T]) result {
	return collectFrom(s, false)
}

func collectFrom[T interface{ GetEvent() *pb.ProcessEvent }](s eventStream[T], first bool) result {
	var r result
	for s.Receive() {
		ev := s.Msg().GetEvent()
		if first {
			if ev.GetStart() == nil {
				r.err = fmt.Errorf("first event is not start: %v", ev)
				return r
			}
			r.pid = ev.GetStart().GetPid()
			first = false
			continue
		}
		switch {
		case ev.GetData() != nil:
			d := ev.GetData()
			if len(d.GetStdout()) > 0 {
				r.chunks++
			}
			r.stdout += string(d.GetStdout())
			r.stderr += string(d.GetStderr())
			r.pty += string(d.GetPty())
		case ev.GetEnd() != nil:
			r.end = ev.GetEnd()
		}
	}
	r.err = s.Err()
	return r
}

// run starts a command as user ("" = default) and waits for its end.
func (h *harness) run(t *testing.T, user string, cfg *pb.ProcessConfig, stdin *bool) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req := connect.NewRequest(&pb.StartRequest{Process: cfg, Stdin: stdin})
	if user != "" {
		req.Header().Set("Authorization", basic(user))
	}
	stream, err := h.proc.Start(ctx, req)
	if err != nil {
		return result{err: err}
	}
	defer stream.Close()
	return collect[*pb.StartResponse](stream)
}

func codeOf(err error) connect.Code {
	if err == nil {
		return 0
	}
	return connect.CodeOf(err)
}

func testutilRoot(t *testing.T) { t.Helper(); testutil.RequireRoot(t) }

func newProcClient(c *http.Client, url string) processconnect.ProcessClient {
	return processconnect.NewProcessClient(c, url, connect.WithProtoJSON())
}
