package sandbox

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/ember-sandbox/ember/internal/cleanup"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

// Slot is a network slot as the Manager needs it.
type Slot struct {
	Index     int
	NetNSPath string
	GuestIP   netip.Addr
}

// Network hands out single-use network slots (internal/network implements it).
type Network interface {
	Acquire(ctx context.Context, egress Egress) (Slot, error)
	Adopt(index int, egress Egress) (Slot, error)
	Release(ctx context.Context, index int) error
	Reconcile(ctx context.Context, keep []int) error
}

// Store persists records (internal/store implements it).
type Store interface {
	PutSandbox(ctx context.Context, sb *Sandbox) error
	GetSandbox(ctx context.Context, id string) (*Sandbox, error)
	DeleteSandbox(ctx context.Context, id string) error
	ListSandboxes(ctx context.Context) ([]*Sandbox, error)
	PutTemplate(ctx context.Context, t *Template) error
	GetTemplate(ctx context.Context, id string) (*Template, error)
	DeleteTemplate(ctx context.Context, id string) error
	ListTemplates(ctx context.Context) ([]*Template, error)
}

// RootFSBuilder writes template root filesystems (internal/template implements it).
type RootFSBuilder interface {
	BuildRootFS(ctx context.Context, dest string, progress func(string)) error
}

// ImageStore keeps checkpoint images of named snapshots durably (internal/snapshot).
// Optional: without it, snapshot images stay in the data directory only.
type ImageStore interface {
	Save(ctx context.Context, id, srcDir string) error
	Load(ctx context.Context, id, destDir string) error
	Delete(ctx context.Context, id string) error
}

// Config of a Manager.
type Config struct {
	DataDir  string
	Driver   runtime.Driver
	Network  Network
	Store    Store
	Builder  RootFSBuilder
	Images   ImageStore // optional
	Logger   *slog.Logger
	EnvdPath string // envd inside the rootfs
	// EnvdTimeout bounds the wait for envd after a boot or restore.
	EnvdTimeout time.Duration
	// PoolSize is the number of restored, unassigned sandboxes kept per template (0 disables).
	PoolSize int
	// Default resources of a sandbox.
	CPUCount int
	MemoryMB int
	DiskMB   int
}

// Manager owns every sandbox on this node. It implements Service.
type Manager struct {
	cfg    Config
	log    *slog.Logger
	client *http.Client
	guestT *guestTransports

	mu   sync.Mutex
	live map[string]*entry // sandboxes by id (running and paused)

	pool *pool

	stop chan struct{}
	wg   sync.WaitGroup
}

// entry is the in-memory state of one sandbox; mu serialises lifecycle operations on it.
type entry struct {
	mu sync.Mutex
	sb *Sandbox
}

var idRe = regexp.MustCompile(`^[a-z0-9]{1,64}$`)
var nameRe = regexp.MustCompile(`^[a-z0-9][a-z0-9_.-]{0,62}$`)

// New creates a Manager and reconciles what the store says with what really runs.
func New(ctx context.Context, cfg Config) (*Manager, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.EnvdTimeout == 0 {
		cfg.EnvdTimeout = 20 * time.Second
	}
	if cfg.EnvdPath == "" {
		cfg.EnvdPath = "/usr/local/bin/envd"
	}
	if cfg.CPUCount == 0 {
		cfg.CPUCount = 2
	}
	if cfg.MemoryMB == 0 {
		cfg.MemoryMB = 1024
	}
	if cfg.DiskMB == 0 {
		cfg.DiskMB = 2048
	}
	for _, d := range []string{"sandboxes", "templates", "images"} {
		if err := os.MkdirAll(filepath.Join(cfg.DataDir, d), 0o755); err != nil {
			return nil, err
		}
	}
	dialer := &net.Dialer{Timeout: 3 * time.Second, KeepAlive: 30 * time.Second}
	guestT := newGuestTransports()
	m := &Manager{
		cfg: cfg,
		log: cfg.Logger,
		// envd health and /init calls: no keep-alive, so a connection to a slot's address never
		// outlives the sandbox that had it (slots and their addresses are reused).
		client: &http.Client{Transport: &http.Transport{DialContext: dialer.DialContext, DisableKeepAlives: true}},
		guestT: guestT,
		live:   map[string]*entry{},
		stop:   make(chan struct{}),
	}
	m.pool = newPool(m)
	if err := m.reconcile(ctx); err != nil {
		return nil, fmt.Errorf("reconcile: %w", err)
	}
	m.wg.Add(1)
	go m.reaper()
	m.pool.start()
	return m, nil
}

