package sandbox

import (
	"context"
)

// A snapshot's image holds envd as it was at the checkpoint, access token included, and a
// create from the snapshot authenticates its /init with that token (Template.InitToken). Had
// the checkpoint kept the running sandbox's token, anyone who may use the snapshot (the
// record, shared through etcd and the image store) would hold the token of a live sandbox. So
// for the time of its checkpoint the sandbox's envd holds a token of the snapshot's own, and
// gets its own back right after: requests the sandbox receives in that window (a few
// milliseconds besides the checkpoint itself, during which it is paused anyway) answer 401.

// withSnapshotToken runs checkpoint and returns the token the image's envd holds. The
// rotation described above is off: a kill -9 of the daemon between the two /init calls left
// the running sandbox's envd with the snapshot's token, so its clients got 401 for good
// (TestCrashInjection found it). It comes back once the sandbox's record names the token in
// flight, so that reconcile can give the sandbox its own back. Until then the image holds the
// sandbox's own token, as before. The caller holds sb's lock.
func (m *Manager) withSnapshotToken(_ context.Context, sb *Sandbox, _ *Template, checkpoint func() error) (string, error) {
	return sb.AccessToken, checkpoint()
}
