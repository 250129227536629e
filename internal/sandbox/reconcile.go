package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/datadir"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/overlayfs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

// reconcile makes the in-memory state match the store, and the node match the store, at
// start-up. It is total: every instance the driver knows is either adopted (it belongs to a
// running sandbox whose layer is intact) or killed and deleted; a directory is removed only
// after the instance that used it is gone; pool instances and template warm-ups of an earlier
// run (which have no record) are discarded; mounts, network slots and firewall elements that
// nothing owns are removed. It logs one line per thing adopted or removed.
func (m *Manager) reconcile(ctx context.Context) error {
	sbs, err := m.cfg.Store.ListSandboxes(ctx)
	if err != nil {
		return err
	}
	ids, err := m.cfg.Driver.List(ctx)
	if err != nil {
		return fmt.Errorf("list instances: %w", err)
	}
	known := map[string]bool{}
	for _, id := range ids {
		known[id] = true
	}
	var keepSlots []int
	adopted := map[string]bool{}  // instance ids
	keepDirs := map[string]bool{} // sandbox ids whose directory stays
	keepRun := map[string]bool{}  // instance state dirs that stay
	var watch []*entry
	var hot []*entry              // paused in memory: watched, their state to disk if not there yet
	cutPause := map[*entry]bool{} // of those, recorded running (a pause the crash cut)
	// adoptInstance keeps sb's instance, slot and directories.
	adoptInstance := func(sb *Sandbox) {
		keepSlots = append(keepSlots, sb.Runtime.SlotIndex)
		m.instances[sb.Runtime.InstanceID] = true
		adopted[sb.Runtime.InstanceID] = true
		keepDirs[sb.ID] = true
		keepRun[sb.Runtime.StateDir] = true
	}
	for _, sb := range sbs {
		log := m.logger(sb.ID)
		if sb.State == StatePaused && sb.Runtime.InstanceID != "" {
			// Paused in memory: its frozen instance is adopted as it is, or (gone) the
			// sandbox is paused on disk if its state reached it.
			why := m.adoptable(ctx, sb, known)
			if why == "" {
				if _, err := m.cfg.Network.Adopt(sb.Runtime.SlotIndex, sb.Egress()); err != nil {
					why = "its network slot is gone: " + err.Error()
				}
			}
			if why == "" {
				e, err := m.adoptHot(ctx, sb, m.frozen(ctx, sb.Runtime.InstanceID))
				if err == nil {
					adoptInstance(sb)
					m.live[sb.ID] = e
					hot = append(hot, e)
					log.Info("reconcile: adopted sandbox paused in memory", "instance", sb.Runtime.InstanceID, "on_disk", sb.Runtime.Image != "")
					continue
				}
				why = "freeze: " + err.Error()
			}
			image := ""
			for _, img := range []string{sb.Runtime.Image, sb.Runtime.HotImage} {
				if img != "" && imageComplete(img) {
					image = img
					break
				}
			}
			if image == "" {
				log.Warn("reconcile: sandbox paused in memory lost its instance before its state reached the disk; it ended", "why", why)
				m.tombstone(ctx, sb, "lost: its instance stopped while paused")
				continue
			}
			sb.Runtime, sb.PausedIn = Placement{Image: image, SlotIndex: noSlot}, TierDisk
			if err := m.cfg.Store.PutSandbox(ctx, sb); err != nil {
				return err
			}
			keepDirs[sb.ID] = true
			m.live[sb.ID] = &entry{sb: sb}
			log.Info("reconcile: sandbox paused in memory lost its instance; paused on disk", "why", why, "image", image)
			continue
		}
		switch sb.State {
		case StateRunning:
			why := m.adoptable(ctx, sb, known)
			if why == "" {
				if _, err := m.cfg.Network.Adopt(sb.Runtime.SlotIndex, sb.Egress()); err != nil {
					why = "its network slot is gone: " + err.Error()
				}
			}
			_, perr := os.Stat(filepath.Join(m.sandboxDir(sb.ID), pausingName))
			pausing := perr == nil
			os.Remove(filepath.Join(m.sandboxDir(sb.ID), pausingName))
			if why == "" && !pausing && m.frozen(ctx, sb.Runtime.InstanceID) {
				// Frozen by a snapshot's or fork's checkpoint that the crash cut: it runs on.
				if err := m.cfg.Driver.Thaw(ctx, sb.Runtime.InstanceID); err != nil {
					why = "thaw after a cut checkpoint: " + err.Error()
				} else {
					log.Info("reconcile: thawed a sandbox a cut checkpoint had left frozen", "instance", sb.Runtime.InstanceID)
				}
			}
			if why == "" && m.frozen(ctx, sb.Runtime.InstanceID) {
				// A hot pause the crash cut after the freeze: the sandbox is paused in memory.
				e, err := m.adoptHot(ctx, sb, true)
				if err != nil {
					return err
				}
				adoptInstance(sb)
				m.live[sb.ID] = e
				hot = append(hot, e)
				cutPause[e] = true
				log.Info("reconcile: a pause cut by the crash had frozen the sandbox; it is paused in memory", "instance", sb.Runtime.InstanceID)
				continue
			}
			if why == "" {
				keepSlots = append(keepSlots, sb.Runtime.SlotIndex)
				m.instances[sb.Runtime.InstanceID] = true
				adopted[sb.Runtime.InstanceID] = true
				keepDirs[sb.ID] = true
				keepRun[sb.Runtime.StateDir] = true
				e := &entry{sb: sb}
				m.live[sb.ID] = e
				m.guestT.open(sb.Runtime.GuestIP, sb.Runtime.InstanceID, true)
				watch = append(watch, e)
				log.Info("reconcile: adopted running sandbox", "instance", sb.Runtime.InstanceID)
				continue
			}
			// A pause whose image was complete when the daemon died before recording it: the
			// sandbox is paused.
			if image, filesOnly := completePauseImage(m.sandboxDir(sb.ID)); image != "" {
				sb.State, sb.PausedFilesOnly = StatePaused, filesOnly
				sb.Runtime = Placement{Image: image, SlotIndex: noSlot}
				if err := m.cfg.Store.PutSandbox(ctx, sb); err != nil {
					return err
				}
				keepDirs[sb.ID] = true
				e := &entry{sb: sb}
				m.live[sb.ID] = e
				m.emitLocked(ctx, e, EventPaused, "")
				log.Info("reconcile: a pause cut by the crash had completed; the sandbox is paused", "image", image)
				continue
			}
			// Its instance (if any) is deleted with the orphans below, before its directory.
			log.Warn("reconcile: running sandbox cannot be adopted; it ended", "instance", sb.Runtime.InstanceID, "why", why)
			m.tombstone(ctx, sb, EndLost)
		case StatePaused:
			if _, err := os.Stat(filepath.Join(sb.Runtime.Image)); sb.Runtime.Image == "" || err != nil {
				log.Warn("reconcile: paused sandbox lost its image; it ended", "image", sb.Runtime.Image)
				m.tombstone(ctx, sb, "lost: its pause image is missing")
				continue
			}
			keepDirs[sb.ID] = true
			m.live[sb.ID] = &entry{sb: sb}
			log.Info("reconcile: kept paused sandbox")
		case StateKilled:
			if time.Since(sb.EndedAt) > m.cfg.TombstoneTTL {
				m.cfg.Store.DeleteSandbox(ctx, sb.ID)
				continue
			}
			m.live[sb.ID] = &entry{sb: sb}
		default:
			log.Warn("reconcile: unknown state; forgetting", "state", sb.State)
			m.cfg.Store.DeleteSandbox(ctx, sb.ID)
		}
	}
	// Instances first (and launches an earlier run left in flight): nothing below may remove
	// a directory an instance still uses.
	keep := make([]string, 0, len(adopted))
	for id := range adopted {
		keep = append(keep, id)
	}
	removed, err := m.cfg.Driver.Sweep(ctx, keep)
	for _, id := range removed {
		m.log.Info("reconcile: removed orphan instance", "instance", id)
	}
	if err != nil {
		return fmt.Errorf("remove orphan instances: %w", err)
	}
	if err := m.cfg.Network.Reconcile(ctx, keepSlots); err != nil {
		return fmt.Errorf("network: %w", err)
	}
	// Directories: whole sandbox directories nobody owns, and inside kept ones every instance
	// directory but the adopted instance's (a pause or resume interrupted by a crash).
	root := datadir.Sandboxes(m.cfg.DataDir)
	entries, _ := os.ReadDir(root)
	for _, d := range entries {
		dir := filepath.Join(root, d.Name())
		runs, _ := filepath.Glob(filepath.Join(dir, "run-*"))
		for _, r := range runs {
			if !keepRun[r] {
				// Its instance is gone (swept above): the driver releases what is left (a
				// layer taken from a pause image by a resume the crash cut goes back to it).
				if err := m.cfg.Driver.Release(ctx, r); err != nil {
					return fmt.Errorf("release %s: %w", r, err)
				}
				m.log.Info("reconcile: removed stale instance directory", "dir", r)
				overlayfs.RemoveTree(r, overlayfs.DetachMounts)
			}
		}
		if !keepDirs[d.Name()] {
			m.log.Info("reconcile: removed orphan directory", "dir", dir)
			overlayfs.RemoveTree(dir, overlayfs.DetachMounts)
			continue
		}
		// Pause images but the one a paused sandbox resumes from (a resume recorded before
		// its image was removed, or an earlier pause).
		keepImage := ""
		if e := m.live[d.Name()]; e != nil && e.sb.State == StatePaused {
			keepImage = e.sb.Runtime.Image
		}
		images, _ := filepath.Glob(filepath.Join(dir, "image-*"))
		for _, img := range images {
			if img != keepImage {
				m.log.Info("reconcile: removed stale pause image", "image", img)
				overlayfs.RemoveTree(img, overlayfs.DetachMounts)
			}
		}
		// Stage directories of exports and imports interrupted by a crash.
		stages, _ := filepath.Glob(filepath.Join(dir, ".*"))
		for _, s := range stages {
			if filepath.Base(s) == tokenSwapName {
				continue // undone below (snaptoken.go)
			}
			overlayfs.RemoveTree(s, overlayfs.DetachMounts)
		}
	}
	// Leftovers of earlier layouts and of work a crash interrupted.
	for _, dir := range []string{datadir.Pool(m.cfg.DataDir)} {
		if _, err := os.Stat(dir); err == nil {
			m.log.Info("reconcile: removed orphan directory", "dir", dir)
			overlayfs.RemoveTree(dir, overlayfs.DetachMounts)
		}
	}
	uploads, _ := filepath.Glob(filepath.Join(m.importDir(), ".upload-*"))
	for _, u := range uploads {
		m.log.Info("reconcile: removed unfinished upload", "file", u)
		os.Remove(u)
	}
	builds, _ := filepath.Glob(filepath.Join(datadir.Templates(m.cfg.DataDir), "*", "build-*"))
	for _, b := range builds {
		m.log.Info("reconcile: removed orphan directory", "dir", b)
		overlayfs.RemoveTree(b, overlayfs.DetachMounts)
	}
	// Fork images, export stages, and snapshot captures whose record was never written.
	tpls, err := m.cfg.Store.ListTemplates(ctx)
	if err != nil {
		return err
	}
	captures := snapshotCaptures(m.cfg.DataDir, tpls)
	imgs, _ := os.ReadDir(datadir.Images(m.cfg.DataDir))
	for _, e := range imgs {
		if strings.HasPrefix(e.Name(), "fork-") || strings.HasPrefix(e.Name(), ".") || !captures[e.Name()] {
			m.log.Info("reconcile: removed unfinished image", "image", e.Name())
			overlayfs.RemoveTree(datadir.Image(m.cfg.DataDir, e.Name()), overlayfs.DetachMounts)
		}
	}
	if err := m.resumeUploads(ctx, tpls); err != nil {
		return err
	}
	if err := m.unmountOrphans(keepRun); err != nil {
		return err
	}
	for _, e := range watch {
		// A snapshot's token swap the crash cut: envd gets the sandbox's own token back
		// before anyone is told the sandbox runs (snaptoken.go).
		m.reconcileTokenSwap(ctx, e.sb)
		m.watch(e, e.sb.Runtime.InstanceID)
		m.emitLocked(ctx, e, EventStarted, StartAdopted)
	}
	for _, e := range hot {
		m.watch(e, e.hot.inst)
		if cutPause[e] {
			m.emitLocked(ctx, e, EventPaused, "")
		}
		select {
		case <-e.hot.done:
		default:
			m.checkpointInBackground(e, e.hot)
		}
	}
	return nil
}

