package envdclient_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"connectrpc.com/connect"

	"github.com/ember-sandbox/ember/api/gen/process"
	"github.com/ember-sandbox/ember/api/gen/process/processconnect"
	"github.com/ember-sandbox/ember/internal/envdclient"
)

// stub answers Start with a scripted stream and records the request it got.
type stub struct {
	processconnect.UnimplementedProcessHandler
	end     bool
	gotArgs []string
	gotHdr  http.Header
}

func (s *stub) Start(ctx context.Context, req *connect.Request[process.StartRequest], st *connect.ServerStream[process.StartResponse]) error {
	s.gotArgs = append([]string{req.Msg.GetProcess().GetCmd()}, req.Msg.GetProcess().GetArgs()...)
	s.gotHdr = req.Header().Clone()
	ev := func(e *process.ProcessEvent) error { return st.Send(&process.StartResponse{Event: e}) }
	ev(&process.ProcessEvent{Event: &process.ProcessEvent_Start{Start: &process.ProcessEvent_StartEvent{Pid: 42}}})
	ev(&process.ProcessEvent{Event: &process.ProcessEvent_Data{Data: &process.ProcessEvent_DataEvent{Output: &process.ProcessEvent_DataEvent_Stdout{Stdout: []byte("out ")}}}})
	ev(&process.ProcessEvent{Event: &process.ProcessEvent_Data{Data: &process.ProcessEvent_DataEvent{Output: &process.ProcessEvent_DataEvent_Stderr{Stderr: []byte("err")}}}})
	if s.end {
		ev(&process.ProcessEvent{Event: &process.ProcessEvent_End{End: &process.ProcessEvent_EndEvent{ExitCode: 3, Exited: true}}})
	}
	return nil
}

func client(t *testing.T, s *stub) processconnect.ProcessClient {
	mux := http.NewServeMux()
	mux.Handle(processconnect.NewProcessHandler(s))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return processconnect.NewProcessClient(srv.Client(), srv.URL)
}

func TestRunCollectsOutputAndExitCode(t *testing.T) {
	s := &stub{end: true}
	var out strings.Builder
	res, err := envdclient.Run(context.Background(), client(t, s), envdclient.Command{Line: "echo hi", User: "root", Token: "tok", Wait: true}, envdclient.Collect(&out))
	if err != nil {
		t.Fatal(err)
	}
	if res.Pid != 42 || res.ExitCode != 3 || out.String() != "out err" {
		t.Fatalf("got %+v %q", res, out.String())
	}
	if strings.Join(s.gotArgs, " ") != "/bin/bash -l -c echo hi" {
		t.Fatalf("args %v", s.gotArgs)
	}
	if s.gotHdr.Get("X-Access-Token") != "tok" || s.gotHdr.Get("Authorization") != "Basic cm9vdDo=" {
		t.Fatalf("headers %v", s.gotHdr)
	}
}

func TestRunWithoutWaitReturnsAtStart(t *testing.T) {
	res, err := envdclient.Run(context.Background(), client(t, &stub{}), envdclient.Command{Line: "sleep 9"}, envdclient.Output{})
	if err != nil || res.Pid != 42 || res.ExitCode != -1 {
		t.Fatalf("got %+v %v", res, err)
	}
}

func TestRunStreamWithoutEnd(t *testing.T) {
	_, err := envdclient.Run(context.Background(), client(t, &stub{}), envdclient.Command{Line: "x", Wait: true}, envdclient.Output{})
	if !errors.Is(err, envdclient.ErrNoEnd) {
		t.Fatalf("err %v", err)
	}
}
