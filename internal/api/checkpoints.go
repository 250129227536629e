package api

import (
	"context"
	"net/http"
	"time"

	"github.com/ember-sandbox/ember/internal/quota"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// Step checkpoints and rollback (ember's own API; issue 18 item 6):
//
//	POST   /sandboxes/{id}/checkpoints        201 checkpointJSON
//	GET    /sandboxes/{id}/checkpoints        200 [checkpointJSON] (oldest first; the tree by parentID)
//	DELETE /sandboxes/{id}/checkpoints/{cid}  204
//	POST   /sandboxes/{id}/rollback           {"checkpointID"} → 200 the sandbox
//
// and the optional "checkpointID" of POST /sandboxes/{id}/fork and /sandboxes/{id}/snapshots.
// An unknown checkpoint, a deleted one and another sandbox's are 404 with the checkpoint named
// (not E2B's sandbox wording); a malformed id is 400.

// checkpointer is the part of sandbox.Service that keeps step checkpoints (sandbox.Manager
// implements it).
type checkpointer interface {
	Checkpoint(ctx context.Context, id string) (*sandbox.Checkpoint, error)
	ListCheckpoints(ctx context.Context, id string) (*sandbox.CheckpointTree, error)
	DeleteCheckpoint(ctx context.Context, id, cid string) error
	Rollback(ctx context.Context, id, cid string) (*sandbox.Sandbox, error)
	ForkCheckpoint(ctx context.Context, id, cid string, count int, timeout time.Duration) ([]sandbox.ForkResult, error)
	SnapshotCheckpoint(ctx context.Context, id, cid, name string) (*sandbox.Template, error)
}

func (s *server) checkpointRoutes(rt *router) {
	rt.handle(http.MethodPost, "/sandboxes/{id}/checkpoints", s.createCheckpoint)
	rt.handle(http.MethodGet, "/sandboxes/{id}/checkpoints", s.listCheckpoints)
	rt.handle(http.MethodDelete, "/sandboxes/{id}/checkpoints/{cid}", s.deleteCheckpoint)
	rt.handle(http.MethodPost, "/sandboxes/{id}/rollback", s.rollback)
}

// checkpointJSON is one checkpoint on the wire.
type checkpointJSON struct {
	CheckpointID string    `json:"checkpointID"`
	ParentID     *string   `json:"parentID"` // null for a root of the tree
	CreatedAt    time.Time `json:"createdAt"`
	// Current: the sandbox was last taken at or rolled back to it (the parent of its next).
	Current bool `json:"current"`
	// Standby: an instance restored from it waits frozen: a rollback to it is a swap.
	Standby bool `json:"standby"`
	// StoppedMs: how long the sandbox's processes were stopped for it; TookMs: the whole
	// checkpoint.
	StoppedMs float64 `json:"stoppedMs"`
	TookMs    float64 `json:"tookMs"`
}

func toCheckpoint(c *sandbox.Checkpoint, head string) checkpointJSON {
	out := checkpointJSON{CheckpointID: c.ID, CreatedAt: c.CreatedAt, Current: c.ID == head,
		StoppedMs: float64(c.Stopped.Microseconds()) / 1000, TookMs: float64(c.Took.Microseconds()) / 1000}
	if c.ParentID != "" {
		p := c.ParentID
		out.ParentID = &p
	}
	return out
}

// checkpoints returns the Service's checkpointer, or the 501 a server without one answers.
func (s *server) checkpoints() (checkpointer, error) {
	c, ok := s.node.(checkpointer)
	if !ok {
		return nil, &httpError{status: http.StatusNotImplemented, msg: "step checkpoints are not supported by this server"}
	}
	return c, nil
}

// checkpointIDParam validates a checkpoint id from the path or a body (400 when malformed).
func checkpointIDParam(cid string) (string, error) {
	if cid == "" {
		return "", badRequest("checkpointID is required")
	}
	if !sandbox.CheckpointIDRe.MatchString(cid) {
		return "", badRequest("invalid checkpointID %s", quoteID(cid))
	}
	return cid, nil
}

func (s *server) createCheckpoint(w http.ResponseWriter, r *http.Request, p params) error {
	id, err := sandboxIDParam(p)
	if err != nil {
		return err
	}
	var req struct{}
	if err := s.decodeJSON(w, r, &req, false); err != nil {
		return err
	}
	cp, err := s.checkpoints()
	if err != nil {
		return err
	}
	c, err := cp.Checkpoint(r.Context(), id)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, toCheckpoint(c, c.ID))
	return nil
}

