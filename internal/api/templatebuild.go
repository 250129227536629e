package api

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/cluster/edge"
	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/template/build"
)

// E2B's template build API (E2B-PROTOCOL §2.4), which the SDKs' Template.build drives:
// POST /v3/templates requests a build, GET /templates/{id}/files/{hash} hands out upload URLs
// for COPY steps' tarballs, POST /v2/templates/{id}/builds/{buildID} starts the build with its
// steps, and GET .../status is polled for the state and log lines. Builds run in the sandbox
// domain (build.TemplateBuilder); the edge only translates.

// uploadPrefix is where upload URLs point. An upload carries no API key (the SDK sends only the
// headers the files response lists): the URL's token is the grant, single-use, for one hash.
const uploadPrefix = "/ember/template-files/"

// uploadTTL bounds how long an upload URL is valid.
const uploadTTL = time.Hour

type uploadGrant struct {
	hash    string
	expires time.Time
}

// uploads are the upload URLs handed out and not used yet.
type uploads struct {
	mu     sync.Mutex
	grants map[string]uploadGrant
}

func (u *uploads) grant(hash string) string {
	b := make([]byte, 24)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	tok := hex.EncodeToString(b)
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.grants == nil {
		u.grants = map[string]uploadGrant{}
	}
	now := time.Now()
	for k, g := range u.grants {
		if now.After(g.expires) {
			delete(u.grants, k)
		}
	}
	u.grants[tok] = uploadGrant{hash: hash, expires: now.Add(uploadTTL)}
	return tok
}

func (u *uploads) take(tok string) (string, bool) {
	u.mu.Lock()
	defer u.mu.Unlock()
	g, ok := u.grants[tok]
	delete(u.grants, tok)
	if !ok || time.Now().After(g.expires) {
		return "", false
	}
	return g.hash, true
}

func (s *server) builder() (build.TemplateBuilder, error) {
	b := s.cfg.Builds
	if b == nil {
		return nil, &httpError{status: http.StatusNotImplemented, msg: "template builds are not supported by this server"}
	}
	return edge.ShareBuilder(b, s.shared), nil // shared templates in a cluster
}

type templateRequestV3 struct {
	Name          string   `json:"name"`
	Alias         string   `json:"alias"`
	Tags          []string `json:"tags"`
	CPUCount      int      `json:"cpuCount"`
	MemoryMB      int      `json:"memoryMB"`
	MinFreeDiskMB int      `json:"minFreeDiskMb"`
}

type templateRequestResponse struct {
	TemplateID string   `json:"templateID"`
	BuildID    string   `json:"buildID"`
	Names      []string `json:"names"`
	Aliases    []string `json:"aliases"`
	Tags       []string `json:"tags"`
	Public     bool     `json:"public"`
}

// requestTemplateBuild is POST /v3/templates (and /v2/templates): 202 with the template and
// build ids. The template id is its name.
func (s *server) requestTemplateBuild(w http.ResponseWriter, r *http.Request, _ params) error {
	b, err := s.builder()
	if err != nil {
		return err
	}
	var req templateRequestV3
	if err := s.decodeJSON(w, r, &req, true); err != nil {
		return err
	}
	name := req.Name
	if name == "" {
		name = req.Alias
	}
	if name == "" {
		return badRequest("name is required")
	}
	if req.CPUCount < 0 || req.CPUCount > maxBuildCPUs {
		return badRequest("cpuCount must be between 0 and %d", maxBuildCPUs)
	}
	if req.MemoryMB < 0 || req.MemoryMB > maxBuildMemoryMB {
		return badRequest("memoryMB must be between 0 and %d", maxBuildMemoryMB)
	}
	if err := s.claimTemplateName(r.Context(), name); err != nil { // teams.go
		return err
	}
	release, err := s.admit(r.Context(), s.buildUsage()) // quotas.go: its record counts from now on
	if err != nil {
		return err
	}
	defer release()
	bld, err := b.RequestBuild(r.Context(), build.BuildSpec{Name: name, Team: auth.TeamOf(r.Context()), Tags: req.Tags, CPUCount: req.CPUCount, MemoryMB: req.MemoryMB})
	if err != nil {
		return err
	}
	tags := bld.Tags
	if tags == nil {
		tags = []string{}
	}
	writeJSON(w, http.StatusAccepted, templateRequestResponse{
		TemplateID: bld.TemplateID, BuildID: bld.ID, Names: []string{bld.TemplateID},
		Aliases: []string{bld.TemplateID}, Tags: tags,
	})
	return nil
}

