package build

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/ember-sandbox/ember/internal/datadir"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// Template builds through the API (E2B's template build flow): a build is requested (a record in
// state waiting), its COPY files are uploaded (content-addressed by the hash the client
// computed), it is started with its steps and runs in the background, and its status and log
// lines are polled. Build records are files under <data-dir>/builds, so they survive a restart;
// a build that a restart interrupted is reported as failed, never as still building.

// TemplateBuilder is what the API edge needs of template builds: from steps (E2B's
// Template.build) and from a rootfs source. *Manager implements it.
type TemplateBuilder interface {
	// BuildTemplate builds (or rebuilds) a template, writing progress lines to progress.
	BuildTemplate(ctx context.Context, req BuildRequest, progress func(line string)) (*Template, error)
	// CheckBuild validates a build request (name, source) without building.
	CheckBuild(req BuildRequest) error
	// ImportArchive stores an image archive in the node's import directory and returns the
	// name `archive:NAME` builds from, and its size; DeleteImport removes one. An import is
	// team's: another team's answers as a missing one (to builds too).
	ImportArchive(ctx context.Context, team string, r io.Reader) (name string, size int64, err error)
	DeleteImport(ctx context.Context, team, name string) error
	RequestBuild(ctx context.Context, req BuildSpec) (*TemplateBuild, error)
	StartBuild(ctx context.Context, templateID, buildID string, req StepBuildRequest) error
	GetBuild(ctx context.Context, templateID, buildID string) (*TemplateBuild, error)
	ListBuilds(ctx context.Context, templateID string) ([]*TemplateBuild, error)
	HasBuildFiles(ctx context.Context, hash string) (bool, error)
	PutBuildFiles(ctx context.Context, hash string, r io.Reader) error
	AssignTags(ctx context.Context, name, fromTag string, tags []string) (*Template, error)
	RemoveTags(ctx context.Context, name string, tags []string) error
	GetTemplate(ctx context.Context, id string) (*Template, error)
}

var _ TemplateBuilder = (*Manager)(nil)

// BuildStatus is a build's state, in E2B's words.
type BuildStatus string

const (
	BuildWaiting  BuildStatus = "waiting"
	BuildBuilding BuildStatus = "building"
	BuildReady    BuildStatus = "ready"
	BuildError    BuildStatus = "error"
)

// BuildSpec is what a build is requested with (before its steps are known).
type BuildSpec struct {
	Name     string
	Team     string // the team the template belongs to
	Tags     []string
	CPUCount int
	MemoryMB int
}

// BuildLogEntry is one line of a build's log. Step is "base", a step number from 1, or
// "finalize" (E2B's step names).
type BuildLogEntry struct {
	Timestamp time.Time `json:"timestamp"`
	Level     string    `json:"level"`
	Message   string    `json:"message"`
	Step      string    `json:"step,omitempty"`
}

// BuildReason says why a build failed.
type BuildReason struct {
	Message string `json:"message"`
	Step    string `json:"step,omitempty"`
}

// TemplateBuild is the record of one build.
type TemplateBuild struct {
	ID         string          `json:"id"`
	TemplateID string          `json:"templateId"`
	Team       string          `json:"team,omitempty"` // the team that asked for it (and owns the template)
	Status     BuildStatus     `json:"status"`
	Tags       []string        `json:"tags,omitempty"`
	CPUCount   int             `json:"cpuCount"`
	MemoryMB   int             `json:"memoryMB"`
	CreatedAt  time.Time       `json:"createdAt"`
	UpdatedAt  time.Time       `json:"updatedAt"`
	FinishedAt time.Time       `json:"finishedAt,omitzero"`
	Logs       []BuildLogEntry `json:"logs,omitempty"`
	// LogsDropped counts the log's first lines no longer held in Logs (they are in the log
	// file on disk): Logs[i] is line LogsDropped+i of the build.
	LogsDropped int          `json:"logsDropped,omitempty"`
	Reason      *BuildReason `json:"reason,omitempty"`
}

