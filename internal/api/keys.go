package api

import (
	"context"
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
	Team      string    `json:"team"`
	Admin     bool      `json:"admin"`
}

func toAPIKey(k *auth.Key) apiKeyJSON {
	c := k.Caller()
	return apiKeyJSON{ID: k.ID, Name: k.Name, Mask: k.Mask, CreatedAt: k.CreatedAt.UTC(), Team: c.Team, Admin: c.Admin}
}

// Keys: a key lists, makes and revokes its own team's keys; an admin key those of any team
// (?team= or "team" in the body; "*" lists every team's) and admin keys.

// keysTeam is the team a keys request acts on: the caller's, or for an admin key the one it
// names. A key that is not an admin key naming another team finds nothing there (404).
func keysTeam(ctx context.Context, asked string) (string, error) {
	own := auth.TeamOf(ctx)
	if asked == "" || asked == own {
		return own, nil
	}
	if !auth.IsAdmin(ctx) {
		return "", notFound("team %s not found", quoteID(asked))
	}
	return asked, nil
}

func (s *server) createAPIKey(w http.ResponseWriter, r *http.Request, _ params) error {
	var req struct {
		Name  string `json:"name"`
		Team  string `json:"team"`
		Admin bool   `json:"admin"`
	}
	if err := s.decodeJSON(w, r, &req, false); err != nil {
		return err
	}
	team, err := keysTeam(r.Context(), req.Team)
	if err != nil {
		return err
	}
	if req.Admin && !auth.IsAdmin(r.Context()) {
		return &httpError{status: http.StatusForbidden, msg: "only an admin key makes admin keys"}
	}
	plain, k, err := s.keys.CreateFor(r.Context(), req.Name, team, req.Admin)
	if err != nil {
		return teamNotFound(err, team)
	}
	out := toAPIKey(k)
	out.Key = plain
	s.log.Info("api key created", "key_id", k.ID, "name", k.Name, "team", team, "admin", k.Admin)
	writeJSON(w, http.StatusCreated, out)
	return nil
}

func (s *server) listAPIKeys(w http.ResponseWriter, r *http.Request, _ params) error {
	asked := r.URL.Query().Get("team")
	var team string
	if asked == "*" && auth.IsAdmin(r.Context()) {
		team = ""
	} else {
		var err error
		if team, err = keysTeam(r.Context(), asked); err != nil {
			return err
		}
	}
	ks, err := s.keys.List(r.Context(), team)
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
	team := auth.TeamOf(r.Context())
	if auth.IsAdmin(r.Context()) {
		team = "" // any team's
	}
	if err := s.keys.Revoke(r.Context(), id, team); err != nil {
		if statusOf(err) == http.StatusNotFound {
			return notFound("api key %s not found", quoteID(id))
		}
		return err
	}
	s.log.Info("api key revoked", "key_id", id)
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// teamNotFound words a missing team's error.
func teamNotFound(err error, team string) error {
	if err != nil && statusOf(err) == http.StatusNotFound {
		return notFound("team %s not found", quoteID(team))
	}
	return err
}
