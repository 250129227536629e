package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/ember-sandbox/ember/internal/datadir"
	"github.com/ember-sandbox/ember/internal/errdefs"
)

// A named snapshot answers once its capture (checkpoint and layer clone) is on the node, in
// <DataDir>/images/<id>, recorded with SnapshotState uploading. Chunking and upload into the
// image store then run here, in the background: the snapshot serves creates on this node from
// the capture meanwhile, and once the store holds it the capture becomes the store's verified
// node-local copy (Adopt) and the record says stored. A crash or a shutdown leaves the record
// uploading and the capture in place: the next start resumes the upload (the store skips the
// chunks it already has). Deleting the snapshot cancels its upload and waits for it to stop
// before anything is removed.

// upload is one snapshot upload in flight.
type upload struct {
	cancel  context.CancelFunc
	done    chan struct{}
	deleted bool // cancelled by DeleteTemplate; guarded by Manager.mu
}

// errDeleted is the cause of an upload cancelled because its snapshot was deleted.
var errDeleted = errors.New("snapshot deleted")

// startUpload uploads snapshot id's capture in image in the background. resumed says it is an
// upload an earlier run of the daemon began.
func (m *Manager) startUpload(id, image string, resumed bool) {
	m.mu.Lock()
	if _, ok := m.uploads[id]; ok {
		m.mu.Unlock()
		return
	}
	ctx, cancel := context.WithCancelCause(m.bg)
	u := &upload{cancel: func() { cancel(errDeleted) }, done: make(chan struct{})}
	m.uploads[id] = u
	m.wg.Add(1)
	m.mu.Unlock()
	go func() {
		defer m.wg.Done()
		defer close(u.done)
		defer cancel(nil)
		m.upload(ctx, id, image, resumed)
		m.mu.Lock()
		delete(m.uploads, id)
		m.mu.Unlock()
		m.maybeCollect()
	}()
}

// cancelUpload stops snapshot id's upload, if one runs, and waits until it has stopped.
func (m *Manager) cancelUpload(id string) {
	m.mu.Lock()
	u := m.uploads[id]
	if u != nil {
		u.deleted = true
	}
	m.mu.Unlock()
	if u == nil {
		return
	}
	u.cancel()
	<-u.done
}

// upload saves the capture into the image store (retrying a failed attempt) and records the
// outcome. Cancelled by a delete or a shutdown, it records nothing.
func (m *Manager) upload(ctx context.Context, id, image string, resumed bool) {
	log := m.log.With("snapshot", id)
	start := time.Now()
	delay := m.cfg.UploadRetryDelay
	var err error
	for attempt := 1; ; attempt++ {
		err = m.uploadOnce(ctx, id, image, resumed || attempt > 1)
		if err == nil || ctx.Err() != nil || attempt >= m.cfg.UploadAttempts {
			break
		}
		log.Warn("snapshot upload failed; retrying", "attempt", attempt, "retry_in", delay, "err", err)
		select {
		case <-ctx.Done():
		case <-time.After(delay):
		}
		delay *= 2
	}
	if ctx.Err() != nil {
		// Deleted: DeleteTemplate removes what is left. Shutting down: the record stays
		// uploading and the next start resumes it.
		log.Info("snapshot upload stopped", "why", context.Cause(ctx), "after_ms", time.Since(start).Milliseconds())
		return
	}
	m.observe(StageSnapshotUpload, start, err)
	// Written even if a delete comes now: DeleteTemplate waits for this goroutine before it
	// reads and removes the record.
	rctx := context.WithoutCancel(ctx)
	tpl, gerr := m.cfg.Store.GetTemplate(rctx, id)
	if gerr != nil {
		log.Warn("snapshot upload: record gone", "err", gerr)
		return
	}
	if err == nil {
		tpl.SnapshotStored, tpl.SnapshotState, tpl.SnapshotError = true, SnapshotStoredState, ""
	} else {
		tpl.SnapshotState, tpl.SnapshotError = SnapshotFailed, err.Error()
	}
	if perr := m.cfg.Store.PutTemplate(rctx, tpl); perr != nil {
		log.Error("snapshot upload: record outcome", "err", perr)
		return
	}
	if err != nil {
		log.Error("snapshot upload failed; the snapshot serves this node only", "err", err)
		return
	}
	log.Info("snapshot stored", "ms", time.Since(start).Milliseconds(), "resumed", resumed)
	m.templateReady(tpl)
}

