package envd

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"slices"
	"strconv"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	pb "github.com/ember-sandbox/ember/api/gen/process"
	"github.com/ember-sandbox/ember/api/gen/process/processconnect"
	"github.com/ember-sandbox/ember/internal/errdefs"
)

const defaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// processService implements process.Process.
type processService struct{ s *Server }

var _ processconnect.ProcessHandler = (*processService)(nil)

// account returns the user named by the request's Basic authorization, or the default user.
func (s *Server) account(h http.Header) (*account, error) {
	name, err := basicUser(h)
	if err != nil {
		return nil, errorf(errdefs.ErrInvalid, "%v", err)
	}
	if name == "" {
		name = s.settings().defaultUser
	}
	acct, err := lookupAccount(name)
	if err != nil {
		return nil, errorf(errdefs.ErrUnauthorized, "invalid username: '%s'", name) // E2B envd's words
	}
	return acct, nil
}

// processEnv layers the environment of a command: standard PATH, image env, the user's identity,
// the default env vars, then the request's envs.
func processEnv(st settings, acct *account, req map[string]string) []string {
	env := map[string]string{"PATH": defaultPath}
	for _, kv := range st.baseEnv {
		if k, v, ok := cutEnv(kv); ok {
			env[k] = v
		}
	}
	env["HOME"] = acct.Home
	env["USER"] = acct.Name
	env["LOGNAME"] = acct.Name
	for k, v := range st.envVars {
		env[k] = v
	}
	for k, v := range req {
		env[k] = v
	}
	out := make([]string, 0, len(env))
	for k, v := range env {
		out = append(out, k+"="+v)
	}
	slices.Sort(out)
	return out
}

func cutEnv(kv string) (string, string, bool) {
	for i := 1; i < len(kv); i++ {
		if kv[i] == '=' {
			return kv[:i], kv[i+1:], true
		}
	}
	return "", "", false
}

func (s *Server) startSpec(ctx context.Context, h http.Header, req *pb.StartRequest) (*startSpec, error) {
	if req.GetProcess().GetCmd() == "" {
		return nil, errorf(errdefs.ErrInvalid, "process.cmd is empty")
	}
	acct, err := s.account(h)
	if err != nil {
		return nil, err
	}
	st := s.settings()
	config := proto.Clone(req.GetProcess()).(*pb.ProcessConfig)

	var cwd string
	switch {
	case config.Cwd != nil && *config.Cwd != "":
		cwd = acct.resolvePath(*config.Cwd)
	case st.defaultWorkdir != "":
		cwd = acct.resolvePath(st.defaultWorkdir)
	default:
		cwd = acct.Home
		if fi, err := os.Stat(cwd); err != nil || !fi.IsDir() {
			cwd = "/"
		}
	}
	if fi, err := os.Stat(cwd); err != nil || !fi.IsDir() {
		return nil, errorf(errdefs.ErrInvalid, "cwd '%s' does not exist or is not a directory", cwd)
	}
	config.Cwd = &cwd

	env := processEnv(st, acct, config.GetEnvs())
	path, err := lookPath(config.GetCmd(), env)
	if err != nil {
		return nil, err
	}
	spec := &startSpec{
		acct:      acct,
		config:    config,
		path:      path,
		cwd:       cwd,
		env:       env,
		stdinOpen: req.Stdin == nil || *req.Stdin,
		tag:       req.Tag,
	}
	if req.Pty != nil {
		size := &pb.PTY_Size{Cols: 80, Rows: 24}
		if req.Pty.GetSize().GetCols() > 0 && req.Pty.GetSize().GetRows() > 0 {
			size = req.Pty.GetSize()
		}
		spec.pty = size
	}
	if dl, ok := ctx.Deadline(); ok {
		spec.deadline = dl
	}
	return spec, nil
}

func (ps *processService) Start(ctx context.Context, req *connect.Request[pb.StartRequest], stream *connect.ServerStream[pb.StartResponse]) error {
	spec, err := ps.s.startSpec(ctx, req.Header(), req.Msg)
	if err != nil {
		if errors.Is(err, errdefs.ErrUnauthorized) {
			return connect.NewError(connect.CodeUnauthenticated, err)
		}
		return connect.NewError(connect.CodeInvalidArgument, err)
	}
	p, sub, err := ps.s.procs.start(spec)
	if err != nil {
		return connect.NewError(connect.CodeInvalidArgument, err)
	}
	ps.s.log.Debug("process started", "pid", p.pid, "cmd", spec.config.GetCmd(), "user", spec.acct.Name)
	return follow(ctx, p, sub, req.Header(), func(ev *pb.ProcessEvent) error {
		return stream.Send(&pb.StartResponse{Event: ev})
	})
}

