package sandbox

import (
	"context"
	"time"

	"github.com/ember-sandbox/ember/internal/envdclient"
)

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