// uploadOnce is one attempt. A manifest already stored under id is this snapshot's own when
// the upload is resumed (an earlier attempt or run wrote it last, then stopped), and a stale
// one (a delete that could not remove it) otherwise.
func (m *Manager) uploadOnce(ctx context.Context, id, image string, resumed bool) error {
	if err := m.faults.hit("upload"); err != nil {
		return err
	}
	if fi, err := os.Stat(image); err != nil || !fi.IsDir() {
		return fmt.Errorf("the node-local capture %s is missing: %w", image, errdefs.ErrNotFound)
	}
	stored, err := m.cfg.Images.Exists(ctx, id)
	if err != nil {
		return err
	}
	if stored && !resumed {
		m.log.Warn("snapshot upload: removing a stale stored image of the same name", "snapshot", id)
		if err := m.cfg.Images.Delete(ctx, id); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
			return err
		}
		stored = false
	}
	if !stored {
		if err := m.saveImage(ctx, id, image); err != nil {
			return err
		}
	}
	return m.cfg.Images.Adopt(ctx, id, image)
}

// resumeUploads restarts, at start-up, the uploads an earlier run left unfinished, from their
// node-local captures. A snapshot whose capture is gone cannot be uploaded: it is failed.
func (m *Manager) resumeUploads(ctx context.Context, tpls []*Template) error {
	for _, t := range tpls {
		if t.Kind != "snapshot" || t.SnapshotState != SnapshotUploading {
			continue
		}
		if m.cfg.Images == nil {
			t.SnapshotState = SnapshotLocal
		} else if fi, err := os.Stat(t.Image); err != nil || !fi.IsDir() {
			t.SnapshotState, t.SnapshotError = SnapshotFailed, "the node-local capture was lost before the upload finished"
		} else {
			m.log.Info("reconcile: resuming snapshot upload", "snapshot", t.ID)
			m.startUpload(t.ID, t.Image, true)
			continue
		}
		m.log.Warn("reconcile: snapshot upload cannot resume", "snapshot", t.ID, "state", t.SnapshotState, "why", t.SnapshotError)
		if err := m.cfg.Store.PutTemplate(ctx, t); err != nil {
			return err
		}
	}
	return nil
}

// snapshotCaptures are the names in <DataDir>/images that a snapshot record owns.
func snapshotCaptures(dataDir string, tpls []*Template) map[string]bool {
	own := map[string]bool{}
	for _, t := range tpls {
		if t.Kind == "snapshot" && filepath.Dir(t.Image) == datadir.Images(dataDir) {
			own[filepath.Base(t.Image)] = true
		}
	}
	return own
}

// deleteStored removes snapshot id from the image store, with whatever an upload cut short
// left there: the chunks no snapshot uses are collected in the background once no upload runs
// (collecting excludes every save and load of the store while it runs).
func (m *Manager) deleteStored(ctx context.Context, id string) {
	if err := m.cfg.Images.Delete(ctx, id); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
		m.log.Warn("delete stored snapshot", "snapshot", id, "err", err)
	}
	m.mu.Lock()
	m.collectDue = true
	m.mu.Unlock()
	m.maybeCollect()
}

// maybeCollect collects unused chunks if a delete asked for it and no upload runs.
func (m *Manager) maybeCollect() {
	m.mu.Lock()
	due := m.collectDue && len(m.uploads) == 0
	if due {
		m.collectDue = false
	}
	m.mu.Unlock()
	if !due {
		return
	}
	m.goBG(func() {
		if err := m.cfg.Images.Collect(m.bg); err != nil && m.bg.Err() == nil {
			m.log.Warn("collect unused snapshot chunks", "err", err)
		}
	})
}

// goBG runs f as background work that Close waits for, unless Close has begun.
func (m *Manager) goBG(f func()) {
	m.opMu.RLock()
	defer m.opMu.RUnlock()
	if m.closing {
		return
	}
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		f()
	}()
}
