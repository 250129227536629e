package api

import (
	"encoding/json"
	"net/http"
	"sync"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// Limits on a build request's resources.
const (
	maxBuildCPUs     = 64
	maxBuildMemoryMB = 256 << 10
)

type buildRequest struct {
	From     string `json:"from"`
	StartCmd string `json:"startCmd"`
	ReadyCmd string `json:"readyCmd"`
	Force    bool   `json:"force"` // accepted and ignored: every build rebuilds the template
	CPUCount int    `json:"cpuCount"`
	MemoryMB int    `json:"memoryMB"`
}

// importArchive stores the request body (a `docker save` or OCI layout tarball) in the node's
// import directory: 201 {"name","size"}; a build then names it as "archive:NAME".
func (s *server) importArchive(w http.ResponseWriter, r *http.Request, _ params) error {
	b, err := s.builder()
	if err != nil {
		return err
	}
	name, size, err := b.ImportArchive(r.Context(), auth.TeamOf(r.Context()), r.Body)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, map[string]any{"name": name, "size": size})
	return nil
}

func (s *server) deleteImport(w http.ResponseWriter, r *http.Request, p params) error {
	b, err := s.builder()
	if err != nil {
		return err
	}
	if err := b.DeleteImport(r.Context(), auth.TeamOf(r.Context()), p["name"]); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

type buildLine struct {
	Line     string        `json:"line,omitempty"`
	Template *templateJSON `json:"template,omitempty"`
	Error    *errorBody    `json:"error,omitempty"`
}

// buildTemplate runs a template build and streams NDJSON: {"line":...} per progress line, then
// one {"template":{...}} or {"error":{"code","message"}}. Input errors are ordinary 4xx
// responses; once streaming starts the status is 200 and failures arrive as the error line.
// Cancelling the request cancels the build.
func (s *server) buildTemplate(w http.ResponseWriter, r *http.Request, p params) error {
	b, err := s.builder()
	if err != nil {
		return err
	}
	name := p["name"]
	if !templateNameRe.MatchString(name) {
		return badRequest("invalid template name %s: use lowercase letters, digits, '.', '_' and '-'", quoteID(name))
	}
	var req buildRequest
	if err := s.decodeJSON(w, r, &req, false); err != nil {
		return err
	}
	if req.CPUCount < 0 || req.CPUCount > maxBuildCPUs {
		return badRequest("cpuCount must be between 0 and %d", maxBuildCPUs)
	}
	if req.MemoryMB < 0 || req.MemoryMB > maxBuildMemoryMB {
		return badRequest("memoryMB must be between 0 and %d", maxBuildMemoryMB)
	}
	breq := sandbox.BuildRequest{
		Name:     name,
		From:     req.From,
		StartCmd: req.StartCmd,
		ReadyCmd: req.ReadyCmd,
		CPUCount: req.CPUCount,
		MemoryMB: req.MemoryMB,
		Team:     auth.TeamOf(r.Context()), // its imports only (scopeBuild sets it too)
	}
	// A bad source (an `archive:` outside the import directory among them) is a 400 before
	// anything streams.
	if err := b.CheckBuild(breq); err != nil {
		return err
	}
	release, err := s.scopeBuild(r.Context(), &breq) // teams.go
	if err != nil {
		return err
	}
	defer release()

	w.Header().Set("Content-Type", "application/x-ndjson")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	enc := json.NewEncoder(w)
	var mu sync.Mutex
	done := false
	emit := func(l buildLine) {
		mu.Lock()
		defer mu.Unlock()
		if done {
			return
		}
		if err := enc.Encode(l); err == nil {
			_ = rc.Flush()
		}
	}
	_ = rc.Flush()

	t, err := b.BuildTemplate(r.Context(), breq, func(line string) { emit(buildLine{Line: line}) })
	switch {
	case err != nil:
		st := statusOf(err)
		msg := err.Error()
		if st == http.StatusInternalServerError {
			s.log.Error("template build failed", "template_id", name, "err", err)
		}
		emit(buildLine{Error: &errorBody{Code: st, Message: msg}})
	case t == nil:
		emit(buildLine{Error: &errorBody{Code: http.StatusInternalServerError, Message: "build returned no template"}})
	default:
		tj := toTemplate(t, s.resources())
		emit(buildLine{Template: &tj})
	}
	mu.Lock()
	done = true
	mu.Unlock()
	return nil
}
