package build

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"strings"
	"time"

	"github.com/ember-sandbox/ember/internal/datadir"
	"github.com/ember-sandbox/ember/internal/envdclient"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/image"
	"github.com/ember-sandbox/ember/internal/overlayfs"
	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/sandbox"
	"net/http"
)

// Step builds (E2B's Template builder). A build boots a sandbox of its parent (a template, or
// the rootfs of an image), runs its steps there through envd, captures the sandbox's writable
// layer with a filesystem-only checkpoint and composes the new template's rootfs from the
// parent's tree plus that layer (image.Compose, as image templates are composed); the result is
// booted once and checkpointed like every template.
//
// Caching. Every step has a key chained over the parent (its build), the steps before it and
// itself (type, arguments, the uploaded files' hash) and the user/workdir/env state after it.
// A build's captured layer is kept under the key of its last step (<data-dir>/layers/step-KEY),
// with the keys of the layers below it. A rebuild finds the longest prefix of its steps whose
// key has a layer: those steps are CACHED (not run), the sandbox boots on the composition of
// that prefix and runs only the rest; when every step is cached no sandbox boots for the steps.
// A template whose whole key (steps plus start and ready commands and resources) is unchanged
// is not rebuilt at all. force on the build disables the cache; force on a step busts it from
// that step on; changed files change the COPY step's hash and so its key.

// Step is one instruction of a step build (E2B's TemplateStep).
type Step struct {
	Type      string   `json:"type"` // RUN, ENV, WORKDIR, USER, COPY
	Args      []string `json:"args"`
	FilesHash string   `json:"filesHash,omitempty"`
	Force     bool     `json:"force,omitempty"`
}

// StepBuildRequest is what a requested build runs (E2B's TemplateBuildStartV2).
type StepBuildRequest struct {
	// Exactly one of FromTemplate (a template name) and FromImage (an image reference).
	FromTemplate string
	FromImage    string
	Auth         *RegistryAuth
	Steps        []Step
	StartCmd     string
	ReadyCmd     string
	Force        bool
}

// TemplateResolver is optionally implemented by the RootFSBuilder: an image reference that
// stands for a local template (E2B's e2bdev/base is ember's base).
type TemplateResolver interface {
	TemplateFor(ref string) (name string, ok bool)
}

// MaxBuildDuration bounds one step build, steps and warm-up together.
const MaxBuildDuration = time.Hour

const (
	maxSteps       = 256
	maxStepArgs    = 64
	maxStepArgSize = 1 << 20
	stepKeyVersion = "ember-step-build/2" // bump when what a step makes changes
)

// stepError is a failure of one step (its E2B step name).
type stepError struct {
	step string
	err  error
}

func (e *stepError) Error() string { return e.err.Error() }
func (e *stepError) Unwrap() error { return e.err }

func stepName(i int) string { return fmt.Sprint(i + 1) }

// validateSteps checks a request before it is accepted.
func (m *Manager) validateSteps(ctx context.Context, req StepBuildRequest) error {
	if (req.FromTemplate == "") == (req.FromImage == "") {
		return fmt.Errorf("exactly one of fromImage or fromTemplate must be given and non-empty: %w", errdefs.ErrInvalid)
	}
	if len(req.Steps) > maxSteps {
		return fmt.Errorf("at most %d steps: %w", maxSteps, errdefs.ErrInvalid)
	}
	for i, s := range req.Steps {
		bad := func(format string, a ...any) error {
			return fmt.Errorf("step %d (%s): %s: %w", i+1, s.Type, fmt.Sprintf(format, a...), errdefs.ErrInvalid)
		}
		if len(s.Args) > maxStepArgs {
			return bad("at most %d arguments", maxStepArgs)
		}
		for _, a := range s.Args {
			if len(a) > maxStepArgSize || strings.ContainsRune(a, 0) {
				return bad("an argument is too long or holds a NUL byte")
			}
		}
		switch s.Type {
		case "RUN":
			if len(s.Args) < 1 || strings.TrimSpace(s.Args[0]) == "" {
				return bad("a command is required")
			}
			if len(s.Args) > 1 && s.Args[1] != "" && !userNameOK(s.Args[1]) {
				return bad("invalid user %q", s.Args[1])
			}
		case "ENV":
			if len(s.Args) < 2 || len(s.Args)%2 != 0 {
				return bad("arguments must be name, value pairs")
			}
			for j := 0; j < len(s.Args); j += 2 {
				if !envNameOK(s.Args[j]) {
					return bad("invalid variable name %q", s.Args[j])
				}
			}
		case "WORKDIR", "USER":
			if len(s.Args) < 1 || s.Args[0] == "" {
				return bad("an argument is required")
			}
			if s.Type == "USER" && !userNameOK(s.Args[0]) {
				return bad("invalid user %q", s.Args[0])
			}
		case "COPY":
			if len(s.Args) < 2 || s.Args[0] == "" || s.Args[1] == "" {
				return bad("a source and a destination are required")
			}
			if len(s.Args) > 2 && s.Args[2] != "" && !ownerOK(s.Args[2]) {
				return bad("invalid owner %q", s.Args[2])
			}
			if len(s.Args) > 3 && s.Args[3] != "" {
				if _, err := parseMode(s.Args[3]); err != nil {
					return bad("%v", err)
				}
			}
			ok, err := m.HasBuildFiles(ctx, s.FilesHash)
			if err != nil {
				return bad("%v", err)
			}
			if !ok {
				return bad("the files with hash %s were not uploaded", s.FilesHash)
			}
		default:
			return bad("unsupported step type %q (supported: RUN, ENV, WORKDIR, USER, COPY)", s.Type)
		}
	}
	return nil
}

