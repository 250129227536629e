package api

import (
	"context"
	"net/http"
	"strconv"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/cluster/edge"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

func (s *server) controlRoutes() *router {
	rt := &router{guard: s.guard}
	// Sandboxes (E2B-PROTOCOL §2.2 and the legacy endpoints of §2.5).
	rt.handle(http.MethodPost, "/sandboxes", s.createSandbox)
	rt.handle(http.MethodPost, "/v2/sandboxes", s.createSandbox)
	rt.handle(http.MethodGet, "/sandboxes", s.listSandboxesV1)
	rt.handle(http.MethodGet, "/v2/sandboxes", s.listSandboxesV2)
	rt.handle(http.MethodGet, "/sandboxes/{id}", s.getSandbox)
	rt.handle(http.MethodDelete, "/sandboxes/{id}", s.killSandbox)
	rt.handle(http.MethodPost, "/sandboxes/{id}/timeout", s.setTimeout)
	rt.handle(http.MethodPost, "/sandboxes/{id}/refreshes", s.refresh)
	rt.handle(http.MethodGet, "/sandboxes/{id}/metrics", s.metrics)
	rt.handle(http.MethodPost, "/sandboxes/{id}/pause", s.pause)
	rt.handle(http.MethodPost, "/sandboxes/{id}/connect", s.connectV1)
	rt.handle(http.MethodPost, "/v2/sandboxes/{id}/connect", s.connectV2)
	rt.handle(http.MethodPost, "/sandboxes/{id}/resume", s.resume)
	rt.handle(http.MethodPost, "/sandboxes/{id}/snapshots", s.createSnapshot)
	rt.handle(http.MethodPost, "/sandboxes/{id}/fork", s.fork)
	rt.handle(http.MethodPut, "/sandboxes/{id}/network", s.updateNetwork)
	s.checkpointRoutes(rt) // step checkpoints and rollback (checkpoints.go)
	// Snapshots and templates.
	rt.handle(http.MethodGet, "/snapshots", s.listSnapshots)
	rt.handle(http.MethodGet, "/templates", s.listTemplates)
	rt.handle(http.MethodGet, "/v2/templates", s.listTemplates)
	rt.handle(http.MethodGet, "/templates/aliases/{alias}", s.getTemplateAlias)
	// Template builds (templatebuild.go); /templates/tags before /templates/{id}.
	rt.handle(http.MethodPost, "/v3/templates", s.requestTemplateBuild)
	rt.handle(http.MethodPost, "/v2/templates", s.requestTemplateBuild)
	rt.handle(http.MethodPost, "/v2/templates/{id}/builds/{buildID}", s.startTemplateBuild)
	rt.handle(http.MethodGet, "/templates/{id}/builds/{buildID}/status", s.buildStatus)
	rt.handle(http.MethodGet, "/templates/{id}/builds/{buildID}/logs", s.buildLogs)
	rt.handle(http.MethodGet, "/templates/{id}/files/{hash}", s.templateFiles)
	rt.handle(http.MethodPost, "/templates/tags", s.assignTags)
	rt.handle(http.MethodDelete, "/templates/tags", s.removeTags)
	rt.handle(http.MethodGet, "/templates/{id}/tags", s.templateTags)
	rt.handle(http.MethodGet, "/templates/{id}", s.getTemplate)
	rt.handle(http.MethodDelete, "/templates/{id}", s.deleteTemplate)
	rt.handle(http.MethodPatch, "/templates/{id}", s.updateTemplate) // teams.go: {public}
	// ember extras for the CLI.
	rt.handle(http.MethodPost, "/ember/templates/{name}/build", s.buildTemplate)
	rt.handle(http.MethodPost, "/ember/imports", s.importArchive)
	rt.handle(http.MethodDelete, "/ember/imports/{name}", s.deleteImport)
	rt.handle(http.MethodGet, "/ember/pools", s.listPools)
	rt.handle(http.MethodPost, "/ember/pools/{template}/warm", s.warmPool)
	rt.handle(http.MethodPost, "/api-keys", s.createAPIKey)
	rt.handle(http.MethodGet, "/api-keys", s.listAPIKeys)
	rt.handle(http.MethodDelete, "/api-keys/{id}", s.deleteAPIKey)
	s.teamRoutes(rt)   // teamroutes.go
	s.volumeRoutes(rt) // volumes.go
	s.secretRoutes(rt) // secrets.go
	s.nodeRoutes(rt)
	s.moveRoutes(rt) // cluster.go
	return rt
}

func (s *server) createSandbox(w http.ResponseWriter, r *http.Request, _ params) error {
	sj, err := s.createFrom(w, r, edge.ReservationOf(r.Context()))
	if err != nil {
		return err
	}
	if cause := context.Cause(r.Context()); cause != nil {
		// The caller is gone (a client timeout in a burst): nobody has the sandbox's id, and it
		// would hold the node's room until its timeout.
		s.log.Warn("create abandoned by its caller: killing the sandbox", "sandbox_id", sj.SandboxID, "cause", cause)
		if err := s.svc.Kill(context.WithoutCancel(r.Context()), sj.SandboxID); err != nil {
			s.log.Warn("kill an abandoned sandbox", "sandbox_id", sj.SandboxID, "err", err)
		}
		return nil // nobody to answer

	}
	writeJSON(w, http.StatusCreated, sj)
	return nil
}

// createFrom creates the sandbox r's body asks for, consuming a placement reservation ("" =
// none): the route's work, and the cluster edge's when it places a create here.
func (s *server) createFrom(w http.ResponseWriter, r *http.Request, reservation string) (*sandboxJSON, error) {
	var req struct {
		newSandboxRequest
		Network *networkJSON `json:"network"`
	}
	if err := s.decodeJSON(w, r, &req, true); err != nil {
		return nil, err
	}
	if req.TemplateID == "" {
		return nil, badRequest("templateID is required")
	}
	if !validTemplateID(req.TemplateID) {
		return nil, badRequest("invalid templateID %s", quoteID(req.TemplateID))
	}
	timeout, err := timeoutSeconds("timeout", req.Timeout, sandbox.DefaultTimeout, false)
	if err != nil {
		return nil, err
	}
	network, err := req.Network.toConfig(auth.TeamOf(r.Context()))
	if err != nil {
		return nil, err
	}
	mounts, release, err := s.resolveVolumeMounts(r, req.VolumeMounts) // volumes.go
	if err != nil {
		return nil, err
	}
	defer release()
	ctx, err := withAdmission(w, r) // admission.go
	if err != nil {
		return nil, err
	}
	if s.cfg.Startup != nil {
		// A template the daemon is still building at start-up: the create waits for it, as a
		// create of a built-in template waits for its build.
		name, _ := sandbox.SplitTemplateName(req.TemplateID)
		if err := s.cfg.Startup.Wait(ctx, name); err != nil {
			return nil, err
		}
	}
	sbx, err := s.svc.Create(ctx, sandbox.CreateRequest{
		TemplateID:      req.TemplateID,
		Timeout:         timeout,
		Metadata:        req.Metadata,
		EnvVars:         req.EnvVars,
		AutoPause:       req.AutoPause != nil && *req.AutoPause,
		AutoPauseMemory: req.AutoPauseMemory,
		AutoResume:      autoResume(req.AutoResume),
		AllowInternet:   req.AllowInternetAccess,
		Network:         network,
		Reservation:     reservation,
		VolumeMounts:    mounts,
	})
	if err != nil {
		return nil, err
	}
	sj := s.toSandbox(sbx)
	return &sj, nil
}

func (s *server) getSandbox(w http.ResponseWriter, r *http.Request, p params) error {
	id, err := sandboxIDParam(p)
	if err != nil {
		return err
	}
	sbx, err := s.svc.Get(r.Context(), id)
	if err != nil {
		return err
	}
	if sbx.State == sandbox.StateKilled {
		return notFound("sandbox %s not found", quoteID(id))
	}
	writeJSON(w, http.StatusOK, s.toDetail(sbx))
	return nil
}

func (s *server) killSandbox(w http.ResponseWriter, r *http.Request, p params) error {
	id, err := sandboxIDParam(p)
	if err != nil {
		return err
	}
	if err := s.svc.Kill(r.Context(), id); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// setTimeout must fail on a paused sandbox (404 from the Manager): JS 2.0–2.5 connect by
// trying /timeout and resuming only when it fails.
func (s *server) setTimeout(w http.ResponseWriter, r *http.Request, p params) error {
	id, err := sandboxIDParam(p)
	if err != nil {
		return err
	}
	var req struct {
		Timeout *int64 `json:"timeout"`
	}
	if err := s.decodeJSON(w, r, &req, true); err != nil {
		return err
	}
	if req.Timeout == nil {
		return badRequest("timeout is required")
	}
	d, err := timeoutSeconds("timeout", req.Timeout, 0, true)
	if err != nil {
		return err
	}
	if err := s.svc.SetTimeout(r.Context(), id, d); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (s *server) refresh(w http.ResponseWriter, r *http.Request, p params) error {
	id, err := sandboxIDParam(p)
	if err != nil {
		return err
	}
	var req struct {
		Duration *int64 `json:"duration"`
	}
	if err := s.decodeJSON(w, r, &req, false); err != nil {
		return err
	}
	d, err := timeoutSeconds("duration", req.Duration, sandbox.DefaultTimeout, false)
	if err != nil {
		return err
	}
	if err := s.svc.SetTimeout(r.Context(), id, d); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (s *server) metrics(w http.ResponseWriter, r *http.Request, p params) error {
	id, err := sandboxIDParam(p)
	if err != nil {
		return err
	}
	q := r.URL.Query()
	start, err := unixParam(q.Get("start"), "start")
	if err != nil {
		return err
	}
	end, err := unixParam(q.Get("end"), "end")
	if err != nil {
		return err
	}
	ms, err := s.svc.Metrics(r.Context(), id)
	if err != nil {
		return err
	}
	out := make([]metricJSON, 0, len(ms))
	for _, m := range ms {
		ts := m.Timestamp.Unix()
		if (start != nil && ts < *start) || (end != nil && ts > *end) {
			continue
		}
		out = append(out, toMetric(m))
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

func unixParam(v, name string) (*int64, error) {
	if v == "" {
		return nil, nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 0 {
		return nil, badRequest("%s must be unix seconds", name)
	}
	return &n, nil
}

func (s *server) pause(w http.ResponseWriter, r *http.Request, p params) error {
	id, err := sandboxIDParam(p)
	if err != nil {
		return err
	}
	var req struct {
		Memory *bool `json:"memory"`
	}
	if err := s.decodeJSON(w, r, &req, false); err != nil {
		return err
	}
	if err := s.svc.PauseWith(r.Context(), id, sandbox.PauseOptions{KeepMemory: req.Memory == nil || *req.Memory}); err != nil {
		if statusOf(err) == http.StatusConflict {
			if cur, gerr := s.svc.Get(r.Context(), id); gerr == nil && cur.State == sandbox.StatePaused {
				return &httpError{status: http.StatusConflict, msg: "Error pausing sandbox - sandbox '" + id + "' is already paused"}
			}
		}
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

type connectRequest struct {
	Timeout *int64 `json:"timeout"`
	Memory  *bool  `json:"memory"`
}

func (s *server) connectV1(w http.ResponseWriter, r *http.Request, p params) error {
	return s.connect(w, r, p, true)
}

func (s *server) connectV2(w http.ResponseWriter, r *http.Request, p params) error {
	return s.connect(w, r, p, false)
}

func autoResume(a *autoResumeJSON) *bool {
	if a == nil {
		return nil
	}
	return a.Enabled
}

// connect resumes a paused sandbox (201) or extends a running one (200).
func (s *server) connect(w http.ResponseWriter, r *http.Request, p params, bodyRequired bool) error {
	id, err := sandboxIDParam(p)
	if err != nil {
		return err
	}
	var req connectRequest
	if err := s.decodeJSON(w, r, &req, bodyRequired); err != nil {
		return err
	}
	d, err := timeoutSeconds("timeout", req.Timeout, sandbox.DefaultTimeout, false)
	if err != nil {
		return err
	}
	sbx, resumed, err := s.svc.ConnectWith(r.Context(), id, sandbox.ConnectOptions{Timeout: d, Reboot: req.Memory != nil && !*req.Memory})
	if err != nil {
		return err
	}
	status := http.StatusOK
	if resumed {
		status = http.StatusCreated
	}
	writeJSON(w, status, s.toSandbox(sbx))
	return nil
}

// resume is JS 2.0–2.5's resume: 201 when it resumed, 409 when the sandbox already runs.
func (s *server) resume(w http.ResponseWriter, r *http.Request, p params) error {
	id, err := sandboxIDParam(p)
	if err != nil {
		return err
	}
	var req struct {
		Timeout   *int64 `json:"timeout"`
		AutoPause *bool  `json:"autoPause"`
		Memory    *bool  `json:"memory"`
	}
	if err := s.decodeJSON(w, r, &req, false); err != nil {
		return err
	}
	d, err := timeoutSeconds("timeout", req.Timeout, sandbox.DefaultTimeout, false)
	if err != nil {
		return err
	}
	cur, err := s.svc.Get(r.Context(), id)
	if err != nil {
		return err
	}
	switch cur.State {
	case sandbox.StateRunning:
		return &httpError{status: http.StatusConflict, msg: "sandbox " + quoteID(id) + " is already running"}
	case sandbox.StateKilled:
		return notFound("sandbox %s not found", quoteID(id))
	}
	sbx, resumed, err := s.svc.Connect(r.Context(), id, d)
	if err != nil {
		return err
	}
	if !resumed {
		return &httpError{status: http.StatusConflict, msg: "sandbox " + quoteID(id) + " is already running"}
	}
	writeJSON(w, http.StatusCreated, s.toSandbox(sbx))
	return nil
}

func (s *server) createSnapshot(w http.ResponseWriter, r *http.Request, p params) error {
	id, err := sandboxIDParam(p)
	if err != nil {
		return err
	}
	var req struct {
		Name string `json:"name"`
		// CheckpointID promotes that step checkpoint instead of capturing the sandbox now.
		CheckpointID *string `json:"checkpointID"`
	}
	if err := s.decodeJSON(w, r, &req, false); err != nil {
		return err
	}
	if req.Name != "" && !validTemplateID(req.Name) {
		return badRequest("invalid snapshot name %s", quoteID(req.Name))
	}
	var t *sandbox.Template
	if req.CheckpointID != nil {
		t, err = s.snapshotCheckpoint(r, id, *req.CheckpointID, req.Name)
	} else {
		t, err = s.svc.Snapshot(r.Context(), id, req.Name)
	}
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, createSnapshotResponse{SnapshotID: t.ID, Names: templateNames(t), State: t.UploadState()})
	return nil
}

// MaxForkCount bounds one fork call.
const MaxForkCount = 64

// fork validates the body before it looks at the sandbox, as E2B does: a bad count is 400 even
// for an id that does not exist.
func (s *server) fork(w http.ResponseWriter, r *http.Request, p params) error {
	var req struct {
		Count   *int64 `json:"count"`
		Timeout *int64 `json:"timeout"`
		// CheckpointID forks from that step checkpoint instead of the sandbox as it is now.
		CheckpointID *string `json:"checkpointID"`
	}
	if err := s.decodeJSON(w, r, &req, false); err != nil {
		return err
	}
	d, err := timeoutSeconds("timeout", req.Timeout, sandbox.DefaultTimeout, false)
	if err != nil {
		return err
	}
	count := int64(1)
	if req.Count != nil {
		count = *req.Count
	}
	if count < 1 {
		return badRequest("Count must be at least 1")
	}
	if count > MaxForkCount {
		return badRequest("Count cannot be greater than %d", MaxForkCount)
	}
	id, err := sandboxIDParam(p)
	if err != nil {
		return err
	}
	var results []sandbox.ForkResult
	if req.CheckpointID != nil {
		// From a step checkpoint: on this node, where it is (checkpoints.go).
		results, err = s.forkCheckpoint(r, id, *req.CheckpointID, int(count), d)
	} else {
		if s.forkAcross(w, r, id, int(count), d) { // cluster mode: children on other nodes too (cluster.go)
			return nil
		}
		results, err = s.svc.Fork(r.Context(), id, int(count), d)
	}
	if err != nil {
		return err
	}
	out := make([]forkResultJSON, 0, len(results))
	for _, res := range results {
		switch {
		case res.Err != nil:
			st := statusOf(res.Err)
			msg := res.Err.Error()
			if st == http.StatusInternalServerError {
				s.log.Error("fork child failed", "sandbox_id", id, "err", res.Err)
				msg = "internal error"
			}
			out = append(out, forkResultJSON{Error: &errorBody{Code: st, Message: msg}})
		case res.Sandbox != nil:
			sj := s.toSandbox(res.Sandbox)
			out = append(out, forkResultJSON{Sandbox: &sj})
		}
	}
	writeJSON(w, http.StatusCreated, out)
	return nil
}

func (s *server) listSnapshots(w http.ResponseWriter, r *http.Request, _ params) error {
	q := r.URL.Query()
	sandboxID := q.Get("sandboxID")
	if sandboxID != "" && !validSandboxID(sandboxID) {
		writeJSON(w, http.StatusOK, []snapshotJSON{})
		return nil
	}
	name := q.Get("name")
	limit, err := limitParam(q.Get("limit"))
	if err != nil {
		return err
	}
	cur, err := decodeCursor(q.Get("nextToken"))
	if err != nil {
		return err
	}
	ts, err := s.svc.ListSnapshots(r.Context(), sandboxID)
	if err != nil {
		return err
	}
	items := make([]pageItem[*sandbox.Template], 0, len(ts))
	for _, t := range ts {
		if name != "" && !templateHasName(t, name) {
			continue
		}
		items = append(items, pageItem[*sandbox.Template]{at: t.CreatedAt, id: t.ID, v: t})
	}
	writePage(w, items, true, cur, limit, toSnapshot)
	return nil
}

func templateHasName(t *sandbox.Template, name string) bool {
	if t.ID == name {
		return true
	}
	for _, n := range append(append([]string(nil), t.Names...), t.Aliases...) {
		if n == name {
			return true
		}
	}
	return false
}

func (s *server) listPools(w http.ResponseWriter, r *http.Request, _ params) error {
	writeJSON(w, http.StatusOK, s.svc.Pools(r.Context()))
	return nil
}

func (s *server) listTemplates(w http.ResponseWriter, r *http.Request, _ params) error {
	ts, err := s.svc.ListTemplates(r.Context())
	if err != nil {
		return err
	}
	out := make([]templateJSON, 0, len(ts))
	for _, t := range ts {
		out = append(out, toTemplate(t, s.resources()))
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

func (s *server) deleteTemplate(w http.ResponseWriter, r *http.Request, p params) error {
	id := p["id"]
	if !validTemplateID(id) {
		return notFound("template %s not found", quoteID(id))
	}
	if err := s.svc.DeleteTemplate(r.Context(), id); err != nil {
		return templateNotFoundE2B(err) // as another team's answers (teams.go)
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}