// Close stops background work. Sandboxes keep running; a new Manager re-adopts them.
func (m *Manager) Close() {
	close(m.stop)
	m.pool.close()
	m.wg.Wait()
}

func randomHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

const idAlphabet = "abcdefghijklmnopqrstuvwxyz0123456789"

// newID returns a 20-character sandbox id of [a-z0-9] starting with a letter.
func newID() string {
	b := make([]byte, 20)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	for i := range b {
		b[i] = idAlphabet[int(b[i])%len(idAlphabet)]
	}
	b[0] = idAlphabet[int(b[0])%26]
	return string(b)
}

// instanceID names a runtime instance: the 20-char sandbox id plus a generation, fixed length.
func instanceID(sandboxID string) string { return sandboxID + "-" + randomHex(2) }

func (m *Manager) sandboxDir(id string) string { return filepath.Join(m.cfg.DataDir, "sandboxes", id) }

func copyMap(in map[string]string) map[string]string {
	if in == nil {
		return nil
	}
	out := make(map[string]string, len(in))
	for k, v := range in {
		out[k] = v
	}
	return out
}

func (m *Manager) logger(id string) *slog.Logger { return m.log.With("sandbox_id", id) }

// ---- lookup ----

func (m *Manager) entry(id string) (*entry, error) {
	if !idRe.MatchString(id) {
		return nil, fmt.Errorf("sandbox %q: %w", id, errdefs.ErrNotFound)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	e, ok := m.live[id]
	if !ok {
		return nil, fmt.Errorf("sandbox %q: %w", id, errdefs.ErrNotFound)
	}
	return e, nil
}

func (m *Manager) snapshotOf(e *entry) *Sandbox {
	c := *e.sb
	c.Metadata = copyMap(e.sb.Metadata)
	c.EnvVars = copyMap(e.sb.EnvVars)
	return &c
}

// Get returns a sandbox.
func (m *Manager) Get(ctx context.Context, id string) (*Sandbox, error) {
	e, err := m.entry(id)
	if err != nil {
		return nil, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.sb.State == StateKilled {
		return nil, fmt.Errorf("sandbox %q: %w", id, errdefs.ErrNotFound)
	}
	return m.snapshotOf(e), nil
}

// List returns the sandboxes matching f, newest first.
func (m *Manager) List(ctx context.Context, f ListFilter) ([]*Sandbox, error) {
	m.mu.Lock()
	entries := make([]*entry, 0, len(m.live))
	for _, e := range m.live {
		entries = append(entries, e)
	}
	m.mu.Unlock()
	states := f.States
	if len(states) == 0 {
		states = []State{StateRunning, StatePaused}
	}
	var out []*Sandbox
	for _, e := range entries {
		e.mu.Lock()
		sb := m.snapshotOf(e)
		e.mu.Unlock()
		if !matches(sb, f, states) {
			continue
		}
		out = append(out, sb)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].StartedAt.Equal(out[j].StartedAt) {
			return out[i].ID > out[j].ID
		}
		return out[i].StartedAt.After(out[j].StartedAt)
	})
	return out, nil
}

