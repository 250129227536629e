package api

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/volume"
)

// E2B's volumes: /volumes (behind the API key) and the content API /volumecontent/{id}/...
// (behind the volume's own token, `Authorization: Bearer <token>`), served by internal/volume.

// volumeOwner is the owner recorded for volumes: the caller's team ("" for the default team,
// as volumes made before teams recorded).
func volumeOwner(ctx context.Context) string {
	if t := auth.TeamOf(ctx); t != auth.DefaultTeamID {
		return t
	}
	return ""
}

// volumeContentPrefix is routed before the control plane (its token is not an API key).
const volumeContentPrefix = "/volumecontent/"

type volumeJSON struct {
	VolumeID string `json:"volumeID"`
	Name     string `json:"name"`
}

type volumeAndTokenJSON struct {
	VolumeID string `json:"volumeID"`
	Name     string `json:"name"`
	Token    string `json:"token"`
}

type volumeEntryJSON struct {
	Name   string `json:"name"`
	Type   string `json:"type"`
	Path   string `json:"path"`
	Size   int64  `json:"size"`
	Mode   uint32 `json:"mode"`
	UID    uint32 `json:"uid"`
	GID    uint32 `json:"gid"`
	Atime  string `json:"atime"`
	Mtime  string `json:"mtime"`
	Ctime  string `json:"ctime"`
	Target string `json:"target,omitempty"`
}

// volumeTime is RFC 3339 in UTC with microseconds (Python's isoparse reads at most six digits).
func volumeTime(t time.Time) string { return t.UTC().Format("2006-01-02T15:04:05.000000Z07:00") }

func toEntryJSON(e *volume.Entry) volumeEntryJSON {
	return volumeEntryJSON{Name: e.Name, Type: string(e.Type), Path: e.Path, Size: e.Size, Mode: e.Mode,
		UID: e.UID, GID: e.GID, Atime: volumeTime(e.Atime), Mtime: volumeTime(e.Mtime), Ctime: volumeTime(e.Ctime), Target: e.Target}
}

func (s *server) volumeRoutes(rt *router) {
	if s.cfg.Volumes == nil {
		return
	}
	rt.handle(http.MethodPost, "/volumes", s.createVolume)
	rt.handle(http.MethodGet, "/volumes", s.listVolumes)
	rt.handle(http.MethodGet, "/volumes/{id}", s.getVolume)
	rt.handle(http.MethodDelete, "/volumes/{id}", s.destroyVolume)
}

func (s *server) createVolume(w http.ResponseWriter, r *http.Request, _ params) error {
	var req struct {
		Name string `json:"name"`
	}
	if err := s.decodeJSON(w, r, &req, true); err != nil {
		return err
	}
	if req.Name == "" {
		return badRequest("name is required")
	}
	v, err := s.cfg.Volumes.Create(r.Context(), volumeOwner(r.Context()), req.Name)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, volumeAndTokenJSON{VolumeID: v.ID, Name: v.Name, Token: v.Token})
	return nil
}

