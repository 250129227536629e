package envd_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	pb "github.com/ember-sandbox/ember/api/gen/process"
	"github.com/ember-sandbox/ember/internal/envd"
	"github.com/ember-sandbox/ember/internal/testutil"
)

func TestStartCommands(t *testing.T) {
	h := newHarness(t, envd.Config{EnvVars: map[string]string{"SUITE_VAR": "hello-env"}})
	home := testUser.HomeDir
	cases := []struct {
		name       string
		user       string
		cfg        *pb.ProcessConfig
		stdin      *bool
		wantOut    string
		wantErr    string
		wantCode   int32
		wantStatus string
	}{
		{name: "echo", cfg: bash("echo hello"), stdin: ptr(false), wantOut: "hello\n", wantStatus: "exit status 0"},
		{name: "non-zero exit", cfg: bash("echo err >&2; exit 3"), stdin: ptr(false), wantErr: "err\n", wantCode: 3, wantStatus: "exit status 3"},
		{name: "envs cwd root", user: "root", stdin: ptr(false),
			cfg:     &pb.ProcessConfig{Cmd: "/bin/bash", Args: []string{"-l", "-c", `echo "$SUITE_VAR $X"; pwd; whoami`}, Envs: map[string]string{"X": "y"}, Cwd: ptr("/tmp")},
			wantOut: "hello-env y\n/tmp\nroot\n", wantStatus: "exit status 0"},
		{name: "default user and home", cfg: bash("whoami; echo $HOME; pwd; echo $USER $LOGNAME"), stdin: ptr(false),
			wantOut: testUser.Username + "\n" + home + "\n" + home + "\n" + testUser.Username + " " + testUser.Username + "\n", wantStatus: "exit status 0"},
		{name: "relative cwd resolves against home", cfg: &pb.ProcessConfig{Cmd: "pwd", Cwd: ptr(".")}, stdin: ptr(false), wantOut: home + "\n", wantStatus: "exit status 0"},
		{name: "root ids", user: "root", cfg: bash("id -u; id -g"), stdin: ptr(false), wantOut: "0\n0\n", wantStatus: "exit status 0"},
		{name: "supplementary groups", cfg: bash("id -Gn | tr ' ' '\\n' | grep -x users"), stdin: ptr(false), wantOut: "users\n", wantStatus: "exit status 0"},
		{name: "stdin false gives EOF", cfg: bash("cat; echo end"), stdin: ptr(false), wantOut: "end\n", wantStatus: "exit status 0"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := h.run(t, tc.user, tc.cfg, tc.stdin)
			if r.err != nil {
				t.Fatalf("stream error: %v", r.err)
			}
			if r.pid == 0 || r.end == nil {
				t.Fatalf("pid %d end %v", r.pid, r.end)
			}
			if r.stdout != tc.wantOut || r.stderr != tc.wantErr {
				t.Errorf("stdout %q stderr %q, want %q %q", r.stdout, r.stderr, tc.wantOut, tc.wantErr)
			}
			if r.end.ExitCode != tc.wantCode || r.end.Status != tc.wantStatus || !r.end.Exited {
				t.Errorf("end = %v, want code %d status %q", r.end, tc.wantCode, tc.wantStatus)
			}
			if tc.wantCode != 0 && r.end.GetError() != tc.wantStatus {
				t.Errorf("end.error = %q, want %q", r.end.GetError(), tc.wantStatus)
			}
		})
	}
}

func TestStartInvalid(t *testing.T) {
	h := newHarness(t, envd.Config{})
	cases := []struct {
		name string
		user string
		cfg  *pb.ProcessConfig
		code connect.Code
	}{
		{"bad cwd", "", &pb.ProcessConfig{Cmd: "/bin/true", Cwd: ptr("/nonexistent/dir")}, connect.CodeInvalidArgument},
		// E2B envd's authn middleware: an unknown Basic user is unauthenticated (AuthenticationError).
		{"unknown user", "no-such-user-xyz", &pb.ProcessConfig{Cmd: "/bin/true"}, connect.CodeUnauthenticated},
		{"missing executable", "", &pb.ProcessConfig{Cmd: "no-such-binary-xyz"}, connect.CodeInvalidArgument},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := h.run(t, tc.user, tc.cfg, ptr(false))
			if codeOf(r.err) != tc.code {
				t.Fatalf("err = %v, want %v", r.err, tc.code)
			}
		})
	}
}