func matches(sb *Sandbox, f ListFilter, states []State) bool {
	ok := false
	for _, s := range states {
		if sb.State == s {
			ok = true
		}
	}
	if !ok {
		return false
	}
	for k, v := range f.Metadata {
		if sb.Metadata[k] != v {
			return false
		}
	}
	if f.TemplateID != "" && sb.TemplateID != f.TemplateID && sb.Alias != f.TemplateID {
		return false
	}
	if !f.StartedAfter.IsZero() && !sb.StartedAt.After(f.StartedAfter) {
		return false
	}
	return true
}

// ---- create ----

func (m *Manager) resolveTemplate(ctx context.Context, id string) (*Template, error) {
	if id == "" {
		id = "base"
	}
	if !nameRe.MatchString(id) {
		return nil, fmt.Errorf("template %q: %w", id, errdefs.ErrNotFound)
	}
	t, err := m.cfg.Store.GetTemplate(ctx, id)
	if err == nil {
		return t, nil
	}
	if !errors.Is(err, errdefs.ErrNotFound) {
		return nil, err
	}
	all, lerr := m.cfg.Store.ListTemplates(ctx)
	if lerr != nil {
		return nil, lerr
	}
	for _, t := range all {
		for _, a := range append(t.Aliases, t.Names...) {
			if a == id {
				return t, nil
			}
		}
	}
	return nil, fmt.Errorf("template %q not found: %w", id, errdefs.ErrNotFound)
}

// Create starts a new sandbox from a template: an assignment from the warm pool when one is
// ready, else a restore of the template's checkpoint, else (no checkpoint, or req.Cold) a boot.
func (m *Manager) Create(ctx context.Context, req CreateRequest) (*Sandbox, error) {
	if req.Timeout < 0 || req.Timeout > MaxTimeout {
		return nil, fmt.Errorf("timeout must be between 0 and %s: %w", MaxTimeout, errdefs.ErrInvalid)
	}
	tpl, err := m.resolveTemplate(ctx, req.TemplateID)
	if err != nil {
		return nil, err
	}
	if !tpl.Ready {
		return nil, fmt.Errorf("template %q is still building: %w", tpl.ID, errdefs.ErrUnavailable)
	}
	timeout := req.Timeout
	if timeout == 0 {
		timeout = DefaultTimeout
	}
	allow := true
	if req.AllowInternet != nil {
		allow = *req.AllowInternet
	}
	now := time.Now().UTC()
	sb := &Sandbox{
		ID:            newID(),
		TemplateID:    tpl.ID,
		State:         StateRunning,
		Metadata:      copyMap(req.Metadata),
		EnvVars:       copyMap(req.EnvVars),
		AccessToken:   randomHex(16),
		StartedAt:     now,
		EndAt:         now.Add(timeout),
		CPUCount:      orDefault(tpl.CPUCount, m.cfg.CPUCount),
		MemoryMB:      orDefault(tpl.MemoryMB, m.cfg.MemoryMB),
		DiskSizeMB:    orDefault(tpl.DiskMB, m.cfg.DiskMB),
		AutoPause:     req.AutoPause,
		AllowInternet: allow,
		Network:       req.Network.ForNew(),
	}
	if len(tpl.Aliases) > 0 {
		sb.Alias = tpl.Aliases[0]
	}
	log := m.logger(sb.ID)
	started := time.Now()
	how := "restore"
	switch {
	case req.Cold || tpl.Image == "":
		how = "boot"
		err = m.launch(ctx, sb, tpl, "", "", false)
	default:
		if pe := m.pool.take(tpl, req.IsDefaultEgress() && !req.NoPool); pe != nil {
			how = "pool"
			err = m.assign(ctx, sb, pe, tpl.InitToken)
		} else {
			image, ierr := m.templateImage(ctx, tpl)
			if ierr != nil {
				return nil, ierr
			}
			err = m.launch(ctx, sb, tpl, image, tpl.InitToken, false)
		}
	}
	if err != nil {
		log.Error("create failed", "template_id", tpl.ID, "how", how, "err", err)
		return nil, err
	}
	sb.StartedAt = time.Now().UTC()
	sb.EndAt = sb.StartedAt.Add(timeout)
	if err := m.cfg.Store.PutSandbox(ctx, sb); err != nil {
		m.destroy(context.Background(), sb)
		return nil, err
	}
	m.mu.Lock()
	m.live[sb.ID] = &entry{sb: sb}
	m.mu.Unlock()
	log.Info("sandbox created", "template_id", tpl.ID, "how", how, "ms", time.Since(started).Milliseconds())
	c := *sb
	return &c, nil
}

