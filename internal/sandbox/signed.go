package sandbox

// SignedBy returns the id of the sandbox whose envd access token satisfies made (an
// uploadUrl()/downloadUrl() signature made with it), "" when none does. It takes no sandbox's
// lock (a sandbox's lock is held across its checkpoints and pauses, and anyone can send a
// signed URL): it copies the (id, token) pairs under the Manager's map lock alone. A sandbox's
// AccessToken is set before its entry is published in live and never changes after. The
// caller checks the sandbox's state (Get) once it knows which one it is.
func (m *Manager) SignedBy(made func(token string) bool) string {
	type pair struct{ id, token string }
	m.mu.Lock()
	pairs := make([]pair, 0, len(m.live))
	for id, e := range m.live {
		pairs = append(pairs, pair{id, e.sb.AccessToken})
	}
	m.mu.Unlock()
	for _, p := range pairs {
		if p.token != "" && made(p.token) {
			return p.id
		}
	}
	return ""
}