func (s *server) listVolumes(w http.ResponseWriter, r *http.Request, _ params) error {
	vols, err := s.cfg.Volumes.Volumes(r.Context(), volumeOwner(r.Context()))
	if err != nil {
		return err
	}
	out := make([]volumeJSON, 0, len(vols))
	for _, v := range vols {
		out = append(out, volumeJSON{VolumeID: v.ID, Name: v.Name})
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

func (s *server) getVolume(w http.ResponseWriter, r *http.Request, p params) error {
	v, err := s.cfg.Volumes.Get(r.Context(), volumeOwner(r.Context()), p["id"])
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, volumeAndTokenJSON{VolumeID: v.ID, Name: v.Name, Token: v.Token})
	return nil
}

func (s *server) destroyVolume(w http.ResponseWriter, r *http.Request, p params) error {
	if err := s.cfg.Volumes.Destroy(r.Context(), volumeOwner(r.Context()), p["id"]); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// resolveVolumeMounts turns create's volumeMounts (volume names) into the sandbox's mounts.
// Call release once the create returned: until then the volumes cannot be destroyed.
func (s *server) resolveVolumeMounts(r *http.Request, in []volumeMountJSON) (_ []sandbox.VolumeMount, release func(), err error) {
	var releases []func()
	release = func() {
		for _, f := range releases {
			f()
		}
	}
	defer func() {
		if err != nil {
			release()
		}
	}()
	if len(in) == 0 {
		return nil, release, nil
	}
	if s.cfg.Volumes == nil {
		return nil, release, badRequest("volumes are not enabled on this server")
	}
	out := make([]sandbox.VolumeMount, 0, len(in))
	for _, m := range in {
		if m.Name == "" {
			return nil, release, badRequest("volumeMounts: name is required")
		}
		id, dir, rel, err := s.cfg.Volumes.Resolve(r.Context(), volumeOwner(r.Context()), m.Name)
		if errors.Is(err, errdefs.ErrNotFound) {
			return nil, release, badRequest("volume '%s' not found", m.Name)
		}
		if err != nil {
			return nil, release, err
		}
		releases = append(releases, rel)
		out = append(out, sandbox.VolumeMount{Name: m.Name, Path: m.Path, ID: id, HostDir: dir})
	}
	return out, release, sandbox.ValidateVolumeMounts(out)
}

func volumeMountsJSON(sb *sandbox.Sandbox) []volumeMountJSON {
	out := make([]volumeMountJSON, 0, len(sb.VolumeMounts))
	for _, v := range sb.VolumeMounts {
		out = append(out, volumeMountJSON{Name: v.Name, Path: v.Path})
	}
	return out
}

// serveVolumeContent serves /volumecontent/{id}/{dir|path|file}.
func (s *server) serveVolumeContent(w http.ResponseWriter, r *http.Request) {
	sw := &statusWriter{ResponseWriter: w}
	if err := s.volumeContent(sw, r); err != nil {
		writeError(sw, s.log, r, err)
	}
	s.log.Debug("volume content request", "method", r.Method, "path", r.URL.Path, "status", sw.status)
}

func (s *server) volumeContent(w http.ResponseWriter, r *http.Request) error {
	if s.cfg.Volumes == nil {
		return notFound("no route for %s", r.URL.Path)
	}
	id, op, ok := strings.Cut(strings.TrimPrefix(r.URL.Path, volumeContentPrefix), "/")
	if !ok || id == "" || strings.Contains(op, "/") {
		return notFound("no route for %s", r.URL.Path)
	}
	token := ""
	if v := r.Header.Get("Authorization"); len(v) > 7 && strings.EqualFold(v[:7], "bearer ") {
		token = strings.TrimSpace(v[7:])
	}
	if token == "" {
		return &httpError{status: http.StatusUnauthorized, msg: "volume token required (Authorization: Bearer <token>)"}
	}
	vol, err := s.cfg.Volumes.Authorize(r.Context(), id, token)
	if err != nil {
		return err
	}
	q := r.URL.Query()
	path := q.Get("path")
	vm := s.cfg.Volumes
	switch op + " " + r.Method {
	case "dir GET":
		depth, err := intParam(q, "depth")
		if err != nil {
			return err
		}
		d := 1
		if depth != nil {
			d = int(*depth)
		}
		entries, err := vm.ListDir(vol, path, d)
		if err != nil {
			return err
		}
		out := make([]volumeEntryJSON, 0, len(entries))
		for i := range entries {
			out = append(out, toEntryJSON(&entries[i]))
		}
		writeJSON(w, http.StatusOK, out)
	case "dir POST":
		a, force, err := attrParams(q)
		if err != nil {
			return err
		}
		e, err := vm.MakeDir(vol, path, a, force != nil && *force)
		if err != nil {
			return err
		}
		writeJSON(w, http.StatusCreated, toEntryJSON(e))
	case "path GET":
		e, err := vm.Stat(vol, path)
		if err != nil {
			return err
		}
		writeJSON(w, http.StatusOK, toEntryJSON(e))
	case "path PATCH":
		var body struct {
			UID  *uint32 `json:"uid"`
			GID  *uint32 `json:"gid"`
			Mode *uint32 `json:"mode"`
		}
		if err := s.decodeJSON(w, r, &body, false); err != nil {
			return err
		}
		e, err := vm.SetAttrs(vol, path, volume.Attrs{UID: body.UID, GID: body.GID, Mode: body.Mode})
		if err != nil {
			return err
		}
		writeJSON(w, http.StatusOK, toEntryJSON(e))
	case "path DELETE":
		if err := vm.Remove(vol, path); err != nil {
			return err
		}
		w.WriteHeader(http.StatusNoContent)
	case "file GET":
		f, err := vm.Open(vol, path)
		if err != nil {
			return err
		}
		defer f.Close()
		w.Header().Set("Content-Type", "application/octet-stream")
		if fi, err := f.Stat(); err == nil {
			w.Header().Set("Content-Length", strconv.FormatInt(fi.Size(), 10))
		}
		w.WriteHeader(http.StatusOK)
		_, _ = io.Copy(w, f)
	case "file PUT":
		a, force, err := attrParams(q)
		if err != nil {
			return err
		}
		e, err := vm.WriteFile(vol, path, r.Body, a, force)
		if err != nil {
			return err
		}
		writeJSON(w, http.StatusCreated, toEntryJSON(e))
	default:
		switch op {
		case "dir", "path", "file":
			return &httpError{status: http.StatusMethodNotAllowed, msg: "method " + r.Method + " not allowed"}
		}
		return notFound("no route for %s", r.URL.Path)
	}
	return nil
}

func intParam(q map[string][]string, name string) (*uint32, error) {
	vals, ok := q[name]
	if !ok || len(vals) == 0 || vals[0] == "" {
		return nil, nil
	}
	n, err := strconv.ParseUint(vals[0], 10, 32)
	if err != nil {
		return nil, badRequest("invalid %s %q", name, vals[0])
	}
	v := uint32(n)
	return &v, nil
}

func attrParams(q map[string][]string) (volume.Attrs, *bool, error) {
	var a volume.Attrs
	var err error
	if a.UID, err = intParam(q, "uid"); err != nil {
		return a, nil, err
	}
	if a.GID, err = intParam(q, "gid"); err != nil {
		return a, nil, err
	}
	if a.Mode, err = intParam(q, "mode"); err != nil {
		return a, nil, err
	}
	var force *bool
	if vals, ok := q["force"]; ok && len(vals) > 0 && vals[0] != "" {
		b, err := strconv.ParseBool(vals[0])
		if err != nil {
			return a, nil, badRequest("invalid force %q", vals[0])
		}
		force = &b
	}
	return a, force, nil
}