// Limits of the build API.
const (
	// maxBuildLogLines bounds the log lines a build holds in memory (the last ones); the whole
	// log is in <data-dir>/builds/<id>.log, up to maxBuildLogFileBytes.
	maxBuildLogLines     = 2000
	maxBuildLogFileBytes = 64 << 20
	maxBuildTags         = 32
	// DefaultMaxBuildFileBytes bounds one uploaded COPY tarball.
	DefaultMaxBuildFileBytes = 2 << 30
)

var (
	filesHashRe = regexp.MustCompile(`^[0-9a-f]{64}$`)
	tagRe       = regexp.MustCompile(`^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,63}$`)
	buildIDRe   = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)
)

// builds holds the build records of this node.
type builds struct {
	mu   sync.Mutex
	dir  string
	recs map[string]*buildRec // by build id
}

type buildRec struct {
	b        TemplateBuild
	logf     *os.File // the log file while the build appends to it
	logBytes int64    // its size
}

// openBuilds loads the build records in dir. A build that was waiting or building when the
// daemon stopped ended with it: it is recorded as failed.
func openBuilds(dir string, log func(msg string, args ...any)) (*builds, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	bs := &builds{dir: dir, recs: map[string]*buildRec{}}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	for _, e := range ents {
		name := e.Name()
		if strings.HasPrefix(name, ".tmp-") {
			os.Remove(filepath.Join(dir, name))
			continue
		}
		id, ok := strings.CutSuffix(name, ".json")
		if !ok || !buildIDRe.MatchString(id) {
			continue
		}
		data, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			return nil, err
		}
		r := &buildRec{}
		if err := json.Unmarshal(data, &r.b); err != nil || r.b.ID != id {
			log("unreadable build record: removed", "build_id", id, "err", err)
			os.Remove(filepath.Join(dir, name))
			os.Remove(filepath.Join(dir, id+".log"))
			continue
		}
		bs.loadLog(r)
		if r.b.Status == BuildWaiting || r.b.Status == BuildBuilding {
			now := time.Now().UTC()
			msg := "the build was interrupted: ember stopped while it ran"
			if r.b.Status == BuildWaiting {
				msg = "the build was never started before ember stopped"
			}
			bs.appendLog(r, BuildLogEntry{Timestamp: now, Level: "error", Message: msg})
			bs.closeLog(r)
			r.b.Status, r.b.Reason, r.b.FinishedAt, r.b.UpdatedAt = BuildError, &BuildReason{Message: msg}, now, now
			if err := bs.write(r); err != nil {
				return nil, err
			}
		}
		bs.recs[id] = r
	}
	return bs, nil
}

// write persists r's record (without its log: that is appended to its own file) atomically.
// Call with bs.mu held (or before bs is shared).
func (bs *builds) write(r *buildRec) error {
	rec := r.b
	rec.Logs, rec.LogsDropped = nil, 0
	data, err := json.Marshal(&rec)
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(bs.dir, ".tmp-")
	if err != nil {
		return err
	}
	_, err = tmp.Write(data)
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), filepath.Join(bs.dir, r.b.ID+".json"))
	}
	if err != nil {
		os.Remove(tmp.Name())
		return err
	}
	return nil
}

func (bs *builds) logPath(id string) string { return filepath.Join(bs.dir, id+".log") }

// loadLog reads the last lines of r's log file into r.
func (bs *builds) loadLog(r *buildRec) {
	f, err := os.Open(bs.logPath(r.b.ID))
	if err != nil {
		// A record of an older ember: its lines go to the log file, its record loses them at
		// its next write.
		old := r.b.Logs
		r.b.Logs = nil
		for _, e := range old {
			bs.appendLog(r, e)
		}
		bs.closeLog(r)
		return
	}
	defer f.Close()
	r.b.Logs, r.b.LogsDropped = nil, 0
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64<<10), 4*maxLogMessage)
	for sc.Scan() {
		r.logBytes += int64(len(sc.Bytes())) + 1
		var e BuildLogEntry
		if json.Unmarshal(sc.Bytes(), &e) == nil {
			bs.hold(r, &e)
		}
	}
}

