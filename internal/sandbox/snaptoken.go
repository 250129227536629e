package sandbox

import (
	"context"
	"fmt"
	"time"
)

// A snapshot's image holds envd as it was at the checkpoint, access token included, and a
// create from the snapshot authenticates its /init with that token (Template.InitToken). Had
// the checkpoint kept the running sandbox's token, anyone who may use the snapshot (the
// record, shared through etcd and the image store) would hold the token of a live sandbox. So
// for the time of its checkpoint the sandbox's envd holds a token of the snapshot's own, and
// gets its own back right after: requests the sandbox receives in that window (a few
// milliseconds besides the checkpoint itself, during which it is paused anyway) answer 401.

// rotateAttempts bounds the tries to give a sandbox its own token back.
const rotateAttempts = 3

// withSnapshotToken runs checkpoint while sb's envd holds a new token, and returns that token.
// The caller holds sb's lock.
func (m *Manager) withSnapshotToken(ctx context.Context, sb *Sandbox, tpl *Template, checkpoint func() error) (string, error) {
	if sb.AccessToken == "" {
		return "", checkpoint()
	}
	snapToken := randomHex(16)
	if err := m.setEnvdToken(ctx, sb, tpl, sb.AccessToken, snapToken); err != nil {
		return "", fmt.Errorf("snapshot: give envd the snapshot's token: %w", err)
	}
	err := checkpoint()
	var back error
	for i := 0; i < rotateAttempts; i++ {
		if back = m.setEnvdToken(context.WithoutCancel(ctx), sb, tpl, snapToken, sb.AccessToken); back == nil {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if back != nil {
		// Its clients cannot reach envd now: say so loudly; the sandbox is otherwise intact.
		m.logger(sb.ID).Error("snapshot: envd did not take the sandbox's own token back: its clients get 401 until it is resumed or recreated", "err", back)
	}
	return snapToken, err
}

// setEnvdToken re-sends envd's /init with sb's identity and token to (authenticated with from).
func (m *Manager) setEnvdToken(ctx context.Context, sb *Sandbox, tpl *Template, from, to string) error {
	id := *sb
	id.AccessToken = to
	return m.initEnvd(ctx, m.guest, envdBase(sb.Runtime.GuestIP), &id, from, tpl)
}
