package sandbox

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/overlayfs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

// Portable templates: a template built on one node, moved to another through the image store.
//
// A template is its stack of read-only layers (its own top layer, then its image's layers) and
// its checkpoint image, which restores only onto that exact stack. Host paths differ between
// nodes, so layers are named by their identity instead (LayerIdentity): the layer's path
// beneath the data directory of the node that made it. Those names are content names:
// image layers live at layers/sha256-<diff id>/root, step layers at layers/<step key>/...,
// a template's top layer at templates/<name>/rootfs-<build id>. A node that does not have a
// layer loads it from the store into <data-dir>/remote/<identity, base64url>/, verified, and
// the driver maps that path back to the same identity (so a checkpoint taken on the origin
// restores here). Checkpoint images record their stack by identity (runtime/gvisor).

// TreePorter is a Driver that moves read-only layers between nodes (runtime/gvisor).
type TreePorter interface {
	// ExportTree writes layer directory dir as an archive into the new file dst.
	ExportTree(ctx context.Context, dir, dst string) error
	// ImportTree unpacks archive src (untrusted) into the new directory dir and returns where
	// the layer's files are.
	ImportTree(ctx context.Context, src, dir string, opts runtime.ImportOptions) (string, error)
}

// PortableTemplate is a template as another node loads it: its record with every host path
// replaced by a layer identity (RootFS, Lowers) or a store id (Image).
type PortableTemplate struct {
	Template Template `json:"template"`
	// ImageID is the store id of the checkpoint image.
	ImageID string `json:"imageID"`
}

const (
	remoteDir   = "remote"
	treeArchive = "tree.tar"
)

// LayerIdentity returns the layer naming of a node whose data directory is dataDir (for the
// driver's Config.LayerIdentity): a path beneath dataDir is named by its relative path, a layer
// loaded from another node by the identity it had there; anything else (an identity already)
// is its own name.
func LayerIdentity(dataDir string) func(string) string {
	remote := filepath.Join(dataDir, remoteDir) + string(os.PathSeparator)
	return func(p string) string {
		if !filepath.IsAbs(p) {
			return p
		}
		if rest, ok := strings.CutPrefix(p, remote); ok {
			enc, _, _ := strings.Cut(rest, string(os.PathSeparator))
			if b, err := base64.RawURLEncoding.DecodeString(enc); err == nil {
				return string(b)
			}
		}
		if rel, err := filepath.Rel(dataDir, p); err == nil && rel != "." && !strings.HasPrefix(rel, "..") {
			return filepath.ToSlash(rel)
		}
		return p
	}
}

// layerStoreID is the store id of the layer named ident.
func layerStoreID(ident string) string {
	h := sha256.Sum256([]byte(ident))
	return "layer-" + hex.EncodeToString(h[:16])
}

func (m *Manager) porter() (TreePorter, error) {
	tp, ok := m.cfg.Driver.(TreePorter)
	if !ok || m.cfg.Images == nil {
		return nil, fmt.Errorf("templates cannot move between nodes without an image store and a driver that exports layers: %w", errdefs.ErrUnavailable)
	}
	return tp, nil
}