// hold keeps e (if not nil) among r's lines in memory, dropping the oldest beyond
// maxBuildLogLines (a quarter at a time, so a line costs O(1)).
func (bs *builds) hold(r *buildRec, e *BuildLogEntry) {
	if e != nil {
		r.b.Logs = append(r.b.Logs, *e)
	}
	if len(r.b.Logs) > maxBuildLogLines {
		drop := len(r.b.Logs) - maxBuildLogLines*3/4
		n := copy(r.b.Logs, r.b.Logs[drop:])
		clear(r.b.Logs[n:])
		r.b.Logs = r.b.Logs[:n]
		r.b.LogsDropped += drop
	}
}

// appendLog adds a line to r's log: held in memory (bounded) and appended to its file. Call
// with bs.mu held (or before bs is shared).
func (bs *builds) appendLog(r *buildRec, e BuildLogEntry) {
	bs.hold(r, &e)
	if r.logBytes >= maxBuildLogFileBytes {
		return
	}
	if r.logf == nil {
		f, err := os.OpenFile(bs.logPath(r.b.ID), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
		if err != nil {
			return // the line stays in memory only
		}
		r.logf = f
	}
	line, _ := json.Marshal(e)
	if r.logBytes+int64(len(line)) >= maxBuildLogFileBytes {
		line, _ = json.Marshal(BuildLogEntry{Timestamp: e.Timestamp, Level: "warn", Message: fmt.Sprintf("the log file reached %d MiB: later lines are not kept on disk", maxBuildLogFileBytes>>20), Step: e.Step})
		r.logBytes = maxBuildLogFileBytes
	}
	n, _ := r.logf.Write(append(line, '\n'))
	r.logBytes += int64(n)
}

// closeLog closes r's log file (the build ended).
func (bs *builds) closeLog(r *buildRec) {
	if r.logf != nil {
		r.logf.Close()
		r.logf = nil
	}
}

func (bs *builds) get(templateID, buildID string) (*buildRec, error) {
	r := bs.recs[buildID]
	if r == nil || r.b.TemplateID != templateID {
		return nil, fmt.Errorf("build %q of template %q: %w", buildID, templateID, errdefs.ErrNotFound)
	}
	return r, nil
}

// update applies f to the record of buildID under the lock and persists it when f says the
// status changed (log lines go to the log file: logTo).
func (bs *builds) update(buildID string, f func(b *TemplateBuild) (statusChanged bool)) {
	bs.mu.Lock()
	defer bs.mu.Unlock()
	r := bs.recs[buildID]
	if r == nil {
		return
	}
	changed := f(&r.b)
	r.b.UpdatedAt = time.Now().UTC()
	if r.b.Status == BuildReady || r.b.Status == BuildError {
		bs.closeLog(r)
	}
	if changed {
		_ = bs.write(r)
	}
}

// maxLogMessage bounds one log line (longer output lines are cut).
const maxLogMessage = 8 << 10

func (bs *builds) log(buildID, level, step, msg string) {
	if len(msg) > maxLogMessage {
		msg = strings.ToValidUTF8(msg[:maxLogMessage], "") + " [...]"
	}
	bs.mu.Lock()
	defer bs.mu.Unlock()
	if r := bs.recs[buildID]; r != nil {
		bs.appendLog(r, BuildLogEntry{Timestamp: time.Now().UTC(), Level: level, Message: msg, Step: step})
		r.b.UpdatedAt = time.Now().UTC()
	}
}

func newBuildID() string {
	h := randomHex(16)
	return h[:8] + "-" + h[8:12] + "-4" + h[13:16] + "-" + h[16:20] + "-" + h[20:]
}

// RequestBuild registers a build of req.Name (E2B's POST /v3/templates): a record in state
// waiting, started by StartBuild. A tag in the name ("name:tag") joins req.Tags.
func (m *Manager) RequestBuild(ctx context.Context, req BuildSpec) (*TemplateBuild, error) {
	name, tag := sandbox.SplitTemplateName(req.Name)
	if !nameRe.MatchString(name) {
		return nil, fmt.Errorf("invalid template name %q: use lowercase letters, digits, '.', '_' and '-': %w", name, errdefs.ErrInvalid)
	}
	tags := append([]string(nil), req.Tags...)
	if tag != "" {
		tags = append(tags, tag)
	}
	tags, err := cleanTags(tags)
	if err != nil {
		return nil, err
	}
	if old, err := m.cfg.Store.GetTemplate(ctx, name); err == nil && old.Kind == "snapshot" {
		return nil, fmt.Errorf("%q is a snapshot: %w", name, errdefs.ErrConflict)
	}
	now := time.Now().UTC()
	r := &buildRec{b: TemplateBuild{ID: newBuildID(), TemplateID: name, Team: req.Team, Status: BuildWaiting, Tags: tags,
		CPUCount: req.CPUCount, MemoryMB: req.MemoryMB, CreatedAt: now, UpdatedAt: now}}
	m.tb.mu.Lock()
	defer m.tb.mu.Unlock()
	if err := m.tb.write(r); err != nil {
		return nil, err
	}
	m.tb.recs[r.b.ID] = r
	out := r.b
	return &out, nil
}

func cleanTags(tags []string) ([]string, error) {
	if len(tags) > maxBuildTags {
		return nil, fmt.Errorf("at most %d tags: %w", maxBuildTags, errdefs.ErrInvalid)
	}
	seen := map[string]bool{}
	var out []string
	for _, t := range tags {
		if !tagRe.MatchString(t) {
			return nil, fmt.Errorf("invalid tag %q: %w", t, errdefs.ErrInvalid)
		}
		if !seen[t] {
			seen[t] = true
			out = append(out, t)
		}
	}
	return out, nil
}

// GetBuild returns a copy of a build's record.
func (m *Manager) GetBuild(ctx context.Context, templateID, buildID string) (*TemplateBuild, error) {
	m.tb.mu.Lock()
	defer m.tb.mu.Unlock()
	r, err := m.tb.get(templateID, buildID)
	if err != nil {
		return nil, err
	}
	out := r.b
	out.Logs = append([]BuildLogEntry(nil), r.b.Logs...)
	return &out, nil
}

// ListBuilds returns the builds of a template, newest first, without their logs.
func (m *Manager) ListBuilds(ctx context.Context, templateID string) ([]*TemplateBuild, error) {
	m.tb.mu.Lock()
	defer m.tb.mu.Unlock()
	var out []*TemplateBuild
	for _, r := range m.tb.recs {
		if templateID == "" || r.b.TemplateID == templateID { // "": every template's
			b := r.b
			b.Logs = nil
			out = append(out, &b)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].CreatedAt.After(out[j].CreatedAt) })
	return out, nil
}