type fileUploadResponse struct {
	Present bool   `json:"present"`
	URL     string `json:"url,omitempty"`
}

// templateFiles is GET /templates/{id}/files/{hash}: 201 {present} or {present:false, url}
// where url takes one PUT of the tarball.
func (s *server) templateFiles(w http.ResponseWriter, r *http.Request, p params) error {
	b, err := s.builder()
	if err != nil {
		return err
	}
	if !validTemplateID(p["id"]) {
		return notFound("template %s not found", quoteTemplate(p["id"]))
	}
	hash, err := teamFilesHash(r.Context(), p["hash"])
	if err != nil {
		return err
	}
	present, err := b.HasBuildFiles(r.Context(), hash)
	if err != nil {
		return err
	}
	resp := fileUploadResponse{Present: present}
	if !present {
		scheme := "http"
		if r.TLS != nil {
			scheme = "https"
		}
		resp.URL = scheme + "://" + r.Host + uploadPrefix + s.uploads.grant(hash)
	}
	writeJSON(w, http.StatusCreated, resp)
	return nil
}

// serveUpload is PUT <uploadPrefix>{token}: the tarball of one COPY step, bounded by the
// service's limit, stored complete or not at all.
func (s *server) serveUpload(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPut {
		w.Header().Set("Allow", http.MethodPut)
		writeJSONError(w, http.StatusMethodNotAllowed, "method "+r.Method+" not allowed")
		return
	}
	b, err := s.builder()
	if err != nil {
		writeError(w, s.log, r, err)
		return
	}
	hash, ok := s.uploads.take(strings.TrimPrefix(r.URL.Path, uploadPrefix))
	if !ok {
		writeJSONError(w, http.StatusForbidden, "the upload link is invalid, used or expired: ask for a new one")
		return
	}
	if err := b.PutBuildFiles(r.Context(), hash, r.Body); err != nil {
		writeError(w, s.log, r, err)
		return
	}
	w.WriteHeader(http.StatusOK)
}

type registryJSON struct {
	Type     string `json:"type"`
	Username string `json:"username"`
	Password string `json:"password"`
}

type templateBuildStartV2 struct {
	FromImage         string        `json:"fromImage"`
	FromTemplate      string        `json:"fromTemplate"`
	FromImageRegistry *registryJSON `json:"fromImageRegistry"`
	Steps             []build.Step  `json:"steps"`
	StartCmd          string        `json:"startCmd"`
	ReadyCmd          string        `json:"readyCmd"`
	Force             bool          `json:"force"`
}

// startTemplateBuild is POST /v2/templates/{id}/builds/{buildID}: 202 once the build runs.
func (s *server) startTemplateBuild(w http.ResponseWriter, r *http.Request, p params) error {
	b, err := s.builder()
	if err != nil {
		return err
	}
	var req templateBuildStartV2
	if err := s.decodeJSON(w, r, &req, true); err != nil {
		return err
	}
	if req.FromTemplate != "" {
		// Another team's template is not there to build from (teams.go), and answers as a
		// missing one, which is refused here too (not accepted to fail later).
		if _, err := s.lookupTemplate(r.Context(), req.FromTemplate, false); err != nil {
			return err
		}
	}
	for i := range req.Steps {
		if req.Steps[i].FilesHash != "" {
			if req.Steps[i].FilesHash, err = teamFilesHash(r.Context(), req.Steps[i].FilesHash); err != nil {
				return err
			}
		}
	}
	sreq := build.StepBuildRequest{FromImage: req.FromImage, FromTemplate: req.FromTemplate, Steps: req.Steps,
		StartCmd: req.StartCmd, ReadyCmd: req.ReadyCmd, Force: req.Force}
	if rg := req.FromImageRegistry; rg != nil {
		if rg.Type != "registry" {
			return badRequest("fromImageRegistry type %s is not supported here (only \"registry\" with username and password)", quoteID(rg.Type))
		}
		if rg.Username == "" || rg.Password == "" {
			return badRequest("fromImageRegistry needs a username and a password")
		}
		sreq.Auth = &sandbox.RegistryAuth{Username: rg.Username, Password: rg.Password}
	}
	if err := b.StartBuild(r.Context(), p["id"], p["buildID"], sreq); err != nil {
		return err
	}
	w.WriteHeader(http.StatusAccepted)
	return nil
}