func (s *server) listCheckpoints(w http.ResponseWriter, r *http.Request, p params) error {
	id, err := sandboxIDParam(p)
	if err != nil {
		return err
	}
	cp, err := s.checkpoints()
	if err != nil {
		return err
	}
	tree, err := cp.ListCheckpoints(r.Context(), id)
	if err != nil {
		return err
	}
	out := make([]checkpointJSON, 0, len(tree.Checkpoints))
	for _, c := range tree.Checkpoints {
		j := toCheckpoint(c, tree.Head)
		j.Standby = c.ID == tree.Standby
		out = append(out, j)
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

func (s *server) deleteCheckpoint(w http.ResponseWriter, r *http.Request, p params) error {
	id, err := sandboxIDParam(p)
	if err != nil {
		return err
	}
	cid, err := checkpointIDParam(p["cid"])
	if err != nil {
		return err
	}
	cp, err := s.checkpoints()
	if err != nil {
		return err
	}
	if err := cp.DeleteCheckpoint(r.Context(), id, cid); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (s *server) rollback(w http.ResponseWriter, r *http.Request, p params) error {
	id, err := sandboxIDParam(p)
	if err != nil {
		return err
	}
	var req struct {
		CheckpointID string `json:"checkpointID"`
	}
	if err := s.decodeJSON(w, r, &req, true); err != nil {
		return err
	}
	cid, err := checkpointIDParam(req.CheckpointID)
	if err != nil {
		return err
	}
	cp, err := s.checkpoints()
	if err != nil {
		return err
	}
	// A paused sandbox rolled back runs again: within the team's quota (quotas.go).
	release, err := s.admit(r.Context(), scoped{Service: s.shared, s: s}.resumeUsage(r.Context(), id))
	if err != nil {
		return err
	}
	defer release()
	sb, err := cp.Rollback(r.Context(), id, cid)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, s.toSandbox(sb))
	return nil
}

// forkCheckpoint is POST /sandboxes/{id}/fork with a checkpointID.
func (s *server) forkCheckpoint(r *http.Request, id, rawCID string, count int, timeout time.Duration) ([]sandbox.ForkResult, error) {
	cid, err := checkpointIDParam(rawCID)
	if err != nil {
		return nil, err
	}
	cp, err := s.checkpoints()
	if err != nil {
		return nil, err
	}
	var more quota.Usage
	if sb, err := s.node.Get(r.Context(), id); err == nil {
		more = running(count, sb.CPUCount, sb.MemoryMB) // as a fork of the sandbox now (quotas.go)
	}
	release, err := s.admit(r.Context(), more)
	if err != nil {
		return nil, err
	}
	defer release()
	return cp.ForkCheckpoint(r.Context(), id, cid, count, timeout)
}

// snapshotCheckpoint is POST /sandboxes/{id}/snapshots with a checkpointID.
func (s *server) snapshotCheckpoint(r *http.Request, id, rawCID, name string) (*sandbox.Template, error) {
	cid, err := checkpointIDParam(rawCID)
	if err != nil {
		return nil, err
	}
	cp, err := s.checkpoints()
	if err != nil {
		return nil, err
	}
	var more quota.Usage
	if sb, err := s.node.Get(r.Context(), id); err == nil {
		more.TemplateDiskMB = s.quotas.TemplateDisk(sb.DiskSizeMB) // as a snapshot now (quotas.go)
	}
	release, err := s.admit(r.Context(), more)
	if err != nil {
		return nil, err
	}
	defer release()
	return cp.SnapshotCheckpoint(r.Context(), id, cid, name)
}