func (ps *processService) Connect(ctx context.Context, req *connect.Request[pb.ConnectRequest], stream *connect.ServerStream[pb.ConnectResponse]) error {
	p, err := ps.s.procs.get(req.Msg.GetProcess())
	if err != nil {
		return toConnectError(err)
	}
	return follow(ctx, p, p.subscribe(), req.Header(), func(ev *pb.ProcessEvent) error {
		return stream.Send(&pb.ConnectResponse{Event: ev})
	})
}

// keepaliveInterval reads Keepalive-Ping-Interval (seconds); 0 means no keepalives.
func keepaliveInterval(h http.Header) time.Duration {
	v, err := strconv.Atoi(h.Get("Keepalive-Ping-Interval"))
	if err != nil || v <= 0 {
		return 0
	}
	return time.Duration(v) * time.Second
}

// follow streams start{pid}, then the process's events, until its end event or ctx ends.
// Leaving early (client gone, deadline) does not touch the process.
func follow(ctx context.Context, p *proc, sub *subscriber, h http.Header, send func(*pb.ProcessEvent) error) error {
	defer p.unsubscribe(sub)
	if err := send(&pb.ProcessEvent{Event: &pb.ProcessEvent_Start{Start: &pb.ProcessEvent_StartEvent{Pid: p.pid}}}); err != nil {
		return err
	}
	var tick <-chan time.Time
	if iv := keepaliveInterval(h); iv > 0 {
		t := time.NewTicker(iv)
		defer t.Stop()
		tick = t.C
	}
	keepalive := &pb.ProcessEvent{Event: &pb.ProcessEvent_Keepalive{Keepalive: &pb.ProcessEvent_KeepAlive{}}}
	for {
		select {
		case <-sub.notify:
			for _, ev := range sub.take() {
				_, isEnd := ev.Event.(*pb.ProcessEvent_End)
				if isEnd && p.timedOut.Load() {
					return connect.NewError(connect.CodeDeadlineExceeded, fmt.Errorf("process %d was killed: timeout exceeded", p.pid))
				}
				if err := send(ev); err != nil {
					return err
				}
				if isEnd {
					return nil
				}
			}
		case <-tick:
			if err := send(keepalive); err != nil {
				return err
			}
		case <-ctx.Done():
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return connect.NewError(connect.CodeDeadlineExceeded, fmt.Errorf("process %d: timeout exceeded", p.pid))
			}
			return connect.NewError(connect.CodeCanceled, ctx.Err())
		}
	}
}

func (ps *processService) List(context.Context, *connect.Request[pb.ListRequest]) (*connect.Response[pb.ListResponse], error) {
	return connect.NewResponse(&pb.ListResponse{Processes: ps.s.procs.list()}), nil
}

func (ps *processService) Update(_ context.Context, req *connect.Request[pb.UpdateRequest]) (*connect.Response[pb.UpdateResponse], error) {
	p, err := ps.s.procs.get(req.Msg.GetProcess())
	if err != nil {
		return nil, toConnectError(err)
	}
	if req.Msg.Pty != nil {
		if err := p.resize(req.Msg.GetPty().GetSize()); err != nil {
			return nil, toConnectError(err)
		}
	}
	return connect.NewResponse(&pb.UpdateResponse{}), nil
}

func (ps *processService) sendInput(sel *pb.ProcessSelector, in *pb.ProcessInput) error {
	p, err := ps.s.procs.get(sel)
	if err != nil {
		return err
	}
	switch v := in.GetInput().(type) {
	case *pb.ProcessInput_Stdin:
		return p.writeInput(v.Stdin, false)
	case *pb.ProcessInput_Pty:
		return p.writeInput(v.Pty, true)
	}
	return nil
}