// ---- uploaded files ----

func (m *Manager) buildFilesDir() string { return datadir.BuildFiles(m.cfg.DataDir) }

func (m *Manager) buildFile(hash string) (string, error) {
	if !filesHashRe.MatchString(hash) {
		return "", fmt.Errorf("files hash %q: must be 64 lowercase hex digits: %w", hash, errdefs.ErrInvalid)
	}
	return filepath.Join(m.buildFilesDir(), hash+".tar"), nil
}

// HasBuildFiles reports whether the files of a COPY step with this hash were uploaded.
func (m *Manager) HasBuildFiles(ctx context.Context, hash string) (bool, error) {
	p, err := m.buildFile(hash)
	if err != nil {
		return false, err
	}
	_, err = os.Stat(p)
	return err == nil, nil
}

// PutBuildFiles stores the tarball of a COPY step under its hash: written to a temporary file,
// bounded by MaxBuildFileBytes, then renamed into place (complete or absent).
func (m *Manager) PutBuildFiles(ctx context.Context, hash string, r io.Reader) error {
	p, err := m.buildFile(hash)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(m.buildFilesDir(), 0o700); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(m.buildFilesDir(), ".tmp-")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	limit := m.cfg.MaxBuildFileBytes
	n, err := io.Copy(tmp, io.LimitReader(r, limit+1))
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("upload files %s: %w", hash[:12], err)
	}
	if n > limit {
		return fmt.Errorf("upload files %s: larger than the limit of %d bytes: %w", hash[:12], limit, errdefs.ErrInvalid)
	}
	// Decompressed here, within the limits of a COPY archive, before it is kept.
	f, err := os.Open(tmp.Name())
	if err != nil {
		return err
	}
	err = checkCopyArchive(f)
	f.Close()
	if err != nil {
		return fmt.Errorf("upload files %s: %v: %w", hash[:12], err, errdefs.ErrInvalid)
	}
	return os.Rename(tmp.Name(), p)
}