// ExportTemplate puts template (or snapshot) id into the image store (the layers the store
// does not have yet, and its checkpoint image) and returns it as another node loads it.
func (m *Manager) ExportTemplate(ctx context.Context, id string) (*PortableTemplate, error) {
	tp, err := m.porter()
	if err != nil {
		return nil, err
	}
	tpl, err := m.cfg.Store.GetTemplate(ctx, id)
	if err != nil {
		return nil, err
	}
	if !tpl.Ready || tpl.Image == "" {
		return nil, fmt.Errorf("template %q is not ready: %w", id, errdefs.ErrConflict)
	}
	ident := LayerIdentity(m.cfg.DataDir)
	out := &PortableTemplate{Template: *tpl}
	out.Template.Lowers = nil
	for i, dir := range append([]string{tpl.RootFS}, tpl.Lowers...) {
		name := ident(dir)
		if filepath.IsAbs(name) {
			return nil, fmt.Errorf("template %q: layer %s is outside the data directory: %w", id, dir, errdefs.ErrInvalid)
		}
		if err := m.exportLayer(ctx, tp, name, dir); err != nil {
			return nil, fmt.Errorf("template %q: export layer %s: %w", id, name, err)
		}
		if i == 0 {
			out.Template.RootFS = name
		} else {
			out.Template.Lowers = append(out.Template.Lowers, name)
		}
	}
	switch {
	case tpl.Kind == "snapshot" && tpl.SnapshotStored:
		out.ImageID = tpl.ID // uploaded by the snapshot itself (snapupload.go)
	case tpl.Kind == "snapshot":
		return nil, fmt.Errorf("snapshot %q is not stored yet (%s): %w", id, tpl.UploadState(), errdefs.ErrConflict)
	default:
		h := sha256.Sum256([]byte(tpl.ID + "\x00" + tpl.BuildID + "\x00" + ident(tpl.Image)))
		out.ImageID = "tplimage-" + hex.EncodeToString(h[:16])
		stored, err := m.cfg.Images.Exists(ctx, out.ImageID)
		if err != nil {
			return nil, err
		}
		if !stored {
			if err := m.saveImage(ctx, out.ImageID, tpl.Image); err != nil {
				return nil, fmt.Errorf("template %q: export image: %w", id, err)
			}
		}
	}
	out.Template.Image, out.Template.LoadedFrom = "", ""
	out.Template.SnapshotState, out.Template.SnapshotError = "", ""
	return out, nil
}

