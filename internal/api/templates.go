package api

import (
	"net/http"
)

// templateAliasResponse is E2B's TemplateAliasResponse.
type templateAliasResponse struct {
	TemplateID string `json:"templateID"`
	Public     bool   `json:"public"`
}

// getTemplateAlias serves GET /templates/aliases/{alias}, which Template.exists() calls: 200
// with the template's id when a template or named snapshot answers to the alias (id, alias or
// name), else 404 with E2B's message (the SDK reads 404 as "does not exist"). Every template of
// a node belongs to its one team, so none is "public" in E2B's sense.
func (s *server) getTemplateAlias(w http.ResponseWriter, r *http.Request, p params) error {
	alias := p["alias"]
	if !validTemplateID(alias) {
		return notFound("template %s not found", quoteTemplate(alias))
	}
	ts, err := s.svc.ListTemplates(r.Context())
	if err != nil {
		return err
	}
	for _, t := range ts {
		if templateHasName(t, alias) {
			writeJSON(w, http.StatusOK, templateAliasResponse{TemplateID: t.ID})
			return nil
		}
	}
	return notFound("template %s not found", quoteTemplate(alias))
}

// quoteTemplate quotes a template name the way E2B's messages do ('name'), bounded.
func quoteTemplate(name string) string {
	q := quoteID(name)
	return "'" + q[1:len(q)-1] + "'"
}