// ---- tags ----

// AssignTags gives the build that name:fromTag names (the template's current build; fromTag
// "" or "latest" or one of its tags) the tags.
func (m *Manager) AssignTags(ctx context.Context, name, fromTag string, tags []string) (*Template, error) {
	tags, err := cleanTags(tags)
	if err != nil {
		return nil, err
	}
	if len(tags) == 0 {
		return nil, fmt.Errorf("no tags given: %w", errdefs.ErrInvalid)
	}
	release, err := m.reserveName(name, true)
	if err != nil {
		return nil, err
	}
	defer release()
	t, err := m.GetTemplate(ctx, name)
	if err != nil {
		return nil, err
	}
	if t.Kind != "template" {
		return nil, fmt.Errorf("%q is a snapshot: %w", name, errdefs.ErrInvalid)
	}
	if fromTag != "" && fromTag != "latest" && !t.HasTag(fromTag) {
		return nil, fmt.Errorf("template %q has no tag %q: %w", name, fromTag, errdefs.ErrNotFound)
	}
	t.Tags = mergeTags(t.Tags, tags, t.BuildID)
	if err := m.cfg.Store.PutTemplate(ctx, t); err != nil {
		return nil, err
	}
	return t, nil
}

// RemoveTags removes tags from a template.
func (m *Manager) RemoveTags(ctx context.Context, name string, tags []string) error {
	release, err := m.reserveName(name, true)
	if err != nil {
		return err
	}
	defer release()
	t, err := m.GetTemplate(ctx, name)
	if err != nil {
		return err
	}
	drop := map[string]bool{}
	for _, tg := range tags {
		if !t.HasTag(tg) {
			return fmt.Errorf("template %q has no tag %q: %w", name, tg, errdefs.ErrNotFound)
		}
		drop[tg] = true
	}
	var keep []TemplateTag
	for _, tg := range t.Tags {
		if !drop[tg.Tag] {
			keep = append(keep, tg)
		}
	}
	t.Tags = keep
	return m.cfg.Store.PutTemplate(ctx, t)
}

// mergeTags points tags (and the ones already there) at buildID.
func mergeTags(old []TemplateTag, tags []string, buildID string) []TemplateTag {
	now := time.Now().UTC()
	out := make([]TemplateTag, 0, len(old)+len(tags))
	seen := map[string]bool{}
	for _, tg := range old {
		seen[tg.Tag] = true
		tg.BuildID = buildID
		for _, n := range tags {
			if n == tg.Tag {
				tg.CreatedAt = now
			}
		}
		out = append(out, tg)
	}
	for _, n := range tags {
		if !seen[n] {
			seen[n] = true
			out = append(out, TemplateTag{Tag: n, BuildID: buildID, CreatedAt: now})
		}
	}
	return out
}