func TestStreamingIsIncremental(t *testing.T) {
	h := newHarness(t, envd.Config{})
	ctx := context.Background()
	stream, err := h.proc.Start(ctx, connect.NewRequest(&pb.StartRequest{
		Process: bash("for i in 1 2 3; do echo $i; echo e$i >&2; sleep 0.3; done"), Stdin: ptr(false)}))
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	var times []time.Time
	var out, errOut string
	for stream.Receive() {
		if d := stream.Msg().GetEvent().GetData(); d != nil {
			if len(d.GetStdout()) > 0 {
				times = append(times, time.Now())
				out += string(d.GetStdout())
			}
			errOut += string(d.GetStderr())
		}
	}
	if out != "1\n2\n3\n" || errOut != "e1\ne2\ne3\n" {
		t.Fatalf("stdout %q stderr %q", out, errOut)
	}
	if len(times) < 2 || times[len(times)-1].Sub(times[0]) < 400*time.Millisecond {
		t.Fatalf("stdout did not arrive incrementally: %d chunks over %v", len(times), times[len(times)-1].Sub(times[0]))
	}
}

// startBackground starts cfg and returns the pid and the still-open stream.
func startBackground(t *testing.T, h *harness, req *pb.StartRequest, hdr map[string]string) (uint32, *connect.ServerStreamForClient[pb.StartResponse], context.CancelFunc) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	creq := connect.NewRequest(req)
	for k, v := range hdr {
		creq.Header().Set(k, v)
	}
	stream, err := h.proc.Start(ctx, creq)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	if !stream.Receive() || stream.Msg().GetEvent().GetStart() == nil {
		cancel()
		t.Fatalf("no start event: %v", stream.Err())
	}
	t.Cleanup(func() { cancel(); stream.Close() })
	return stream.Msg().GetEvent().GetStart().GetPid(), stream, cancel
}

func pidSel(pid uint32) *pb.ProcessSelector {
	return &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: pid}}
}

func TestStdinAndCloseStdin(t *testing.T) {
	h := newHarness(t, envd.Config{})
	ctx := context.Background()
	pid, stream, _ := startBackground(t, h, &pb.StartRequest{Process: bash("cat")}, nil) // stdin absent: open pipe
	if _, err := h.proc.SendInput(ctx, connect.NewRequest(&pb.SendInputRequest{Process: pidSel(pid),
		Input: &pb.ProcessInput{Input: &pb.ProcessInput_Stdin{Stdin: []byte("ping\n")}}})); err != nil {
		t.Fatal(err)
	}
	if !stream.Receive() || string(stream.Msg().GetEvent().GetData().GetStdout()) != "ping\n" {
		t.Fatalf("want echoed ping, got %v %v", stream.Msg(), stream.Err())
	}
	if _, err := h.proc.CloseStdin(ctx, connect.NewRequest(&pb.CloseStdinRequest{Process: pidSel(pid)})); err != nil {
		t.Fatal(err)
	}
	r := collectRest[*pb.StartResponse](stream)
	if r.end == nil || r.end.ExitCode != 0 {
		t.Fatalf("end %v err %v", r.end, r.err)
	}
	_, err := h.proc.SendInput(ctx, connect.NewRequest(&pb.SendInputRequest{Process: pidSel(pid),
		Input: &pb.ProcessInput{Input: &pb.ProcessInput_Stdin{Stdin: []byte("x")}}}))
	if codeOf(err) != connect.CodeNotFound {
		t.Fatalf("SendInput after exit: %v, want not_found", err)
	}
}