func orDefault(v, d int) int {
	if v > 0 {
		return v
	}
	return d
}

// spec builds the runtime spec of an instance of sb on slot.
func (m *Manager) spec(sb *Sandbox, tpl *Template, slot Slot, instance string) runtime.Spec {
	return runtime.Spec{
		ID:        instance,
		RootFS:    tpl.RootFS,
		StateDir:  filepath.Join(m.sandboxDir(sb.ID), "run-"+instance[len(instance)-4:]),
		NetNSPath: slot.NetNSPath,
		Hostname:  "sandbox",
		Args:      []string{m.cfg.EnvdPath},
		Env:       []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root"},
		Cwd:       "/",
		CPUCount:  sb.CPUCount,
		MemoryMB:  sb.MemoryMB,
	}
}

// launch gives sb a network slot and a runtime instance, booted (image == "") or restored from
// image, waits for envd and initialises it (a resume keeps its identity: no /init, and the pause
// image is consumed). On success sb.Runtime describes the placement; on failure everything
// acquired is released.
func (m *Manager) launch(ctx context.Context, sb *Sandbox, tpl *Template, image, initToken string, resume bool) error {
	var undo cleanup.Stack
	defer func() { undo.Run() }()
	t0 := time.Now()
	slot, err := m.cfg.Network.Acquire(ctx, sb.Egress())
	if err != nil {
		return fmt.Errorf("network slot: %w", err)
	}
	undo.Add(func() error { return m.cfg.Network.Release(context.Background(), slot.Index) })
	inst := instanceID(sb.ID)
	spec := m.spec(sb, tpl, slot, inst)
	if err := os.MkdirAll(spec.StateDir, 0o755); err != nil {
		return err
	}
	undo.Add(func() error { return os.RemoveAll(spec.StateDir) })
	t1 := time.Now()
	spec.ConsumeImage = resume // the pause image is deleted after a resume
	if image == "" {
		err = m.cfg.Driver.Start(ctx, spec)
	} else {
		err = m.cfg.Driver.Restore(ctx, spec, image)
	}
	undo.Add(func() error { return m.cfg.Driver.Delete(context.Background(), inst) })
	if err != nil {
		return fmt.Errorf("start instance: %w", err)
	}
	t2 := time.Now()
	base := fmt.Sprintf("http://%s", netip.AddrPortFrom(slot.GuestIP, EnvdPort))
	if err := m.waitEnvd(ctx, base); err != nil {
		return err
	}
	t3 := time.Now()
	if !resume {
		if err := m.initEnvd(ctx, base, sb, initToken); err != nil {
			return err
		}
	}
	m.logger(sb.ID).Debug("launch timings", "restore", image != "",
		"slot_ms", ms(t1.Sub(t0)), "runtime_ms", ms(t2.Sub(t1)), "envd_ms", ms(t3.Sub(t2)), "init_ms", ms(time.Since(t3)))
	sb.Runtime = Placement{
		Driver:     m.cfg.Driver.Name(),
		InstanceID: inst,
		SlotIndex:  slot.Index,
		GuestIP:    slot.GuestIP.String(),
		StateDir:   spec.StateDir,
	}
	m.guestT.open(sb.Runtime.GuestIP)
	undo.Release()
	return nil
}