type buildLogEntryJSON struct {
	Timestamp time.Time `json:"timestamp"`
	Level     string    `json:"level"`
	Message   string    `json:"message"`
	Step      string    `json:"step,omitempty"`
}

type buildReasonJSON struct {
	Message    string              `json:"message"`
	Step       string              `json:"step,omitempty"`
	LogEntries []buildLogEntryJSON `json:"logEntries"`
}

type templateBuildInfo struct {
	TemplateID string              `json:"templateID"`
	BuildID    string              `json:"buildID"`
	Status     string              `json:"status"`
	LogEntries []buildLogEntryJSON `json:"logEntries"`
	Logs       []string            `json:"logs"`
	Reason     *buildReasonJSON    `json:"reason,omitempty"`
}

var logLevels = map[string]int{"debug": 0, "info": 1, "warn": 2, "error": 3}

// buildStatus is GET /templates/{id}/builds/{buildID}/status?logsOffset=&limit=&level=.
func (s *server) buildStatus(w http.ResponseWriter, r *http.Request, p params) error {
	b, err := s.builder()
	if err != nil {
		return err
	}
	q := r.URL.Query()
	offset, limit := 0, 100
	if v := q.Get("logsOffset"); v != "" {
		if offset, err = strconv.Atoi(v); err != nil || offset < 0 {
			return badRequest("logsOffset must be a non-negative integer")
		}
	}
	if v := q.Get("limit"); v != "" {
		if limit, err = strconv.Atoi(v); err != nil || limit < 0 || limit > 100 {
			return badRequest("limit must be between 0 and 100")
		}
	}
	minLevel := 0
	if v := q.Get("level"); v != "" {
		l, ok := logLevels[v]
		if !ok {
			return badRequest("level must be one of debug, info, warn, error")
		}
		minLevel = l
	}
	bld, err := b.GetBuild(r.Context(), p["id"], p["buildID"])
	if err != nil {
		if statusOf(err) == http.StatusNotFound {
			return notFound("build %s of template %s not found", quoteTemplate(p["buildID"]), quoteTemplate(p["id"]))
		}
		return err
	}
	var entries []buildLogEntryJSON
	for _, e := range bld.Logs {
		if logLevels[e.Level] >= minLevel {
			entries = append(entries, buildLogEntryJSON(e))
		}
	}
	out := templateBuildInfo{TemplateID: bld.TemplateID, BuildID: bld.ID, Status: string(bld.Status), Logs: []string{}, LogEntries: []buildLogEntryJSON{}}
	// The build holds its last lines only: logsOffset counts from the log's first line.
	offset = max(0, offset-bld.LogsDropped)
	if offset < len(entries) {
		end := min(len(entries), offset+limit)
		out.LogEntries = entries[offset:end]
	}
	if bld.Reason != nil {
		tail := entries[max(0, len(entries)-20):]
		out.Reason = &buildReasonJSON{Message: bld.Reason.Message, Step: bld.Reason.Step, LogEntries: append([]buildLogEntryJSON{}, tail...)}
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

type templateBuildJSON struct {
	BuildID     string     `json:"buildID"`
	Status      string     `json:"status"`
	CreatedAt   time.Time  `json:"createdAt"`
	UpdatedAt   time.Time  `json:"updatedAt"`
	FinishedAt  *time.Time `json:"finishedAt,omitempty"`
	CPUCount    int        `json:"cpuCount"`
	MemoryMB    int        `json:"memoryMB"`
	EnvdVersion string     `json:"envdVersion"`
}

type templateWithBuilds struct {
	TemplateID    string              `json:"templateID"`
	Public        bool                `json:"public"`
	Aliases       []string            `json:"aliases"`
	Names         []string            `json:"names"`
	CreatedAt     time.Time           `json:"createdAt"`
	UpdatedAt     time.Time           `json:"updatedAt"`
	LastSpawnedAt *time.Time          `json:"lastSpawnedAt"`
	SpawnCount    int                 `json:"spawnCount"`
	Builds        []templateBuildJSON `json:"builds"`
	// ember's: what kind of record it is, and a snapshot's upload state (as in templateJSON).
	Kind          string `json:"kind,omitempty"`
	SnapshotState string `json:"snapshotState,omitempty"`
	SnapshotError string `json:"snapshotError,omitempty"`
}

// getTemplate is GET /templates/{id}: the template and its builds (newest first).
func (s *server) getTemplate(w http.ResponseWriter, r *http.Request, p params) error {
	b, err := s.builder()
	if err != nil {
		return err
	}
	t, err := b.GetTemplate(r.Context(), p["id"])
	if err != nil {
		return notFound("template %s not found", quoteTemplate(p["id"]))
	}
	tj := toTemplate(t, s.resources())
	out := templateWithBuilds{TemplateID: t.ID, Public: t.Public, Aliases: tj.Aliases, Names: tj.Names, CreatedAt: t.CreatedAt, UpdatedAt: t.CreatedAt, Builds: []templateBuildJSON{},
		Kind: tj.Kind, SnapshotState: tj.SnapshotState, SnapshotError: tj.SnapshotError}
	blds, err := b.ListBuilds(r.Context(), t.ID)
	if err != nil {
		return err
	}
	seen := false
	for _, bl := range blds {
		bj := templateBuildJSON{BuildID: bl.ID, Status: string(bl.Status), CreatedAt: bl.CreatedAt, UpdatedAt: bl.UpdatedAt,
			CPUCount: orInt(bl.CPUCount, tj.CPUCount), MemoryMB: orInt(bl.MemoryMB, tj.MemoryMB), EnvdVersion: sandbox.EnvdVersion}
		if !bl.FinishedAt.IsZero() {
			f := bl.FinishedAt
			bj.FinishedAt = &f
		}
		seen = seen || bl.ID == t.BuildID
		out.Builds = append(out.Builds, bj)
	}
	if !seen && t.BuildID != "" {
		// A template built another way (the CLI, start-up): its one build.
		st := "building"
		if t.Ready {
			st = "ready"
		}
		out.Builds = append(out.Builds, templateBuildJSON{BuildID: t.BuildID, Status: st, CreatedAt: t.CreatedAt, UpdatedAt: t.CreatedAt,
			FinishedAt: &t.CreatedAt, CPUCount: tj.CPUCount, MemoryMB: tj.MemoryMB, EnvdVersion: sandbox.EnvdVersion})
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

func orInt(v, d int) int {
	if v != 0 {
		return v
	}
	return d
}

type assignTagsRequest struct {
	Target string   `json:"target"`
	Tags   []string `json:"tags"`
}

type assignedTags struct {
	BuildID string   `json:"buildID"`
	Tags    []string `json:"tags"`
}

// assignTags is POST /templates/tags {target:"name:tag", tags}: 201 {buildID, tags}.
func (s *server) assignTags(w http.ResponseWriter, r *http.Request, _ params) error {
	b, err := s.builder()
	if err != nil {
		return err
	}
	var req assignTagsRequest
	if err := s.decodeJSON(w, r, &req, true); err != nil {
		return err
	}
	name, tag := sandbox.SplitTemplateName(req.Target)
	if name == "" {
		return badRequest("target is required (name or name:tag)")
	}
	if len(req.Tags) == 0 {
		return badRequest("tags are required")
	}
	t, err := b.AssignTags(r.Context(), name, tag, req.Tags)
	if err != nil {
		return templateErr(err, name)
	}
	writeJSON(w, http.StatusCreated, assignedTags{BuildID: t.BuildID, Tags: req.Tags})
	return nil
}

type deleteTagsRequest struct {
	Name string   `json:"name"`
	Tags []string `json:"tags"`
}

// removeTags is DELETE /templates/tags {name, tags}: 204.
func (s *server) removeTags(w http.ResponseWriter, r *http.Request, _ params) error {
	b, err := s.builder()
	if err != nil {
		return err
	}
	var req deleteTagsRequest
	if err := s.decodeJSON(w, r, &req, true); err != nil {
		return err
	}
	name, _ := sandbox.SplitTemplateName(req.Name)
	if name == "" || len(req.Tags) == 0 {
		return badRequest("name and tags are required")
	}
	if err := b.RemoveTags(r.Context(), name, req.Tags); err != nil {
		return templateErr(err, name)
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

type templateTagJSON struct {
	Tag       string    `json:"tag"`
	BuildID   string    `json:"buildID"`
	CreatedAt time.Time `json:"createdAt"`
}

// templateTags is GET /templates/{id}/tags.
func (s *server) templateTags(w http.ResponseWriter, r *http.Request, p params) error {
	b, err := s.builder()
	if err != nil {
		return err
	}
	t, err := b.GetTemplate(r.Context(), p["id"])
	if err != nil {
		return notFound("template %s not found", quoteTemplate(p["id"]))
	}
	out := []templateTagJSON{}
	for _, tg := range t.Tags {
		out = append(out, templateTagJSON(tg))
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

// templateErr gives a template's 404 E2B's wording.
func templateErr(err error, name string) error {
	if statusOf(err) == http.StatusNotFound && !strings.Contains(err.Error(), "tag") {
		return notFound("template %s not found", quoteTemplate(name))
	}
	return err
}

// buildLogs is GET /templates/{id}/builds/{buildID}/logs?cursor=&limit=&direction=&level=:
// {logs} from the cursor (a timestamp in ms) forward (oldest first, the default) or backward
// (newest first).
func (s *server) buildLogs(w http.ResponseWriter, r *http.Request, p params) error {
	b, err := s.builder()
	if err != nil {
		return err
	}
	q := r.URL.Query()
	limit := 100
	if v := q.Get("limit"); v != "" {
		if limit, err = strconv.Atoi(v); err != nil || limit < 0 || limit > 100 {
			return badRequest("limit must be between 0 and 100")
		}
	}
	var cursor time.Time
	if v := q.Get("cursor"); v != "" {
		ms, err := strconv.ParseInt(v, 10, 64)
		if err != nil || ms < 0 {
			return badRequest("cursor must be a timestamp in milliseconds")
		}
		cursor = time.UnixMilli(ms)
	}
	backward := false
	switch q.Get("direction") {
	case "", "forward":
	case "backward":
		backward = true
	default:
		return badRequest("direction must be forward or backward")
	}
	minLevel := 0
	if v := q.Get("level"); v != "" {
		l, ok := logLevels[v]
		if !ok {
			return badRequest("level must be one of debug, info, warn, error")
		}
		minLevel = l
	}
	bld, err := b.GetBuild(r.Context(), p["id"], p["buildID"])
	if err != nil {
		if statusOf(err) == http.StatusNotFound {
			return notFound("build %s of template %s not found", quoteTemplate(p["buildID"]), quoteTemplate(p["id"]))
		}
		return err
	}
	out := []buildLogEntryJSON{}
	n := len(bld.Logs)
	for i := 0; i < n && len(out) < limit; i++ {
		e := bld.Logs[i]
		if backward {
			e = bld.Logs[n-1-i]
		}
		if logLevels[e.Level] < minLevel || !cursor.IsZero() && (!backward && e.Timestamp.Before(cursor) || backward && e.Timestamp.After(cursor)) {
			continue
		}
		out = append(out, buildLogEntryJSON(e))
	}
	writeJSON(w, http.StatusOK, map[string]any{"logs": out})
	return nil
}

// teamFilesHash is where the caller's team keeps the COPY files a client names by hash: the
// hash is the client's claim (E2B's, over the files and their paths, not checked against the
// upload), so each team has its own store of them, and no team can use, or learn of, another's
// upload by naming its hash.
func teamFilesHash(ctx context.Context, hash string) (string, error) {
	if !filesHashRe.MatchString(hash) {
		return "", badRequest("files hash %s: must be 64 lowercase hex digits", quoteID(hash))
	}
	sum := sha256.Sum256([]byte("ember-files\x00" + auth.TeamOf(ctx) + "\x00" + hash))
	return hex.EncodeToString(sum[:]), nil
}

var filesHashRe = regexp.MustCompile(`^[0-9a-f]{64}$`)