func TestListAndKill(t *testing.T) {
	h := newHarness(t, envd.Config{})
	ctx := context.Background()
	pid, stream, _ := startBackground(t, h, &pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "/bin/bash", Args: []string{"-l", "-c", "sleep 30"}}, Stdin: ptr(false), Tag: ptr("sleeper")}, nil)

	list, err := h.proc.List(ctx, connect.NewRequest(&pb.ListRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, p := range list.Msg.GetProcesses() {
		if p.GetPid() == pid {
			found = true
			if p.GetConfig().GetCmd() != "/bin/bash" || strings.Join(p.GetConfig().GetArgs(), " ") != "-l -c sleep 30" || p.GetTag() != "sleeper" {
				t.Errorf("listed %v", p)
			}
		}
	}
	if !found {
		t.Fatalf("pid %d not listed in %v", pid, list.Msg)
	}

	kill := func() error {
		_, err := h.proc.SendSignal(ctx, connect.NewRequest(&pb.SendSignalRequest{Process: pidSel(pid), Signal: pb.Signal_SIGNAL_SIGKILL}))
		return err
	}
	if err := kill(); err != nil {
		t.Fatal(err)
	}
	// A SIGKILL is answered once the process is gone: a check right after it (E2B's
	// test_kill_process runs `kill -0 <pid>`) must not find it, not even as a zombie.
	if err := syscall.Kill(int(pid), 0); !errors.Is(err, syscall.ESRCH) {
		t.Fatalf("right after the kill, kill -0 %d: %v, want ESRCH", pid, err)
	}
	r := collectRest[*pb.StartResponse](stream)
	if r.end == nil || r.end.ExitCode != -1 || r.end.Status != "signal: killed" || r.end.Exited || r.end.GetError() != "signal: killed" {
		t.Fatalf("end %v err %v", r.end, r.err)
	}
	if err := kill(); codeOf(err) != connect.CodeNotFound {
		t.Fatalf("second kill: %v, want not_found", err)
	}
	if _, err := h.proc.SendSignal(ctx, connect.NewRequest(&pb.SendSignalRequest{Process: pidSel(999999), Signal: pb.Signal_SIGNAL_SIGTERM})); codeOf(err) != connect.CodeNotFound {
		t.Fatalf("unknown pid: %v", err)
	}
}

func TestDisconnectAndConnect(t *testing.T) {
	h := newHarness(t, envd.Config{})
	pid, _, cancel := startBackground(t, h, &pb.StartRequest{Process: bash("sleep 1; echo done"), Stdin: ptr(false)}, nil)
	cancel() // the client goes away; the process must live on

	// Several followers of one process.
	var wg sync.WaitGroup
	results := make([]result, 2)
	for i := range results {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s, err := h.proc.Connect(context.Background(), connect.NewRequest(&pb.ConnectRequest{Process: pidSel(pid)}))
			if err != nil {
				results[i] = result{err: err}
				return
			}
			defer s.Close()
			results[i] = collect[*pb.ConnectResponse](s)
		}()
	}
	wg.Wait()
	for i, r := range results {
		if r.err != nil || r.pid != pid || r.end == nil || r.end.ExitCode != 0 || !strings.Contains(r.stdout, "done") {
			t.Errorf("follower %d: %+v", i, r)
		}
	}
	s, err := h.proc.Connect(context.Background(), connect.NewRequest(&pb.ConnectRequest{Process: pidSel(pid)}))
	if err == nil {
		r := collect[*pb.ConnectResponse](s)
		err = r.err
	}
	if codeOf(err) != connect.CodeNotFound {
		t.Fatalf("connect after exit: %v, want not_found", err)
	}
}

