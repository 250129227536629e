package build

import (
	"context"
	"net/http"
	"strings"

	"github.com/ember-sandbox/ember/internal/envdclient"
)

// envdCommandAs runs a bash command line through envd's process service as user. With wait it
// returns the exit code and output; without, it returns once the process started (it keeps
// running: disconnecting does not stop it). Commands must go through envd, not the driver's
// out-of-band Exec: gVisor kills exec'd processes on restore, while envd's children survive.
func envdCommandAs(ctx context.Context, client *http.Client, base, token, user, cmdline string, wait bool) (int, string, error) {
	var out tailBuffer
	envd := envdclient.New(client, base, token)
	cmd := envdclient.Command{Line: cmdline, User: user}
	if !wait {
		p, err := envd.Start(ctx, cmd)
		if err != nil {
			return -1, "", err
		}
		p.Close() // disconnecting does not stop the process
		return -1, "", nil
	}
	res, err := envd.Run(ctx, cmd, envdclient.Output{Stdout: out.write, Stderr: out.write})
	return res.ExitCode, out.String(), err
}

// maxCommandOutput bounds what envdCommandAs keeps of a command's output: its last bytes.
const maxCommandOutput = 64 << 10

// tailBuffer keeps the last maxCommandOutput bytes written to it.
type tailBuffer struct {
	buf     []byte
	dropped bool
}

func (t *tailBuffer) write(b []byte) {
	if len(b) >= maxCommandOutput {
		t.buf, t.dropped = append(t.buf[:0], b[len(b)-maxCommandOutput:]...), true
		return
	}
	if over := len(t.buf) + len(b) - maxCommandOutput; over > 0 {
		n := copy(t.buf, t.buf[over:])
		t.buf, t.dropped = t.buf[:n], true
	}
	t.buf = append(t.buf, b...)
}

func (t *tailBuffer) String() string {
	s := strings.ToValidUTF8(string(t.buf), "")
	if t.dropped {
		return "[...] " + s
	}
	return s
}