func envNameOK(s string) bool {
	if s == "" || len(s) > 256 {
		return false
	}
	for i, c := range s {
		if !(c == '_' || c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || i > 0 && c >= '0' && c <= '9') {
			return false
		}
	}
	return true
}

func userNameOK(s string) bool {
	if s == "" || len(s) > 32 || s[0] == '-' {
		return false
	}
	for _, c := range s {
		if !(c == '_' || c == '-' || c == '.' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9') {
			return false
		}
	}
	return true
}

func ownerOK(s string) bool {
	u, g, hasGroup := strings.Cut(s, ":")
	return userNameOK(u) && (!hasGroup || userNameOK(g))
}

// StartBuild starts a requested build with its steps. It returns once the build is accepted;
// the build runs in the background (GetBuild polls it). A second build of a template that is
// being built is refused (ErrConflict).
func (m *Manager) StartBuild(ctx context.Context, templateID, buildID string, req StepBuildRequest) error {
	if err := m.validateSteps(ctx, req); err != nil {
		return err
	}
	m.tb.mu.Lock()
	r, err := m.tb.get(templateID, buildID)
	if err == nil && r.b.Status != BuildWaiting {
		err = fmt.Errorf("build %s was already started: %w", buildID, errdefs.ErrConflict)
	}
	var spec TemplateBuild
	if err == nil {
		spec = r.b
	}
	m.tb.mu.Unlock()
	if err != nil {
		return err
	}
	release, err := m.reserveName(templateID, true)
	if err != nil {
		return fmt.Errorf("template %q is being built right now: %w", templateID, errdefs.ErrConflict)
	}
	bctx, done, err := m.op(context.Background())
	if err != nil {
		release()
		return err
	}
	m.tb.update(buildID, func(b *TemplateBuild) bool { b.Status = BuildBuilding; return true })
	go func() {
		defer done()
		defer release()
		t, err := m.queueStepBuild(bctx, spec, req)
		m.finishBuild(buildID, t, err)
	}()
	return nil
}

