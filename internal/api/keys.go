package api

import (
	"net/http"
	"time"

	"github.com/ember-sandbox/ember/internal/auth"
)

type apiKeyJSON struct {
	ID        string    `json:"id"`
	Name      string    `json:"name"`
	Key       string    `json:"key,omitempty"` // plaintext, only in the create response
	Mask      string    `json:"mask"`
	CreatedAt time.Time `json:"createdAt"`
}

func toAPIKey(k *auth.Key) apiKeyJSON {
	return apiKeyJSON{ID: k.ID, Name: k.Name, Mask: k.Mask, CreatedAt: k.CreatedAt.UTC()}
}

func (s *server) createAPIKey(w http.ResponseWriter, r *http.Request, _ params) error {
	var req struct {
		Name string `json:"name"`
	}
	if err := s.decodeJSON(w, r, &req, false); err != nil {
		return err
	}
	plain, k, err := s.keys.Create(r.Context(), req.Name)
	if err != nil {
		return err
	}
	out := toAPIKey(k)
	out.Key = plain
	s.log.Info("api key created", "key_id", k.ID, "name", k.Name)
	writeJSON(w, http.StatusCreated, out)
	return nil
}

func (s *server) listAPIKeys(w http.ResponseWriter, r *http.Request, _ params) error {
	ks, err := s.keys.List(r.Context())
	if err != nil {
		return err
	}
	out := make([]apiKeyJSON, 0, len(ks))
	for _, k := range ks {
		out = append(out, toAPIKey(k))
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

func (s *server) deleteAPIKey(w http.ResponseWriter, r *http.Request, p params) error {
	id := p["id"]
	if !keyIDRe.MatchString(id) {
		return notFound("api key %s not found", quoteID(id))
	}
	if err := s.keys.Revoke(r.Context(), id); err != nil {
		return err
	}
	s.log.Info("api key revoked", "key_id", id)
	w.WriteHeader(http.StatusNoContent)
	return nil
}