func TestTimeoutKillsProcess(t *testing.T) {
	h := newHarness(t, envd.Config{})
	req := connect.NewRequest(&pb.StartRequest{Process: bash("echo started; sleep 5"), Stdin: ptr(false)})
	req.Header().Set("Connect-Timeout-Ms", "1000")
	start := time.Now()
	stream, err := h.proc.Start(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	r := collect[*pb.StartResponse](stream)
	if codeOf(r.err) != connect.CodeDeadlineExceeded {
		t.Fatalf("err %v, want deadline_exceeded", r.err)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Fatalf("took %v", d)
	}
	if r.stdout != "started\n" {
		t.Errorf("stdout %q", r.stdout)
	}
	testutil.Eventually(t, 3*time.Second, fmt.Sprintf("process %d gone after the timeout", r.pid), func() bool {
		_, err := os.Stat("/proc/" + strconv.Itoa(int(r.pid)))
		return os.IsNotExist(err)
	})
}

func TestKeepalive(t *testing.T) {
	h := newHarness(t, envd.Config{})
	req := connect.NewRequest(&pb.StartRequest{Process: bash("sleep 2.5"), Stdin: ptr(false)})
	req.Header().Set("Keepalive-Ping-Interval", "1")
	stream, err := h.proc.Start(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	n := 0
	for stream.Receive() {
		if stream.Msg().GetEvent().GetKeepalive() != nil {
			n++
		}
	}
	if n < 2 {
		t.Fatalf("got %d keepalives in 2.5 s at 1 s interval", n)
	}
}

func TestPTY(t *testing.T) {
	h := newHarness(t, envd.Config{})
	ctx := context.Background()
	pid, stream, _ := startBackground(t, h, &pb.StartRequest{
		Process: &pb.ProcessConfig{Cmd: "/bin/bash", Args: []string{"-i", "-l"}, Envs: map[string]string{"TERM": "xterm-256color"}},
		Pty:     &pb.PTY{Size: &pb.PTY_Size{Cols: 80, Rows: 24}},
	}, map[string]string{"Authorization": basic("root")})

	out := make(chan string, 100)
	go func() {
		for stream.Receive() {
			if b := stream.Msg().GetEvent().GetData().GetPty(); len(b) > 0 {
				out <- string(b)
			}
		}
		close(out)
	}()
	waitFor := func(want string) {
		t.Helper()
		var all string
		timeout := time.After(10 * time.Second)
		for {
			select {
			case s, ok := <-out:
				if !ok {
					t.Fatalf("stream ended; output so far %q", all)
				}
				all += s
				if strings.Contains(all, want) {
					return
				}
			case <-timeout:
				t.Fatalf("no %q in pty output %q", want, all)
			}
		}
	}
	send := func(s string) {
		t.Helper()
		if _, err := h.proc.SendInput(ctx, connect.NewRequest(&pb.SendInputRequest{Process: pidSel(pid),
			Input: &pb.ProcessInput{Input: &pb.ProcessInput_Pty{Pty: []byte(s)}}})); err != nil {
			t.Fatal(err)
		}
	}
	send("echo pty-$((40+2))\n")
	waitFor("pty-42")
	send("stty size\n")
	waitFor("24 80")
	if _, err := h.proc.Update(ctx, connect.NewRequest(&pb.UpdateRequest{Process: pidSel(pid),
		Pty: &pb.PTY{Size: &pb.PTY_Size{Cols: 120, Rows: 40}}})); err != nil {
		t.Fatal(err)
	}
	send("stty size\n")
	waitFor("40 120")
	if _, err := h.proc.CloseStdin(ctx, connect.NewRequest(&pb.CloseStdinRequest{Process: pidSel(pid)})); codeOf(err) != connect.CodeFailedPrecondition {
		t.Errorf("CloseStdin on a pty: %v, want failed_precondition", err)
	}
	if _, err := h.proc.SendSignal(ctx, connect.NewRequest(&pb.SendSignalRequest{Process: pidSel(pid), Signal: pb.Signal_SIGNAL_SIGKILL})); err != nil {
		t.Fatal(err)
	}
	for range out {
	}
}

// TestStreamInput covers the client-streaming input RPC (not used by the SDKs).
func TestStreamInput(t *testing.T) {
	h := newHarness(t, envd.Config{})
	pid, stream, _ := startBackground(t, h, &pb.StartRequest{Process: bash("head -c 6")}, nil)
	cs := h.proc.StreamInput(context.Background())
	_ = cs.Send(&pb.StreamInputRequest{Event: &pb.StreamInputRequest_Start{Start: &pb.StreamInputRequest_StartEvent{Process: pidSel(pid)}}})
	_ = cs.Send(&pb.StreamInputRequest{Event: &pb.StreamInputRequest_Data{Data: &pb.StreamInputRequest_DataEvent{Input: &pb.ProcessInput{Input: &pb.ProcessInput_Stdin{Stdin: []byte("abc")}}}}})
	_ = cs.Send(&pb.StreamInputRequest{Event: &pb.StreamInputRequest_Data{Data: &pb.StreamInputRequest_DataEvent{Input: &pb.ProcessInput{Input: &pb.ProcessInput_Stdin{Stdin: []byte("def")}}}}})
	if _, err := cs.CloseAndReceive(); err != nil {
		t.Fatal(err)
	}
	r := collectRest[*pb.StartResponse](stream)
	if r.stdout != "abcdef" || r.end.GetExitCode() != 0 {
		t.Fatalf("%+v", r)
	}
}

// Commands run as the users the account files name now: a user added after envd first looked
// users up can run commands at once (with the groups it was given), and one deleted or changed
// is seen too (envd caches its lookups while the files are unchanged).
func TestUserChangesAreSeenAtOnce(t *testing.T) {
	h := newHarness(t, envd.Config{})
	name := fmt.Sprintf("envdu%d", os.Getpid())
	t.Cleanup(func() { _ = exec.Command("userdel", "-r", "-f", name).Run() })
	id := func() result { return h.run(t, name, bash("id -un; id -Gn"), ptr(false)) }
	if r := id(); codeOf(r.err) != connect.CodeUnauthenticated {
		t.Fatalf("unknown user %s: %+v; want unauthenticated", name, r)
	}
	if out, err := exec.Command("useradd", "-m", "-s", "/bin/bash", name).CombinedOutput(); err != nil {
		t.Fatalf("useradd: %v: %s", err, out)
	}
	if r := id(); r.err != nil || !strings.HasPrefix(r.stdout, name+"\n") {
		t.Fatalf("new user %s: %+v", name, r)
	}
	if out, err := exec.Command("usermod", "-aG", "users", name).CombinedOutput(); err != nil {
		t.Fatalf("usermod: %v: %s", err, out)
	}
	if r := id(); r.err != nil || !strings.Contains(r.stdout, " users") {
		t.Fatalf("user %s added to group users: %+v", name, r)
	}
	if out, err := exec.Command("userdel", "-r", "-f", name).CombinedOutput(); err != nil {
		t.Fatalf("userdel: %v: %s", err, out)
	}
	if r := id(); codeOf(r.err) != connect.CodeUnauthenticated {
		t.Fatalf("deleted user %s: %+v; want unauthenticated", name, r)
	}
}