// queueStepBuild waits for a build slot, then runs the build.
func (m *Manager) queueStepBuild(ctx context.Context, spec TemplateBuild, req StepBuildRequest) (*Template, error) {
	select {
	case m.builds <- struct{}{}:
	default:
		m.tb.log(spec.ID, "info", "base", fmt.Sprintf("waiting for one of the %d build slots", cap(m.builds)))
		select {
		case m.builds <- struct{}{}:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	defer func() { <-m.builds }()
	ctx, cancel := context.WithTimeoutCause(ctx, MaxBuildDuration, fmt.Errorf("the build took longer than %s", MaxBuildDuration))
	defer cancel()
	t, err := m.runStepBuild(ctx, spec, req)
	if err != nil && errors.Is(ctx.Err(), context.DeadlineExceeded) {
		step := "finalize"
		var se *stepError
		if errors.As(err, &se) {
			step = se.step
		}
		err = &stepError{step: step, err: context.Cause(ctx)}
	}
	return t, err
}

func (m *Manager) finishBuild(buildID string, t *Template, err error) {
	now := time.Now().UTC()
	if err == nil {
		m.tb.log(buildID, "info", "finalize", fmt.Sprintf("Build finished: template %s ready", t.ID))
		m.tb.update(buildID, func(b *TemplateBuild) bool {
			b.FinishedAt, b.Status = now, BuildReady
			return true
		})
		return
	}
	step := "finalize"
	var se *stepError
	if errors.As(err, &se) {
		step = se.step
	}
	msg := err.Error()
	if errors.Is(err, context.Canceled) {
		msg = "the build was cancelled (ember is stopping)"
	}
	m.tb.log(buildID, "error", step, msg)
	m.tb.update(buildID, func(b *TemplateBuild) bool {
		b.FinishedAt = now
		b.Status, b.Reason = BuildError, &BuildReason{Message: msg, Step: step}
		return true
	})
	if err != nil {
		m.log.Warn("template build failed", "build_id", buildID, "err", err)
	}
}

// stepState is what the steps accumulate: the user and directory commands run as and in, and
// the environment. It becomes the template's defaults.
type stepState struct {
	User    string            `json:"user"`
	Workdir string            `json:"workdir"`
	Env     map[string]string `json:"env,omitempty"`
}

func initialState(parent *Template) stepState {
	st := stepState{User: parent.User, Workdir: parent.Workdir, Env: copyMap(parent.Env)}
	if st.User == "" {
		st.User = "user"
	}
	if st.Workdir == "" {
		st.Workdir = homeOf(st.User)
	}
	return st
}

func homeOf(user string) string {
	if user == "root" {
		return "/root"
	}
	return "/home/" + user
}

// after returns the state after step s.
func (st stepState) after(s Step) stepState {
	out := stepState{User: st.User, Workdir: st.Workdir, Env: copyMap(st.Env)}
	switch s.Type {
	case "ENV":
		if out.Env == nil {
			out.Env = map[string]string{}
		}
		for i := 0; i+1 < len(s.Args); i += 2 {
			out.Env[s.Args[i]] = s.Args[i+1]
		}
	case "WORKDIR":
		out.Workdir = resolveIn(st.Workdir, s.Args[0])
	case "USER":
		out.User = s.Args[0]
	}
	return out
}

// resolveIn resolves p against dir (a relative path is under dir).
func resolveIn(dir, p string) string {
	if strings.HasPrefix(p, "/") {
		return path.Clean(p)
	}
	return path.Join(dir, p)
}

func chainKey(parts ...any) string {
	h := sha256.New()
	for _, p := range parts {
		b, _ := json.Marshal(p)
		h.Write(b)
		h.Write([]byte{0})
	}
	return hex.EncodeToString(h.Sum(nil))
}

func describeStep(s Step) string {
	switch s.Type {
	case "ENV":
		var kv []string
		for i := 0; i+1 < len(s.Args); i += 2 {
			kv = append(kv, s.Args[i]+"="+s.Args[i+1])
		}
		return "ENV " + strings.Join(kv, " ")
	case "COPY":
		return "COPY " + s.Args[0] + " " + s.Args[1]
	case "RUN":
		d := "RUN " + s.Args[0]
		if len(s.Args) > 1 && s.Args[1] != "" {
			d += " (as " + s.Args[1] + ")"
		}
		return d
	}
	return s.Type + " " + strings.Join(s.Args, " ")
}

// stepLayer is a captured layer in <data-dir>/layers/step-KEY: layer.json and its files.
type stepLayer struct {
	Key    string     `json:"key"`
	Lowers []string   `json:"lowers,omitempty"` // keys of the step layers below it, bottom first
	Root   string     `json:"root"`             // the files, relative to the layer directory
	Meta   image.Meta `json:"meta"`
	dir    string
}

func (m *Manager) layersDir() string { return datadir.Layers(m.cfg.DataDir) }

func (m *Manager) readStepLayer(key string) (*stepLayer, error) {
	dir := filepath.Join(m.layersDir(), "step-"+key)
	data, err := os.ReadFile(filepath.Join(dir, "layer.json"))
	if err != nil {
		return nil, err
	}
	l := &stepLayer{dir: dir}
	if err := json.Unmarshal(data, l); err != nil || l.Key != key || !filepath.IsLocal(l.Root) {
		return nil, fmt.Errorf("step layer %s: bad record: %v: %w", key[:12], err, errdefs.ErrCorrupt)
	}
	return l, nil
}

func (l *stepLayer) layerDir() image.LayerDir {
	return image.LayerDir{Digest: "step:" + l.Key, Dir: l.dir, Root: filepath.Join(l.dir, l.Root), Meta: l.Meta}
}

// stack returns the layers of l, bottom first (its lowers, then itself).
func (m *Manager) stack(l *stepLayer) ([]image.LayerDir, error) {
	var out []image.LayerDir
	for _, k := range l.Lowers {
		lo, err := m.readStepLayer(k)
		if err != nil {
			return nil, err
		}
		out = append(out, lo.layerDir())
	}
	return append(out, l.layerDir()), nil
}

// runStepBuild runs one build: parent, cache, steps, composition, warm-up.
func (m *Manager) runStepBuild(ctx context.Context, spec TemplateBuild, req StepBuildRequest) (*Template, error) {
	name, bid := spec.TemplateID, spec.ID
	logf := func(step, format string, a ...any) { m.tb.log(bid, "info", step, fmt.Sprintf(format, a...)) }
	start := time.Now()
	// A layer collection waits for this build: its parent's and its step layers are in use
	// before any template record names them.
	defer m.buildStarted()()
	n := len(req.Steps)
	cleanup := []func(){}
	ok := false
	defer func() {
		if !ok {
			for i := len(cleanup) - 1; i >= 0; i-- {
				cleanup[i]()
			}
		}
	}()

	parent, parentKey, undo, err := m.stepParent(ctx, spec, req, logf)
	if err != nil {
		return nil, &stepError{step: "base", err: err}
	}
	if undo != nil {
		cleanup = append(cleanup, undo)
	}
	// The parent's stack is composed from on the host and booted on: only ember's layers.
	if err := m.checkStack(parent.RootFS, parent.Lowers); err != nil {
		return nil, &stepError{step: "base", err: err}
	}
	states := make([]stepState, n+1)
	keys := make([]string, n+1)
	states[0], keys[0] = initialState(parent), chainKey(stepKeyVersion, parentKey)
	for i, s := range req.Steps {
		states[i+1] = states[i].after(s)
		keys[i+1] = chainKey(keys[i], s.Type, s.Args, s.FilesHash, states[i+1])
	}
	final := states[n]
	cpu, mem, _ := m.host.TemplateResources(&Template{CPUCount: spec.CPUCount, MemoryMB: spec.MemoryMB})
	tplKey := chainKey(keys[n], req.StartCmd, req.ReadyCmd, cpu, mem)
	usable := n // steps 1..usable may come from the cache
	if req.Force {
		usable = 0
	}
	for i, s := range req.Steps {
		if s.Force && i < usable {
			usable = i
		}
	}
	cached := func(upTo int) {
		for i := 0; i < upTo; i++ {
			logf(stepName(i), "CACHED [builder %d/%d] %s", i+1, n, describeStep(req.Steps[i]))
		}
	}

	// The same template again: nothing to do.
	if old, err := m.cfg.Store.GetTemplate(ctx, name); err == nil && usable == n && old.BuildKey == tplKey && old.Ready && !old.Stale() && dirExists(old.RootFS) && dirExists(old.Image) {
		cached(n)
		logf("finalize", "CACHED template %s: unchanged since build %s", name, old.BuildID)
		old.Tags = mergeTags(old.Tags, spec.Tags, old.BuildID)
		if err := m.cfg.Store.PutTemplate(ctx, old); err != nil {
			return nil, err
		}
		ok = true
		return old, nil
	}

	// The longest cached prefix.
	var hit *stepLayer
	hitAt := 0
	for c := usable; c >= 1 && hit == nil; c-- {
		if l, err := m.readStepLayer(keys[c]); err == nil {
			if _, err := m.stack(l); err == nil {
				hit, hitAt = l, c
			}
		}
	}
	// The layers so far, bottom first: the parent's stack, then the cached step layers. A step
	// layer is an overlayfs upper dir (whiteouts and opaque marks in place), so it stacks on
	// them as it is: a segment's build sandbox boots on the stack, nothing is composed.
	var layers []image.LayerDir
	for i := len(parent.Lowers) - 1; i >= 0; i-- {
		layers = append(layers, image.LayerDir{Digest: "template-layer:" + parent.ID, Root: parent.Lowers[i]})
	}
	layers = append(layers, image.LayerDir{Digest: "template:" + parent.ID, Root: parent.RootFS})
	if hit != nil {
		st, _ := m.stack(hit)
		layers = append(layers, st...)
	}
	cached(hitAt)

	dir := m.templateDir(name)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	cleanup = append(cleanup, func() { os.Remove(dir) }) // only when empty
	// The steps not cached run in segments, each ending at a RUN or COPY (steps that only set
	// state ride along; a segment of ENV steps needs no sandbox): a build sandbox boots on the
	// layers so far, runs the segment and gives its writable layer, cached under the key of the
	// segment's last step. A later build that changes a step reuses every segment before it.
	var lowerKeys []string
	if hit != nil {
		lowerKeys = append(append(lowerKeys, hit.Lowers...), hit.Key)
	}
	for i := hitAt; i < n; {
		j := segmentEnd(req.Steps, i)
		var l *stepLayer
		if onlyEnv(req.Steps[i : j+1]) {
			for k := i; k <= j; k++ {
				logf(stepName(k), "[builder %d/%d] %s", k+1, n, describeStep(req.Steps[k]))
			}
			if l, err = m.emptyStepLayer(); err != nil {
				return nil, err
			}
		} else {
			l, err = m.runSteps(ctx, spec, req, parent, stackOf(layers), states, i, j+1, logf)
			if err != nil {
				return nil, err
			}
		}
		l.Key, l.Lowers = keys[j+1], append([]string(nil), lowerKeys...)
		// Committed under its key at once: the next segment and the template stack on it
		// where it stays (a checkpoint remembers the paths of its stack). A failed build
		// removes the layers it committed.
		mine, err := m.commitStepLayer(l)
		if err != nil {
			overlayfs.RemoveTree(l.dir, overlayfs.DetachMounts)
			return nil, err
		}
		if mine {
			cleanup = append(cleanup, func() { overlayfs.RemoveTree(l.dir, overlayfs.DetachMounts) })
		}
		lowerKeys = append(lowerKeys, l.Key)
		layers = append(layers, l.layerDir())
		i = j + 1
	}

	rootfs := filepath.Join(dir, "rootfs-"+bid[:8])
	if err := os.MkdirAll(rootfs, 0o755); err != nil {
		return nil, err
	}
	cleanup = append(cleanup, func() { overlayfs.RemoveTree(rootfs, overlayfs.DetachMounts) })
	if st := stackOf(layers); m.checkStack(st.Top, st.Lowers) != nil {
		return nil, &stepError{step: "finalize", err: m.checkStack(st.Top, st.Lowers)}
	}
	stack, cs, err := image.Compose(ctx, rootfs, layers)
	if err != nil {
		return nil, &stepError{step: "finalize", err: fmt.Errorf("compose rootfs: %w", err)}
	}
	logf("finalize", "[finalize] rootfs: a stack of %d layers (%d hard links made)", cs.Layers+1, cs.Links)

	var oldTags []TemplateTag
	created := time.Now().UTC()
	if old, err := m.cfg.Store.GetTemplate(ctx, name); err == nil {
		oldTags = old.Tags
	}
	tpl := &Template{
		ID: name, Kind: "template", Team: spec.Team, RootFS: stack.Top, Lowers: stack.Lowers, CreatedAt: created, CPUCount: spec.CPUCount, MemoryMB: spec.MemoryMB,
		BuildID: bid, InitToken: randomHex(16), Env: final.Env, User: final.User, Workdir: final.Workdir,
		Format: TemplateFormat, BuildKey: tplKey, Tags: mergeTags(oldTags, spec.Tags, bid), Names: []string{name},
	}
	imageDir := filepath.Join(dir, "image-"+bid[:8])
	cleanup = append(cleanup, func() { overlayfs.RemoveTree(imageDir, overlayfs.DetachMounts) })
	breq := BuildRequest{StartCmd: req.StartCmd, ReadyCmd: req.ReadyCmd, StartUser: final.User}
	if err := m.warm(ctx, tpl, breq, imageDir, func(s string) { logf("finalize", "[finalize] %s", s) }); err != nil {
		return nil, &stepError{step: "finalize", err: fmt.Errorf("start the template: %w", err)}
	}
	tpl.Image, tpl.Ready = imageDir, true
	if err := m.publish(ctx, tpl); err != nil {
		return nil, err
	}
	ok = true
	logf("finalize", "[finalize] template %s built in %s", name, time.Since(start).Round(time.Millisecond))
	return tpl, nil
}

// commitStepLayer moves a staged layer to its key's place; mine says it was this call that
// put it there (a concurrent build of the same steps may have put one there first: that one
// is kept, and l names it).
func (m *Manager) commitStepLayer(l *stepLayer) (mine bool, err error) {
	data, err := json.Marshal(l)
	if err != nil {
		return false, err
	}
	if err := os.WriteFile(filepath.Join(l.dir, "layer.json"), data, 0o600); err != nil {
		return false, err
	}
	dst := filepath.Join(m.layersDir(), "step-"+l.Key)
	if err := os.Rename(l.dir, dst); err != nil {
		if dirExists(dst) {
			overlayfs.RemoveTree(l.dir, overlayfs.DetachMounts)
			l.dir = dst
			return false, nil
		}
		return false, err
	}
	l.dir = dst
	return true, nil
}

// stackOf is the stack of layers (bottom first) as a template's rootfs: its top and lowers.
func stackOf(layers []image.LayerDir) image.Stack {
	var st image.Stack
	for i := len(layers) - 1; i >= 0; i-- {
		if st.Top == "" {
			st.Top = layers[i].RootDir()
		} else {
			st.Lowers = append(st.Lowers, layers[i].RootDir())
		}
	}
	return st
}

// stepParent resolves what a build starts from: a template, or an image's rootfs (built by the
// image path the first time, or when forced; undo removes a rootfs this build made).
func (m *Manager) stepParent(ctx context.Context, spec TemplateBuild, req StepBuildRequest, logf func(step, format string, a ...any)) (*Template, string, func(), error) {
	from := req.FromTemplate
	if req.FromImage != "" {
		if r, ok := m.cfg.Builder.(TemplateResolver); ok {
			if name, ok := r.TemplateFor(req.FromImage); ok {
				logf("base", "[base] image %s is ember's template %q here", req.FromImage, name)
				from = name
			}
		}
	}
	if from != "" {
		name, _ := sandbox.SplitTemplateName(from)
		t, err := m.GetTemplate(ctx, name)
		if err != nil {
			return nil, "", nil, fmt.Errorf("template '%s' not found: %w", name, errdefs.ErrNotFound)
		}
		if t.Kind != "template" {
			return nil, "", nil, fmt.Errorf("%q is a snapshot; build from a template or an image: %w", name, errdefs.ErrInvalid)
		}
		if !t.Ready || !dirExists(t.RootFS) {
			return nil, "", nil, fmt.Errorf("template %q is not ready: %w", name, errdefs.ErrUnavailable)
		}
		logf("base", "[base] FROM template %s (build %s)", t.ID, t.BuildID)
		return t, "template:" + t.ID + "@" + t.BuildID, nil, nil
	}
	// An image: its rootfs is kept per reference, in a directory the template builder knows
	// (<data-dir>/templates/.image-KEY/rootfs-ID), and reused until a forced build.
	ref := req.FromImage
	key := chainKey("image", ref, req.Auth != nil)[:16]
	idir := m.templateDir(".image-" + key)
	type imageParent struct {
		RootFS string     `json:"rootfs"`
		Info   RootFSInfo `json:"info"`
		Built  time.Time  `json:"built"`
	}
	var ip imageParent
	if data, err := os.ReadFile(filepath.Join(idir, "parent.json")); err == nil && !req.Force {
		if json.Unmarshal(data, &ip) == nil && dirExists(ip.RootFS) {
			logf("base", "CACHED [base] FROM image %s (pulled %s)", ref, ip.Built.Format(time.RFC3339))
			t := &Template{ID: "image", RootFS: ip.RootFS, Lowers: ip.Info.Lowers, Env: ip.Info.Env, User: ip.Info.User, Workdir: ip.Info.Workdir, Ready: true}
			return t, "image:" + ref + "@" + ip.Built.Format(time.RFC3339Nano), nil, nil
		}
	}
	logf("base", "[base] FROM image %s", ref)
	if err := os.MkdirAll(idir, 0o700); err != nil {
		return nil, "", nil, err
	}
	rootfs := filepath.Join(idir, "rootfs-"+spec.ID[:8])
	info, err := m.cfg.Builder.BuildRootFS(ctx, BuildRequest{Name: spec.TemplateID, FromImage: ref, Auth: req.Auth}, rootfs, func(s string) { logf("base", "[base] %s", s) })
	if err != nil {
		os.Remove(idir)
		return nil, "", nil, err
	}
	ip = imageParent{RootFS: rootfs, Info: info, Built: time.Now().UTC()}
	data, _ := json.Marshal(ip)
	undo := func() { overlayfs.RemoveTree(rootfs, overlayfs.DetachMounts) }
	if err := writeFileAtomic(filepath.Join(idir, "parent.json"), data); err != nil {
		undo()
		return nil, "", nil, err
	}
	// The previous pull's rootfs stays while templates stack on it; the layer collection
	// removes it once none does.
	t := &Template{ID: "image", RootFS: rootfs, Lowers: info.Lowers, Env: info.Env, User: info.User, Workdir: info.Workdir, Ready: true}
	return t, "image:" + ref + "@" + ip.Built.Format(time.RFC3339Nano), undo, nil
}

func writeFileAtomic(p string, data []byte) error {
	tmp := p + ".tmp"
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, p)
}

func dirExists(p string) bool {
	fi, err := os.Stat(p)
	return p != "" && err == nil && fi.IsDir()
}

// segmentEnd returns the last step of the segment that starts at i: the next RUN or COPY, or
// the last step when only state-setting steps follow.
func segmentEnd(steps []Step, i int) int {
	j := i
	for j < len(steps)-1 && steps[j].Type != "RUN" && steps[j].Type != "COPY" {
		j++
	}
	for k := j + 1; k < len(steps); k++ {
		if steps[k].Type == "RUN" || steps[k].Type == "COPY" {
			return j
		}
	}
	return len(steps) - 1
}

func onlyEnv(steps []Step) bool {
	for _, s := range steps {
		if s.Type != "ENV" {
			return false
		}
	}
	return true
}

// emptyStepLayer stages a layer with no files (steps that change no file).
func (m *Manager) emptyStepLayer() (*stepLayer, error) {
	if err := os.MkdirAll(m.layersDir(), 0o700); err != nil {
		return nil, err
	}
	stage, err := os.MkdirTemp(m.layersDir(), ".tmp-step-")
	if err != nil {
		return nil, err
	}
	if err := os.Mkdir(filepath.Join(stage, "root"), 0o755); err != nil {
		overlayfs.RemoveTree(stage, overlayfs.DetachMounts)
		return nil, err
	}
	return &stepLayer{Root: "root", dir: stage}, nil
}

// runSteps boots a build sandbox on root, runs steps from..to-1 in it and captures its
// writable layer into a staged step layer (not yet committed under its key).
func (m *Manager) runSteps(ctx context.Context, spec TemplateBuild, req StepBuildRequest, parent *Template, root image.Stack, states []stepState, from, to int, logf func(step, format string, a ...any)) (*stepLayer, error) {
	n := len(req.Steps)
	ud, ok := m.cfg.Driver.(runtime.UpperDirer)
	if !ok {
		return nil, fmt.Errorf("the %s driver cannot capture a sandbox's files as a layer: %w", m.cfg.Driver.Name(), errdefs.ErrInvalid)
	}
	token := randomHex(16)
	btpl := &Template{ID: spec.TemplateID, Kind: "template", RootFS: root.Top, Lowers: root.Lowers, Env: parent.Env, User: parent.User, Workdir: parent.Workdir}
	t0 := time.Now()
	p, err := m.launch(ctx, sandbox.BuildSandboxSpec{Kind: 'b', Template: btpl, Token: token,
		CPUCount: spec.CPUCount, MemoryMB: spec.MemoryMB, Internet: true})
	if err != nil {
		return nil, &stepError{step: stepName(from), err: fmt.Errorf("boot the build sandbox: %w", err)}
	}
	defer p.Close(context.WithoutCancel(ctx))
	logf(stepName(from), "build sandbox up in %s", time.Since(t0).Round(time.Millisecond))
	g := &guestRun{m: m, client: p.Client, base: p.EnvdURL, token: token}
	for i := from; i < to; i++ {
		s := req.Steps[i]
		step := stepName(i)
		logf(step, "[builder %d/%d] %s", i+1, n, describeStep(s))
		if err := g.step(ctx, s, states[i], func(msg string) { logf(step, "%s", msg) }); err != nil {
			return nil, &stepError{step: step, err: err}
		}
	}
	if err := os.MkdirAll(m.layersDir(), 0o700); err != nil {
		return nil, err
	}
	stage, err := os.MkdirTemp(m.layersDir(), ".tmp-step-")
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*stepLayer, error) {
		overlayfs.RemoveTree(stage, overlayfs.DetachMounts)
		return nil, err
	}
	img := filepath.Join(stage, "image")
	if err := os.Mkdir(img, 0o700); err != nil {
		return fail(err)
	}
	t1 := time.Now()
	if err := m.cfg.Driver.Checkpoint(ctx, p.InstanceID, img, runtime.CheckpointOptions{FilesOnly: true}); err != nil {
		return fail(fmt.Errorf("capture the build sandbox's files: %w", err))
	}
	p.Close(context.WithoutCancel(ctx))
	upper, err := ud.UpperDir(img)
	if err != nil {
		return fail(err)
	}
	meta, err := image.FromUpper(upper)
	if err != nil {
		return fail(err)
	}
	rel, err := filepath.Rel(stage, upper)
	if err != nil || !filepath.IsLocal(rel) {
		return fail(fmt.Errorf("layer %s is not inside %s", upper, stage))
	}
	logf(stepName(to-1), "layer captured: %s in %d entries, %d deletions, in %s", image.HumanBytes(meta.Bytes), meta.Entries, len(meta.Whiteouts)+len(meta.Opaque), time.Since(t1).Round(time.Millisecond))
	return &stepLayer{Root: rel, Meta: meta, dir: stage}, nil
}

