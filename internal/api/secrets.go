package api

import (
	"net/http"
	"time"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/secret"
)

// E2B's secrets: /secrets and /secrets/{id} (Secret.create/list/getInfo/update/destroy of the
// SDK), served by internal/secret. Values are write-only: no answer carries one. A secret
// belongs to the caller's team (auth.TeamOf): another team's answers as a missing one, and a
// sandbox's rules resolve only its own team's secrets.

// secretJSON is E2B's Secret.
type secretJSON struct {
	SecretID       string            `json:"secretID"`
	Name           string            `json:"name"`
	CurrentVersion int               `json:"currentVersion"`
	Metadata       map[string]string `json:"metadata"`
	CreatedAt      string            `json:"createdAt"`
	UpdatedAt      string            `json:"updatedAt"`
}

func toSecretJSON(s *secret.Secret) secretJSON {
	md := s.Metadata
	if md == nil {
		md = map[string]string{}
	}
	return secretJSON{SecretID: s.ID, Name: s.Name, CurrentVersion: s.Version, Metadata: md,
		CreatedAt: s.CreatedAt.UTC().Format(time.RFC3339Nano), UpdatedAt: s.UpdatedAt.UTC().Format(time.RFC3339Nano)}
}

func (s *server) secretRoutes(rt *router) {
	if s.cfg.Secrets == nil {
		return
	}
	rt.handle(http.MethodPost, "/secrets", s.createSecret)
	rt.handle(http.MethodGet, "/secrets", s.listSecrets)
	rt.handle(http.MethodGet, "/secrets/{id}", s.getSecret)
	rt.handle(http.MethodPost, "/secrets/{id}", s.updateSecret)
	rt.handle(http.MethodDelete, "/secrets/{id}", s.destroySecret)
}

type secretWriteJSON struct {
	Name     string            `json:"name"`
	Value    *string           `json:"value"`
	Metadata map[string]string `json:"metadata"`
}

func (s *server) createSecret(w http.ResponseWriter, r *http.Request, _ params) error {
	var req secretWriteJSON
	if err := s.decodeJSON(w, r, &req, true); err != nil {
		return err
	}
	if req.Name == "" || req.Value == nil {
		return badRequest("name and value are required")
	}
	sec, err := s.cfg.Secrets.Create(r.Context(), auth.TeamOf(r.Context()), req.Name, *req.Value, req.Metadata)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, toSecretJSON(sec))
	return nil
}

func (s *server) updateSecret(w http.ResponseWriter, r *http.Request, p params) error {
	var req secretWriteJSON
	if err := s.decodeJSON(w, r, &req, true); err != nil {
		return err
	}
	if req.Value == nil {
		return badRequest("value is required")
	}
	sec, err := s.cfg.Secrets.Update(r.Context(), auth.TeamOf(r.Context()), p["id"], *req.Value, req.Metadata)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, toSecretJSON(sec))
	return nil
}

func (s *server) getSecret(w http.ResponseWriter, r *http.Request, p params) error {
	sec, err := s.cfg.Secrets.Get(r.Context(), auth.TeamOf(r.Context()), p["id"])
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, toSecretJSON(sec))
	return nil
}

// listSecrets is GET /secrets?limit=&nextToken= (oldest first; X-Next-Token for more).
func (s *server) listSecrets(w http.ResponseWriter, r *http.Request, _ params) error {
	q := r.URL.Query()
	limit, err := limitParam(q.Get("limit"))
	if err != nil {
		return err
	}
	cur, err := decodeCursor(q.Get("nextToken"))
	if err != nil {
		return err
	}
	secs, err := s.cfg.Secrets.List(r.Context(), auth.TeamOf(r.Context()))
	if err != nil {
		return err
	}
	items := make([]pageItem[*secret.Secret], 0, len(secs))
	for _, sec := range secs {
		items = append(items, pageItem[*secret.Secret]{at: sec.CreatedAt, id: sec.ID, v: sec})
	}
	writePage(w, items, false, cur, limit, toSecretJSON)
	return nil
}

func (s *server) destroySecret(w http.ResponseWriter, r *http.Request, p params) error {
	if err := s.cfg.Secrets.Destroy(r.Context(), auth.TeamOf(r.Context()), p["id"]); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}
