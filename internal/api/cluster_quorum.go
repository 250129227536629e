package api

import (
	"net/http"
	"strings"
)

// refuseWithoutQuorum answers 503 for a control call while the cluster store cannot commit
// (etcd has no quorum, or this node cannot reach it): such a call would hang on etcd or act
// on a state the cluster cannot record. The sandbox plane (served before this) goes on from
// the routing caches; /health, /metrics and GET /nodes answer from this node's view.
func (s *server) refuseWithoutQuorum(w http.ResponseWriter, r *http.Request) bool {
	switch p := r.URL.Path; {
	case p == "/health", p == "/metrics":
		return false
	case r.Method == http.MethodGet && (p == "/nodes" || strings.HasPrefix(p, "/nodes/")):
		return false
	}
	err := s.cl.Available()
	if err == nil {
		return false
	}
	writeError(w, s.log, r, err)
	return true
}
