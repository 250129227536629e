package api

import (
	"net/http"
)

// warmPool is POST /ember/pools/{template}/warm {"count": N}: keep at least N restored
// sandboxes of the template ready (0: follow demand alone). 200 with the pool's state; 400 for a
// bad count or a snapshot, 404 unknown template, 409 when the pool is disabled.
func (s *server) warmPool(w http.ResponseWriter, r *http.Request, p params) error {
	var req struct {
		Count *int `json:"count"`
	}
	if err := s.decodeJSON(w, r, &req, true); err != nil {
		return err
	}
	if req.Count == nil {
		return badRequest("count is required")
	}
	if !validTemplateID(p["template"]) {
		return badRequest("invalid template %s", quoteID(p["template"]))
	}
	st, err := s.svc.WarmPool(r.Context(), p["template"], *req.Count)
	if err != nil {
		return err
	}
	if st.SandboxIDs == nil {
		st.SandboxIDs = []string{}
	}
	writeJSON(w, http.StatusOK, st)
	return nil
}