// frozen reports whether instance inst is frozen.
func (m *Manager) frozen(ctx context.Context, inst string) bool {
	st, err := m.cfg.Driver.State(ctx, inst)
	return err == nil && st.Frozen
}

// adoptable says why a running sandbox's record cannot be adopted ("" = it can): its instance
// must run, and its layer must be intact (state directory present and its root mounted).
func (m *Manager) adoptable(ctx context.Context, sb *Sandbox, known map[string]bool) string {
	inst := sb.Runtime.InstanceID
	if inst == "" || !known[inst] {
		return "its instance is gone"
	}
	st, err := m.cfg.Driver.State(ctx, inst)
	if err != nil {
		if errors.Is(err, errdefs.ErrNotFound) {
			return "its instance is gone"
		}
		return "instance state: " + err.Error()
	}
	if st.State != runtime.StateRunning {
		return "its instance stopped"
	}
	if sb.Runtime.StateDir == "" {
		return "no instance directory recorded"
	}
	if fi, err := os.Stat(sb.Runtime.StateDir); err != nil || !fi.IsDir() {
		return "its instance directory is missing"
	}
	return ""
}

// completeName marks a pause image that Checkpoint finished ("files" for a filesystem-only one).
const completeName = ".ember-complete"

// markComplete marks image complete. It is written, not synced: it guards against a crash of
// the daemon, which keeps the page cache; against a power loss a sync of the marker alone would
// guarantee nothing, as runsc's memory image is not synced either.
func markComplete(image string, filesOnly bool) error {
	content := "memory"
	if filesOnly {
		content = "files"
	}
	return os.WriteFile(filepath.Join(image, completeName), []byte(content), 0o600)
}

