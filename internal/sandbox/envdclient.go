package sandbox

import (
	"context"
	"strings"

	"github.com/ember-sandbox/ember/api/gen/process/processconnect"
	"github.com/ember-sandbox/ember/internal/envdclient"
)

// envdCommandAs runs a bash command line through envd's process service as user. With wait it
// returns the exit code and output; without, it returns once the process started (it keeps
// running: disconnecting does not stop it). Commands must go through envd, not the driver's
// out-of-band Exec: gVisor kills exec'd processes on restore, while envd's children survive.
func (m *Manager) envdCommandAs(ctx context.Context, base, token, user, cmdline string, wait bool) (int, string, error) {
	var out strings.Builder
	res, err := envdclient.Run(ctx, processconnect.NewProcessClient(m.client, base),
		envdclient.Command{Line: cmdline, User: user, Token: token, Wait: wait}, envdclient.Collect(&out))
	return res.ExitCode, out.String(), err
}