// guestRun runs steps in a build sandbox through envd.
type guestRun struct {
	m      *Manager
	client *http.Client
	base   string
	token  string
	n      int
}

// step runs one step in state st (the state before it).
func (g *guestRun) step(ctx context.Context, s Step, st stepState, out func(string)) error {
	switch s.Type {
	case "RUN":
		user := st.User
		if len(s.Args) > 1 && s.Args[1] != "" {
			user = s.Args[1]
		}
		code, err := g.run(ctx, s.Args[0], user, st.Workdir, st.Env, out)
		if err != nil {
			return fmt.Errorf("failed to run command '%s': %w", s.Args[0], err)
		}
		if code != 0 {
			return fmt.Errorf("failed to run command '%s': exit status %d", s.Args[0], code)
		}
	case "ENV":
	case "WORKDIR":
		d := resolveIn(st.Workdir, s.Args[0])
		cmd := fmt.Sprintf("d=%s; [ -d \"$d\" ] || { mkdir -p \"$d\" && chown %s: \"$d\"; }", shellQuote(d), shellQuote(st.User))
		if err := g.root(ctx, cmd, out); err != nil {
			return fmt.Errorf("workdir %s: %w", d, err)
		}
	case "USER":
		u := shellQuote(s.Args[0])
		cmd := fmt.Sprintf("id -u %s >/dev/null 2>&1 || useradd -m -s /bin/bash %s || adduser -D %s", u, u, u)
		if err := g.root(ctx, cmd, out); err != nil {
			return fmt.Errorf("user %s: %w", s.Args[0], err)
		}
	case "COPY":
		return g.copy(ctx, s, st, out)
	}
	return nil
}