// waitEnvd polls envd's /health until it answers.
func (m *Manager) waitEnvd(ctx context.Context, base string) error {
	ctx, cancel := context.WithTimeout(ctx, m.cfg.EnvdTimeout)
	defer cancel()
	delay := 2 * time.Millisecond
	var last error
	for {
		// A short bound per attempt: a lost first SYN on a fresh veth would otherwise cost the
		// kernel's 1 s retransmit.
		actx, acancel := context.WithTimeout(ctx, 250*time.Millisecond)
		req, _ := http.NewRequestWithContext(actx, http.MethodGet, base+"/health", nil)
		resp, err := m.client.Do(req)
		acancel()
		if err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode/100 == 2 {
				return nil
			}
			err = fmt.Errorf("status %d", resp.StatusCode)
		}
		last = err
		select {
		case <-ctx.Done():
			return fmt.Errorf("envd at %s did not come up: %v: %w", base, last, errdefs.ErrUnavailable)
		case <-time.After(delay):
		}
		if delay < 50*time.Millisecond {
			delay *= 2
		}
	}
}

type initRequest struct {
	EnvVars        map[string]string `json:"envVars"`
	AccessToken    string            `json:"accessToken"`
	DefaultUser    string            `json:"defaultUser"`
	DefaultWorkdir string            `json:"defaultWorkdir"`
	Hostname       string            `json:"hostname"`
	Timestamp      time.Time         `json:"timestamp"`
}

// initEnvd gives the sandbox its identity: env vars and access token. oldToken authenticates
// against an envd that already holds one (restored snapshot or fork).
func (m *Manager) initEnvd(ctx context.Context, base string, sb *Sandbox, oldToken string) error {
	body, _ := json.Marshal(initRequest{
		EnvVars:        sb.EnvVars,
		AccessToken:    sb.AccessToken,
		DefaultUser:    "user",
		DefaultWorkdir: "/home/user",
		Hostname:       "sandbox",
		Timestamp:      time.Now().UTC(),
	})
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, base+"/init", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if oldToken != "" {
		req.Header.Set("X-Access-Token", oldToken)
	}
	resp, err := m.client.Do(req)
	if err != nil {
		return fmt.Errorf("envd init: %w", err)
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("envd init: status %d: %s", resp.StatusCode, msg)
	}
	return nil
}

// destroy releases everything a running sandbox holds. Best effort; errors are logged.
func (m *Manager) destroy(ctx context.Context, sb *Sandbox) {
	log := m.logger(sb.ID)
	if sb.Runtime.InstanceID != "" {
		if err := m.cfg.Driver.Delete(ctx, sb.Runtime.InstanceID); err != nil {
			log.Warn("delete instance", "err", err)
		}
	}
	if sb.Runtime.GuestIP != "" {
		if err := m.cfg.Network.Release(ctx, sb.Runtime.SlotIndex); err != nil {
			log.Warn("release slot", "err", err)
		}
	}
	if sb.Runtime.StateDir != "" {
		os.RemoveAll(sb.Runtime.StateDir)
	}
	m.guestT.close(sb.Runtime.GuestIP)
	if err := os.RemoveAll(m.sandboxDir(sb.ID)); err != nil {
		log.Warn("remove sandbox dir", "err", err)
	}
}

// ---- kill, timeout ----

// Kill stops a sandbox and releases everything it holds.
func (m *Manager) Kill(ctx context.Context, id string) error {
	e, err := m.entry(id)
	if err != nil {
		return err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.sb.State == StateKilled {
		return fmt.Errorf("sandbox %q: %w", id, errdefs.ErrNotFound)
	}
	m.killLocked(ctx, e)
	return nil
}

func (m *Manager) killLocked(ctx context.Context, e *entry) {
	sb := e.sb
	m.destroy(ctx, sb)
	sb.State = StateKilled
	if err := m.cfg.Store.DeleteSandbox(ctx, sb.ID); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
		m.logger(sb.ID).Warn("delete record", "err", err)
	}
	m.mu.Lock()
	delete(m.live, sb.ID)
	m.mu.Unlock()
	m.logger(sb.ID).Info("sandbox killed")
}