func (ps *processService) SendInput(_ context.Context, req *connect.Request[pb.SendInputRequest]) (*connect.Response[pb.SendInputResponse], error) {
	if err := ps.sendInput(req.Msg.GetProcess(), req.Msg.GetInput()); err != nil {
		return nil, toConnectError(err)
	}
	return connect.NewResponse(&pb.SendInputResponse{}), nil
}

func (ps *processService) StreamInput(_ context.Context, stream *connect.ClientStream[pb.StreamInputRequest]) (*connect.Response[pb.StreamInputResponse], error) {
	var sel *pb.ProcessSelector
	for stream.Receive() {
		switch ev := stream.Msg().GetEvent().(type) {
		case *pb.StreamInputRequest_Start:
			sel = ev.Start.GetProcess()
			if _, err := ps.s.procs.get(sel); err != nil {
				return nil, toConnectError(err)
			}
		case *pb.StreamInputRequest_Data:
			if sel == nil {
				return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("the first message must be start"))
			}
			if err := ps.sendInput(sel, ev.Data.GetInput()); err != nil {
				return nil, toConnectError(err)
			}
		}
	}
	if err := stream.Err(); err != nil {
		return nil, err
	}
	return connect.NewResponse(&pb.StreamInputResponse{}), nil
}

func (ps *processService) SendSignal(ctx context.Context, req *connect.Request[pb.SendSignalRequest]) (*connect.Response[pb.SendSignalResponse], error) {
	var sig syscall.Signal
	switch req.Msg.GetSignal() {
	case pb.Signal_SIGNAL_SIGKILL:
		sig = syscall.SIGKILL
	case pb.Signal_SIGNAL_SIGTERM:
		sig = syscall.SIGTERM
	default:
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("unsupported signal %v", req.Msg.GetSignal()))
	}
	p, err := ps.s.procs.get(req.Msg.GetProcess())
	if err != nil {
		return nil, toConnectError(err)
	}
	if err := p.signal(sig); err != nil {
		return nil, toConnectError(err)
	}
	if sig == syscall.SIGKILL {
		// Answered once the process is gone (reaped): a check right after the kill (`kill -0`,
		// ps; E2B's test_kill_process) must not find it, and a zombie is found. Bounded: a
		// process in an uninterruptible wait dies late, and the kill was sent all the same.
		t := time.NewTimer(killReapWait)
		defer t.Stop()
		select {
		case <-p.exited:
		case <-t.C:
		case <-ctx.Done():
		}
	}
	return connect.NewResponse(&pb.SendSignalResponse{}), nil
}

// killReapWait bounds how long a SIGKILL's answer waits for the process to be reaped.
const killReapWait = 2 * time.Second

func (ps *processService) CloseStdin(_ context.Context, req *connect.Request[pb.CloseStdinRequest]) (*connect.Response[pb.CloseStdinResponse], error) {
	p, err := ps.s.procs.get(req.Msg.GetProcess())
	if err != nil {
		return nil, toConnectError(err)
	}
	if err := p.closeStdin(); err != nil {
		return nil, toConnectError(err)
	}
	return connect.NewResponse(&pb.CloseStdinResponse{}), nil
}

// toConnectError translates errdefs categories and os errors into Connect codes.
func toConnectError(err error) error {
	var ce *connect.Error
	switch {
	case errors.As(err, &ce):
		return err
	case errors.Is(err, errdefs.ErrNotFound), errors.Is(err, os.ErrNotExist):
		return connect.NewError(connect.CodeNotFound, err)
	case errors.Is(err, os.ErrExist):
		return connect.NewError(connect.CodeAlreadyExists, err)
	case errors.Is(err, errdefs.ErrInvalid):
		return connect.NewError(connect.CodeInvalidArgument, err)
	case errors.Is(err, errdefs.ErrConflict):
		return connect.NewError(connect.CodeFailedPrecondition, err)
	case errors.Is(err, errdefs.ErrUnauthorized):
		return connect.NewError(connect.CodeUnauthenticated, err)
	case errors.Is(err, os.ErrPermission):
		return connect.NewError(connect.CodePermissionDenied, err)
	case errors.Is(err, errdefs.ErrExhausted), errors.Is(err, syscall.ENOSPC):
		return connect.NewError(connect.CodeResourceExhausted, err)
	default:
		return connect.NewError(connect.CodeInternal, err)
	}
}