// root runs a command as root and fails on a non-zero exit.
func (g *guestRun) root(ctx context.Context, cmd string, out func(string)) error {
	code, err := g.run(ctx, cmd, "root", "/", nil, out)
	if err == nil && code != 0 {
		err = fmt.Errorf("exit status %d", code)
	}
	return err
}

func (g *guestRun) run(ctx context.Context, cmd, user, cwd string, env map[string]string, out func(string)) (int, error) {
	lw := &lineWriter{emit: out}
	o := envdclient.Output{Stdout: lw.write, Stderr: lw.write}
	res, err := envdclient.New(g.client, g.base, g.token).Run(ctx,
		envdclient.Command{Line: cmd, User: user, Cwd: cwd, Envs: env}, o)
	lw.flush()
	return res.ExitCode, err
}

// lineWriter turns output chunks into log lines.
type lineWriter struct {
	buf  []byte
	emit func(string)
}

func (w *lineWriter) write(b []byte) {
	w.buf = append(w.buf, b...)
	for {
		i := strings.IndexByte(string(w.buf), '\n')
		if i < 0 {
			break
		}
		w.emit(strings.TrimRight(string(w.buf[:i]), "\r"))
		w.buf = w.buf[i+1:]
	}
	if len(w.buf) > 64<<10 {
		w.flush()
	}
}

func (w *lineWriter) flush() {
	if len(w.buf) > 0 {
		w.emit(string(w.buf))
		w.buf = nil
	}
}