// SetTimeout sets a running sandbox's end to now + d. Paused sandboxes answer not found, as
// E2B does (old SDKs rely on it to fall back to resume).
func (m *Manager) SetTimeout(ctx context.Context, id string, d time.Duration) error {
	if d < 0 || d > MaxTimeout {
		return fmt.Errorf("timeout must be between 0 and %s: %w", MaxTimeout, errdefs.ErrInvalid)
	}
	e, err := m.entry(id)
	if err != nil {
		return err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.sb.State != StateRunning {
		return fmt.Errorf("sandbox %q is not running: %w", id, errdefs.ErrNotFound)
	}
	e.sb.EndAt = time.Now().UTC().Add(d)
	return m.cfg.Store.PutSandbox(ctx, e.sb)
}

// reaper kills (or pauses) sandboxes whose end has passed.
func (m *Manager) reaper() {
	defer m.wg.Done()
	t := time.NewTicker(500 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-m.stop:
			return
		case <-t.C:
		}
		now := time.Now()
		m.mu.Lock()
		var due []*entry
		for _, e := range m.live {
			due = append(due, e)
		}
		m.mu.Unlock()
		for _, e := range due {
			e.mu.Lock()
			if e.sb.State == StateRunning && now.After(e.sb.EndAt) {
				ctx := context.Background()
				if e.sb.AutoPause {
					if err := m.pauseLocked(ctx, e); err != nil {
						m.logger(e.sb.ID).Error("auto-pause failed; killing", "err", err)
						m.killLocked(ctx, e)
					}
				} else {
					m.logger(e.sb.ID).Info("timeout reached")
					m.killLocked(ctx, e)
				}
			}
			e.mu.Unlock()
		}
	}
}

// ---- pause, resume ----

// Pause checkpoints a running sandbox and releases its processes, memory and network slot.
func (m *Manager) Pause(ctx context.Context, id string) error {
	e, err := m.entry(id)
	if err != nil {
		return err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	switch e.sb.State {
	case StatePaused:
		return fmt.Errorf("sandbox %q is already paused: %w", id, errdefs.ErrConflict)
	case StateKilled:
		return fmt.Errorf("sandbox %q: %w", id, errdefs.ErrNotFound)
	}
	return m.pauseLocked(ctx, e)
}

func (m *Manager) pauseLocked(ctx context.Context, e *entry) error {
	sb := e.sb
	start := time.Now()
	image := filepath.Join(m.sandboxDir(sb.ID), "image-"+randomHex(3))
	if err := os.MkdirAll(image, 0o755); err != nil {
		return err
	}
	if err := m.cfg.Driver.Checkpoint(ctx, sb.Runtime.InstanceID, image, runtime.CheckpointOptions{}); err != nil {
		os.RemoveAll(image)
		return fmt.Errorf("checkpoint: %w", err)
	}
	old := sb.Runtime
	sb.State = StatePaused
	sb.Runtime = Placement{Image: image, SlotIndex: -1}
	if err := m.cfg.Store.PutSandbox(ctx, sb); err != nil {
		return err
	}
	m.guestT.close(old.GuestIP)
	m.logger(sb.ID).Info("sandbox paused", "ms", time.Since(start).Milliseconds())
	// The checkpoint stopped every process of the instance and the record says paused: what is
	// left (runsc's state, the network slot, the run directory) is released after answering.
	// A crash before it finishes leaves orphans that reconcile removes at the next start.
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		ctx := context.Background()
		if err := m.cfg.Driver.Delete(ctx, old.InstanceID); err != nil {
			m.logger(sb.ID).Warn("delete paused instance", "err", err)
		}
		if err := m.cfg.Network.Release(ctx, old.SlotIndex); err != nil {
			m.logger(sb.ID).Warn("release slot", "err", err)
		}
		os.RemoveAll(old.StateDir)
	}()
	return nil
}

