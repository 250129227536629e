package api

import (
	"net/http"
	"time"

	"github.com/ember-sandbox/ember/internal/auth"
)

// Teams on the wire (ember's extras; admin keys manage them): POST /ember/teams makes a team
// and its first key, GET /ember/teams lists them (a key that is not an admin key sees its own),
// GET /ember/teams/{id}, PUT /ember/teams/{id}/quota, DELETE /ember/teams/{id}.

type teamJSON struct {
	ID        string     `json:"teamID"`
	Name      string     `json:"name"`
	CreatedAt time.Time  `json:"createdAt"`
	Quota     auth.Quota `json:"quota"`
	// Key is the new team's first key (plaintext, only in the create response).
	Key *apiKeyJSON `json:"apiKey,omitempty"`
}

func toTeam(t *auth.Team) teamJSON {
	return teamJSON{ID: t.ID, Name: t.Name, CreatedAt: t.CreatedAt.UTC(), Quota: t.Quota}
}

func (s *server) teamRoutes(rt *router) {
	rt.handle(http.MethodPost, "/ember/teams", s.createTeam)
	rt.handle(http.MethodGet, "/ember/teams", s.listTeams)
	rt.handle(http.MethodGet, "/ember/teams/{team}", s.getTeam)
	rt.handle(http.MethodGet, "/ember/teams/{team}/usage", s.teamUsage) // quotas.go
	rt.handle(http.MethodPut, "/ember/teams/{team}/quota", s.setTeamQuota)
	rt.handle(http.MethodDelete, "/ember/teams/{team}", s.deleteTeam)
}

func adminOnly(r *http.Request) error {
	if !auth.IsAdmin(r.Context()) {
		return &httpError{status: http.StatusForbidden, msg: "this needs an admin key"}
	}
	return nil
}

func (s *server) createTeam(w http.ResponseWriter, r *http.Request, _ params) error {
	if err := adminOnly(r); err != nil {
		return err
	}
	var req struct {
		Name  string     `json:"name"`
		Quota auth.Quota `json:"quota"`
	}
	if err := s.decodeJSON(w, r, &req, true); err != nil {
		return err
	}
	t, plain, k, err := s.keys.CreateTeam(r.Context(), req.Name, req.Quota)
	if err != nil {
		return err
	}
	out := toTeam(t)
	kj := toAPIKey(k)
	kj.Key = plain
	out.Key = &kj
	s.log.Info("team created", "team", t.ID, "name", t.Name)
	writeJSON(w, http.StatusCreated, out)
	return nil
}

func (s *server) listTeams(w http.ResponseWriter, r *http.Request, _ params) error {
	ts, err := s.keys.ListTeams(r.Context())
	if err != nil {
		return err
	}
	out := make([]teamJSON, 0, len(ts))
	for _, t := range ts {
		if auth.IsAdmin(r.Context()) || t.ID == auth.TeamOf(r.Context()) {
			out = append(out, toTeam(t))
		}
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

// team is the team {team} names, if the caller may see it (an admin key: any).
func (s *server) team(r *http.Request, p params) (*auth.Team, error) {
	id := p["team"]
	if !auth.ValidTeamID(id) || (!auth.IsAdmin(r.Context()) && id != auth.TeamOf(r.Context())) {
		return nil, notFound("team %s not found", quoteID(id))
	}
	t, err := s.keys.GetTeam(r.Context(), id)
	return t, teamNotFound(err, id)
}

func (s *server) getTeam(w http.ResponseWriter, r *http.Request, p params) error {
	t, err := s.team(r, p)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, toTeam(t))
	return nil
}

func (s *server) setTeamQuota(w http.ResponseWriter, r *http.Request, p params) error {
	if err := adminOnly(r); err != nil {
		return err
	}
	if _, err := s.team(r, p); err != nil {
		return err
	}
	var q auth.Quota
	if err := s.decodeJSON(w, r, &q, true); err != nil {
		return err
	}
	t, err := s.keys.SetQuota(r.Context(), p["team"], q)
	if err != nil {
		return teamNotFound(err, p["team"])
	}
	s.log.Info("team quota set", "team", t.ID, "quota", q)
	writeJSON(w, http.StatusOK, toTeam(t))
	return nil
}

func (s *server) deleteTeam(w http.ResponseWriter, r *http.Request, p params) error {
	if err := adminOnly(r); err != nil {
		return err
	}
	if _, err := s.team(r, p); err != nil {
		return err
	}
	if err := s.keys.DeleteTeam(r.Context(), p["team"]); err != nil {
		return teamNotFound(err, p["team"])
	}
	s.log.Info("team removed", "team", p["team"])
	w.WriteHeader(http.StatusNoContent)
	return nil
}