// completePauseImage finds the newest complete pause image in a sandbox directory.
func completePauseImage(dir string) (image string, filesOnly bool) {
	marks, _ := filepath.Glob(filepath.Join(dir, "image-*", completeName))
	var newest time.Time
	for _, mk := range marks {
		fi, err := os.Stat(mk)
		if err != nil || fi.ModTime().Before(newest) {
			continue
		}
		b, _ := os.ReadFile(mk)
		newest, image, filesOnly = fi.ModTime(), filepath.Dir(mk), string(b) == "files"
	}
	return image, filesOnly
}

// tombstone records that sb ended (at start-up, with nothing left to release but what the
// orphan sweeps remove).
func (m *Manager) tombstone(ctx context.Context, sb *Sandbox, reason string) {
	sb.State = StateKilled
	sb.EndReason = reason
	sb.EndedAt = time.Now().UTC()
	sb.Runtime = Placement{SlotIndex: noSlot}
	if err := m.cfg.Store.PutSandbox(ctx, sb); err != nil {
		m.logger(sb.ID).Warn("record end", "err", err)
	}
	e := &entry{sb: sb}
	m.live[sb.ID] = e
	m.emitLocked(ctx, e, EventEnded, reason)
}

// unmountOrphans unmounts every mount under the data directory that no adopted instance owns.
func (m *Manager) unmountOrphans(keepRun map[string]bool) error {
	points := overlayfs.MountsUnder(m.cfg.DataDir)
	for i := len(points) - 1; i >= 0; i-- {
		p := points[i]
		owned := false
		for dir := range keepRun {
			if strings.HasPrefix(p, dir+"/") {
				owned = true
			}
		}
		// runsc keeps a namespace bind mount in its root for its own use.
		if owned || strings.HasPrefix(p, datadir.Runsc(m.cfg.DataDir)+"/") {
			continue
		}
		if err := unix.Unmount(p, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("unmount orphan %s: %w", p, err)
		}
		m.log.Info("reconcile: unmounted orphan mount", "mount", p)
	}
	return nil
}