// Connect resumes a paused sandbox, or extends a running one's timeout.
func (m *Manager) Connect(ctx context.Context, id string, timeout time.Duration) (*Sandbox, bool, error) {
	if timeout < 0 || timeout > MaxTimeout {
		return nil, false, fmt.Errorf("timeout must be between 0 and %s: %w", MaxTimeout, errdefs.ErrInvalid)
	}
	if timeout == 0 {
		timeout = DefaultTimeout
	}
	e, err := m.entry(id)
	if err != nil {
		return nil, false, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	sb := e.sb
	switch sb.State {
	case StateRunning:
		if end := time.Now().UTC().Add(timeout); end.After(sb.EndAt) {
			sb.EndAt = end
			if err := m.cfg.Store.PutSandbox(ctx, sb); err != nil {
				return nil, false, err
			}
		}
		return m.snapshotOf(e), false, nil
	case StateKilled:
		return nil, false, fmt.Errorf("sandbox %q: %w", id, errdefs.ErrNotFound)
	}
	start := time.Now()
	tpl, err := m.templateOf(ctx, sb)
	if err != nil {
		return nil, false, err
	}
	image := sb.Runtime.Image
	if err := m.launch(ctx, sb, tpl, image, "", true); err != nil {
		return nil, false, fmt.Errorf("resume: %w", err)
	}
	sb.State = StateRunning
	sb.EndAt = time.Now().UTC().Add(timeout)
	if err := m.cfg.Store.PutSandbox(ctx, sb); err != nil {
		return nil, false, err
	}
	os.RemoveAll(image)
	m.logger(id).Info("sandbox resumed", "ms", time.Since(start).Milliseconds())
	return m.snapshotOf(e), true, nil
}

func (m *Manager) templateOf(ctx context.Context, sb *Sandbox) (*Template, error) {
	tpl, err := m.cfg.Store.GetTemplate(ctx, sb.TemplateID)
	if err != nil {
		return nil, fmt.Errorf("template %q of sandbox %q: %w", sb.TemplateID, sb.ID, err)
	}
	return tpl, nil
}

// ---- guest access, metrics ----

// GuestURL returns the base URL of a port inside a running sandbox.
func (m *Manager) GuestURL(ctx context.Context, id string, port int) (string, error) {
	if port <= 0 || port > 65535 {
		return "", fmt.Errorf("port %d: %w", port, errdefs.ErrInvalid)
	}
	e, err := m.entry(id)
	if err != nil {
		return "", err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.sb.State != StateRunning {
		return "", fmt.Errorf("sandbox %q is %s: %w", id, e.sb.State, errdefs.ErrConflict)
	}
	return "http://" + net.JoinHostPort(e.sb.Runtime.GuestIP, strconv.Itoa(port)), nil
}

// GuestTransport is the transport for requests into sandboxes.
func (m *Manager) GuestTransport() http.RoundTripper { return m.guestT }

// Metrics returns the current resource usage of a running sandbox.
func (m *Manager) Metrics(ctx context.Context, id string) ([]Metric, error) {
	e, err := m.entry(id)
	if err != nil {
		return nil, err
	}
	e.mu.Lock()
	sb := m.snapshotOf(e)
	e.mu.Unlock()
	if sb.State != StateRunning {
		return []Metric{}, nil
	}
	st, err := m.cfg.Driver.Stats(ctx, sb.Runtime.InstanceID)
	if err != nil {
		return nil, err
	}
	pct := 0.0
	if el := time.Since(sb.StartedAt); el > 0 && sb.CPUCount > 0 {
		pct = 100 * float64(st.CPUUsage) / float64(el) / float64(sb.CPUCount)
	}
	total := st.MemoryLimit
	if total == 0 {
		total = uint64(sb.MemoryMB) << 20
	}
	return []Metric{{
		Timestamp:  st.Timestamp,
		CPUCount:   sb.CPUCount,
		CPUUsedPct: pct,
		MemUsed:    st.MemoryBytes,
		MemTotal:   total,
		DiskTotal:  uint64(sb.DiskSizeMB) << 20,
	}}, nil
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
