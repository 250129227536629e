package api

import "net/http"

// getTemplate serves GET /templates/{id}: the template or named snapshot with that id, alias or
// name (a snapshot with the state of its upload), else 404 with E2B's message.
func (s *server) getTemplate(w http.ResponseWriter, r *http.Request, p params) error {
	id := p["id"]
	if !validTemplateID(id) {
		return notFound("template %s not found", quoteTemplate(id))
	}
	ts, err := s.svc.ListTemplates(r.Context())
	if err != nil {
		return err
	}
	for _, t := range ts {
		if templateHasName(t, id) {
			writeJSON(w, http.StatusOK, toTemplate(t))
			return nil
		}
	}
	return notFound("template %s not found", quoteTemplate(id))
}
