package sandbox

import (
	"context"
	"fmt"
	"strings"

	"connectrpc.com/connect"

	"github.com/ember-sandbox/ember/api/gen/process"
	"github.com/ember-sandbox/ember/api/gen/process/processconnect"
)

// envdCommand runs a bash command line through envd's process service as root. With wait it
// returns the exit code and output; without, it returns once the process started (it keeps
// running: disconnecting does not stop it). Commands must go through envd, not the driver's
// out-of-band Exec: gVisor kills exec'd processes on restore, while envd's children survive.
func (m *Manager) envdCommand(ctx context.Context, base, token, cmdline string, wait bool) (int, string, error) {
	pc := processconnect.NewProcessClient(m.client, base)
	no := false
	req := connect.NewRequest(&process.StartRequest{
		Process: &process.ProcessConfig{Cmd: "/bin/bash", Args: []string{"-l", "-c", cmdline}},
		Stdin:   &no,
	})
	req.Header().Set("Authorization", "Basic cm9vdDo=") // root:
	if token != "" {
		req.Header().Set("X-Access-Token", token)
	}
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := pc.Start(sctx, req)
	if err != nil {
		return -1, "", err
	}
	defer stream.Close()
	var out strings.Builder
	for stream.Receive() {
		ev := stream.Msg().GetEvent()
		if ev.GetStart() != nil && !wait {
			return 0, "", nil
		}
		if d := ev.GetData(); d != nil {
			out.Write(d.GetStdout())
			out.Write(d.GetStderr())
		}
		if end := ev.GetEnd(); end != nil {
			return int(end.GetExitCode()), out.String(), nil
		}
	}
	if err := stream.Err(); err != nil {
		return -1, out.String(), err
	}
	return -1, out.String(), fmt.Errorf("envd stream ended without a result")
}