// exportLayer stores layer dir under its identity's store id, unless the store has it.
func (m *Manager) exportLayer(ctx context.Context, tp TreePorter, name, dir string) error {
	sid := layerStoreID(name)
	if ok, err := m.cfg.Images.Exists(ctx, sid); err != nil || ok {
		return err
	}
	if err := os.MkdirAll(filepath.Join(m.cfg.DataDir, remoteDir), 0o700); err != nil {
		return err
	}
	stage, err := os.MkdirTemp(filepath.Join(m.cfg.DataDir, remoteDir), ".export-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(stage)
	if err := tp.ExportTree(ctx, dir, filepath.Join(stage, treeArchive)); err != nil {
		return err
	}
	return m.cfg.Images.Save(ctx, sid, stage)
}

// ImportTemplate makes the template p describes one of this node's, loading from the image
// store (verified) the layers this node does not have and its checkpoint image. A local
// template of the same name and build is kept as it is; one of another build is replaced (as a
// rebuild replaces it: sandboxes running on the old build keep their layers).
func (m *Manager) ImportTemplate(ctx context.Context, p *PortableTemplate) (*Template, error) {
	tp, err := m.porter()
	if err != nil {
		return nil, err
	}
	id := p.Template.ID
	if !nameRe.MatchString(id) {
		return nil, fmt.Errorf("template %q: %w", id, errdefs.ErrInvalid)
	}
	if old, err := m.cfg.Store.GetTemplate(ctx, id); err == nil && old.BuildID == p.Template.BuildID && old.Ready {
		return old, nil
	}
	release, err := m.reserveName(id, true)
	if err != nil {
		return nil, err
	}
	defer release()
	ended := m.buildStarted() // no layer collection while layers arrive
	defer ended()
	tpl := p.Template
	max := int64(4*(orDefault(tpl.DiskMB, m.cfg.DiskMB)+orDefault(tpl.MemoryMB, m.cfg.MemoryMB))) << 20
	var stack []string
	for _, name := range append([]string{tpl.RootFS}, tpl.Lowers...) {
		dir, err := m.importLayer(ctx, tp, name, 4<<30)
		if err != nil {
			return nil, fmt.Errorf("template %q: load layer %s: %w", id, name, err)
		}
		stack = append(stack, dir)
	}
	tpl.RootFS, tpl.Lowers = stack[0], stack[1:]
	if len(tpl.Lowers) == 0 {
		tpl.Lowers = nil
	}
	image := filepath.Join(m.cfg.DataDir, remoteDir, "images", p.ImageID)
	if err := os.MkdirAll(filepath.Dir(image), 0o700); err != nil {
		return nil, err
	}
	err = m.cfg.Images.Fetch(ctx, p.ImageID, image, func(ctx context.Context, src, dst string) error {
		return m.cfg.Driver.ImportImage(ctx, src, dst, runtime.ImportOptions{MaxBytes: max})
	})
	if err != nil {
		return nil, fmt.Errorf("template %q: load image: %w", id, err)
	}
	tpl.Image, tpl.Ready, tpl.LoadedFrom = image, true, p.ImageID
	if tpl.Kind == "snapshot" {
		// The node-local copy of the stored snapshot: creates fetch it again if it goes.
		tpl.SnapshotStored, tpl.SnapshotState = true, SnapshotStoredState
	}
	if err := m.cfg.Store.PutTemplate(ctx, &tpl); err != nil {
		return nil, err
	}
	m.pool.templateChanged(&tpl)
	m.prestarts.templateChanged(&tpl)
	m.log.Info("template loaded from the image store", "template", id, "build", tpl.BuildID, "layers", len(stack))
	c := tpl
	return &c, nil
}

// importLayer returns this node's directory of the layer named name: its own (a layer it made
// or unpacked itself under that name), or a verified copy loaded from the store.
func (m *Manager) importLayer(ctx context.Context, tp TreePorter, name string, maxBytes int64) (string, error) {
	// Only a layer ember made (layerid.go): never the data dir, a symlink or a directory
	// inside a layer's files.
	if err := m.checkIdentity(name, true); err != nil {
		return "", err
	}
	if ok, err := realDirs(m.cfg.DataDir, name); err != nil {
		return "", err
	} else if ok {
		return filepath.Join(m.cfg.DataDir, filepath.FromSlash(name)), nil
	}
	dest := filepath.Join(m.cfg.DataDir, remoteDir, base64.RawURLEncoding.EncodeToString([]byte(name)))
	if err := os.MkdirAll(filepath.Dir(dest), 0o700); err != nil {
		return "", err
	}
	err := m.cfg.Images.Fetch(ctx, layerStoreID(name), dest, func(ctx context.Context, src, dst string) error {
		t, err := tp.ImportTree(ctx, filepath.Join(src, treeArchive), dst, runtime.ImportOptions{MaxBytes: maxBytes})
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(dst, t)
		if err != nil {
			return err
		}
		return os.WriteFile(filepath.Join(dst, treeFile), []byte(rel), 0o600)
	})
	if err != nil {
		return "", err
	}
	rel, err := os.ReadFile(filepath.Join(dest, treeFile))
	if err != nil || !cleanRel(filepath.ToSlash(string(rel))) {
		return "", fmt.Errorf("layer %s: loaded copy %s is incomplete: %w", name, dest, errdefs.ErrCorrupt)
	}
	dir := filepath.Join(dest, string(rel))
	if err := m.checkLayerDir(dir); err != nil {
		return "", fmt.Errorf("layer %s: loaded copy: %w", name, err)
	}
	return dir, nil
}

// treeFile, in a loaded layer's directory, says where beneath it the layer's files are.
const treeFile = "tree-path"

// templateReady reports template tpl ready here (built, step-built, or a snapshot stored).
func (m *Manager) templateReady(tpl *Template) { m.templateEvent(EventTemplateReady, tpl) }

// Portable paused sandboxes: in cluster mode a pause stores the sandbox's pause image (memory
// and writable layer, chunks deduplicated by the store) before the pause answers, so that
// another node can resume it when this one is gone or drained.

// PortableSandbox is a paused sandbox as another node adopts it: its record with its rootfs
// stack as layer identities and no placement, and the store id of its pause image.
type PortableSandbox struct {
	Sandbox Sandbox `json:"sandbox"`
	ImageID string  `json:"imageID"`
}

// pauseStored stores the pause image of e's sandbox (paused on memory, its image complete)
// and reports EventStored (e.mu held). A failure leaves the sandbox paused on this node only.
func (m *Manager) pauseStored(ctx context.Context, e *entry) {
	// The pause is done: its upload finishes even if the caller goes away.
	ctx = context.WithoutCancel(ctx)
	p, err := m.exportPaused(ctx, e.sb)
	if err == nil {
		err = m.emit(ctx, Event{Kind: EventStored, Sandbox: m.snapshotOf(e), Stored: p})
	}
	if err != nil {
		m.logger(e.sb.ID).Warn("paused sandbox not stored: it resumes on this node only", "err", err)
	}
}

func (m *Manager) exportPaused(ctx context.Context, sb *Sandbox) (*PortableSandbox, error) {
	tp, err := m.porter()
	if err != nil {
		return nil, err
	}
	start := time.Now()
	p := &PortableSandbox{Sandbox: *sb}
	p.Sandbox.Runtime = Placement{SlotIndex: noSlot}
	p.Sandbox.PausedIn = TierStore // as the other nodes see it
	if p.Sandbox.RootFS, p.Sandbox.Lowers, err = m.exportStack(ctx, tp, sb.RootFS, sb.Lowers); err != nil {
		return nil, err
	}
	p.ImageID = "paused-" + sb.ID + "-" + filepath.Base(sb.Runtime.Image)
	if err := m.saveImage(ctx, p.ImageID, sb.Runtime.Image); err != nil {
		return nil, fmt.Errorf("store pause image: %w", err)
	}
	m.logger(sb.ID).Info("pause image stored", "image", p.ImageID, "ms", time.Since(start).Milliseconds())
	return p, nil
}

// ImportPaused makes the paused sandbox p describes one of this node's: its layers and pause
// image loaded (verified) from the image store, and its record paused here. A sandbox this
// node already holds paused is kept as it is.
func (m *Manager) ImportPaused(ctx context.Context, p *PortableSandbox) (*Sandbox, error) {
	tp, err := m.porter()
	if err != nil {
		return nil, err
	}
	id := p.Sandbox.ID
	if !idRe.MatchString(id) {
		return nil, fmt.Errorf("sandbox %q: %w", id, errdefs.ErrInvalid)
	}
	m.mu.Lock()
	e := m.live[id]
	m.mu.Unlock()
	if e != nil {
		e.mu.Lock()
		st := e.sb.State
		e.mu.Unlock()
		switch st {
		case StatePaused:
			return m.snapshotOf(e), nil
		case StateRunning:
			return nil, fmt.Errorf("sandbox %q already runs here: %w", id, errdefs.ErrConflict)
		}
	}
	ended := m.buildStarted() // no layer collection while layers arrive
	defer ended()
	sb := p.Sandbox
	n := 1 + len(sb.Lowers)
	if sb.RootFS, sb.Lowers, err = m.importStack(ctx, tp, sb.RootFS, sb.Lowers); err != nil {
		return nil, fmt.Errorf("sandbox %q: %w", id, err)
	}
	if err := os.MkdirAll(m.sandboxDir(id), 0o700); err != nil {
		return nil, err
	}
	image := filepath.Join(m.sandboxDir(id), "image-"+randomHex(3))
	max := int64(4*(orDefault(sb.DiskSizeMB, m.cfg.DiskMB)+orDefault(sb.MemoryMB, m.cfg.MemoryMB))) << 20
	err = m.cfg.Images.Fetch(ctx, p.ImageID, image, func(ctx context.Context, src, dst string) error {
		return m.cfg.Driver.ImportImage(ctx, src, dst, runtime.ImportOptions{MaxBytes: max})
	})
	if err != nil {
		os.RemoveAll(image)
		return nil, fmt.Errorf("sandbox %q: load pause image: %w", id, err)
	}
	if err := markComplete(image, false); err != nil {
		m.logger(id).Warn("mark pause image complete", "err", err)
	}
	sb.State, sb.PausedFilesOnly, sb.PausedIn = StatePaused, false, TierDisk
	sb.Runtime = Placement{Image: image, SlotIndex: noSlot}
	sb.EndReason, sb.EndedAt = "", time.Time{}
	if err := m.cfg.Store.PutSandbox(ctx, &sb); err != nil {
		os.RemoveAll(image)
		return nil, err
	}
	ne := &entry{sb: &sb}
	ne.mu.Lock()
	defer ne.mu.Unlock()
	m.mu.Lock()
	m.live[id] = ne
	m.mu.Unlock()
	m.emitLocked(ctx, ne, EventPaused, StartAdopted)
	m.logger(id).Info("paused sandbox adopted from the image store", "image", p.ImageID, "layers", n)
	return m.snapshotOf(ne), nil
}

// exportStack stores the layers of a rootfs stack the store does not have and returns their
// identities.
func (m *Manager) exportStack(ctx context.Context, tp TreePorter, rootfs string, lowers []string) (string, []string, error) {
	ident := LayerIdentity(m.cfg.DataDir)
	var names []string
	for _, dir := range append([]string{rootfs}, lowers...) {
		name := ident(dir)
		if filepath.IsAbs(name) {
			return "", nil, fmt.Errorf("layer %s is outside the data directory: %w", dir, errdefs.ErrInvalid)
		}
		if err := m.exportLayer(ctx, tp, name, dir); err != nil {
			return "", nil, fmt.Errorf("export layer %s: %w", name, err)
		}
		names = append(names, name)
	}
	if len(names) == 1 {
		return names[0], nil, nil
	}
	return names[0], names[1:], nil
}

// importStack returns this node's directories of a stack of layer identities, loading from
// the store those it does not have.
func (m *Manager) importStack(ctx context.Context, tp TreePorter, rootfs string, lowers []string) (string, []string, error) {
	var dirs []string
	for _, name := range append([]string{rootfs}, lowers...) {
		dir, err := m.importLayer(ctx, tp, name, 4<<30)
		if err != nil {
			return "", nil, fmt.Errorf("load layer %s: %w", name, err)
		}
		dirs = append(dirs, dir)
	}
	if len(dirs) == 1 {
		return dirs[0], nil, nil
	}
	return dirs[0], dirs[1:], nil
}

// Forks across nodes: the parent is checkpointed once more (it keeps running) into an image
// stored in the image store, and nodes placed for children restore them from it.

// PortableFork is a fork image in the store: the parent's record (its stack as layer
// identities, no placement) and the image's store id.
type PortableFork struct {
	Parent  Sandbox `json:"parent"`
	ImageID string  `json:"imageID"`
}

// ExportFork checkpoints running sandbox id (it keeps running) into the image store, for
// children on other nodes (ForkFrom).
func (m *Manager) ExportFork(ctx context.Context, id string) (*PortableFork, error) {
	tp, err := m.porter()
	if err != nil {
		return nil, err
	}
	ctx, done, err := m.op(ctx)
	if err != nil {
		return nil, err
	}
	defer done()
	e, err := m.entry(id)
	if err != nil {
		return nil, err
	}
	e.mu.Lock()
	if err := runningLocked(e); err != nil {
		e.mu.Unlock()
		return nil, err
	}
	parent := m.snapshotOf(e)
	image := filepath.Join(m.cfg.DataDir, "images", "fork-"+randomHex(6))
	if err := os.MkdirAll(image, 0o700); err != nil {
		e.mu.Unlock()
		return nil, err
	}
	defer overlayfs.RemoveTree(image)
	tpl, err := m.templateOf(ctx, parent)
	if err != nil {
		e.mu.Unlock()
		return nil, err
	}
	start := time.Now()
	// The image (and the record other nodes get) hold a token of its own (snaptoken.go).
	forkToken, err := m.withSnapshotToken(ctx, parent, tpl, func() error {
		_, _, cerr := m.captureRunningLocked(ctx, e, image, "")
		return cerr
	})
	e.mu.Unlock()
	if err != nil {
		return nil, fmt.Errorf("checkpoint: %w", err)
	}
	pf := &PortableFork{Parent: *parent, ImageID: "fork-" + id + "-" + filepath.Base(image)[len("fork-"):]}
	pf.Parent.AccessToken = forkToken
	pf.Parent.Runtime = Placement{SlotIndex: noSlot}
	if pf.Parent.RootFS, pf.Parent.Lowers, err = m.exportStack(ctx, tp, parent.RootFS, parent.Lowers); err != nil {
		return nil, err
	}
	if err := m.saveImage(ctx, pf.ImageID, image); err != nil {
		return nil, fmt.Errorf("store fork image: %w", err)
	}
	m.logger(id).Info("fork image stored", "image", pf.ImageID, "ms", time.Since(start).Milliseconds())
	return pf, nil
}

// ForkFrom restores count children of the fork image pf on this node (its layers and image
// loaded from the store, verified), each with its own id, token, network slot and layer.
// Child i consumes reservations[i], if given (EventStarted).
func (m *Manager) ForkFrom(ctx context.Context, pf *PortableFork, count int, timeout time.Duration, reservations []string) ([]ForkResult, error) {
	timeout, err := forkArgs(count, timeout)
	if err != nil {
		return nil, err
	}
	tp, err := m.porter()
	if err != nil {
		return nil, err
	}
	ctx, done, err := m.op(ctx)
	if err != nil {
		return nil, err
	}
	defer done()
	ended := m.buildStarted() // no layer collection while layers arrive
	defer ended()
	parent := pf.Parent
	if parent.RootFS, parent.Lowers, err = m.importStack(ctx, tp, parent.RootFS, parent.Lowers); err != nil {
		return nil, fmt.Errorf("fork of %q: %w", parent.ID, err)
	}
	if err := os.MkdirAll(filepath.Join(m.cfg.DataDir, "images"), 0o700); err != nil {
		return nil, err
	}
	image := filepath.Join(m.cfg.DataDir, "images", "in-"+randomHex(6))
	max := int64(4*(orDefault(parent.DiskSizeMB, m.cfg.DiskMB)+orDefault(parent.MemoryMB, m.cfg.MemoryMB))) << 20
	start := time.Now()
	err = m.cfg.Images.Fetch(ctx, pf.ImageID, image, func(ctx context.Context, src, dst string) error {
		return m.cfg.Driver.ImportImage(ctx, src, dst, runtime.ImportOptions{MaxBytes: max})
	})
	defer overlayfs.RemoveTree(image)
	if err != nil {
		return nil, fmt.Errorf("fork of %q: load image: %w", parent.ID, err)
	}
	tpl, err := m.templateOf(ctx, &parent)
	if err != nil {
		return nil, err
	}
	results, ok := m.forkChildren(ctx, &parent, tpl, image, count, timeout, reservations)
	m.logger(parent.ID).Info("fork children restored from the image store", "image", pf.ImageID, "children", ok, "failed", count-ok, "ms", time.Since(start).Milliseconds())
	if ok == 0 {
		return results, fmt.Errorf("fork: every child failed: %w", results[0].Err)
	}
	return results, nil
}

// DeleteStored removes a pause or fork image nothing refers to any more from the image store
// (its chunks go with the store's collection).
func (m *Manager) DeleteStored(ctx context.Context, imageID string) {
	if m.cfg.Images == nil || !(strings.HasPrefix(imageID, "paused-") || strings.HasPrefix(imageID, "fork-")) {
		return
	}
	m.goBG(func() {
		if err := m.cfg.Images.Delete(ctx, imageID); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
			m.log.Warn("delete stored image", "image", imageID, "err", err)
		}
	})
}

// Loaded reports whether template t was loaded from the image store (built on another node).
func Loaded(t *Template) bool { return t.LoadedFrom != "" }
