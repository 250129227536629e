package sandbox

import (
	"context"
	"strings"
	"time"

	"github.com/ember-sandbox/ember/internal/envdclient"
)

// envdCommandAs runs a bash command line through envd's process service as user. With wait it
// returns the exit code and output; without, it returns once the process started (it keeps
// running: disconnecting does not stop it). Commands must go through envd, not the driver's
// out-of-band Exec: gVisor kills exec'd processes on restore, while envd's children survive.
func (m *Manager) envdCommandAs(ctx context.Context, base, token, user, cmdline string, wait bool) (int, string, error) {
	var out tailBuffer
	envd := envdclient.New(m.client, base, token)
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

// warmupTimeout bounds a pool instance's warm-up command.
const warmupTimeout = 10 * time.Second

// warmGuest runs one short command in a restored instance before it waits in the pool, as the
// template's default user and the way E2B's commands.run does (`bash -l -c`, which here execs a
// program). The first command after a restore is otherwise 20 ms or more slower than the next
// ones: gVisor's systrap platform keeps the host stub processes of exited address spaces for
// reuse, but a restored sandbox starts with none, so its first bash and the program bash execs
// each wait for a new stub; envd's process paths and the login files are touched for the first
// time too. The user's first command then finds all of it ready. It goes through the
// instance's guest transport, whose connection /init and that first command then reuse. A
// failure only costs that.
func (m *Manager) warmGuest(ctx context.Context, guestIP, token string) error {
	ctx, cancel := context.WithTimeout(ctx, warmupTimeout)
	defer cancel()
	_, err := envdclient.New(m.guest, envdBase(guestIP), token).Run(ctx, envdclient.Command{Line: "/bin/true"}, envdclient.Output{})
	return err
}
