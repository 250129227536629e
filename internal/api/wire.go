package api

import (
	"time"

	"github.com/ember-sandbox/ember/internal/sandbox"
)

// E2B wire types (E2B-PROTOCOL §2). Every field the SDKs' generated models mark required is
// always present.

type newSandboxRequest struct {
	TemplateID          string            `json:"templateID"`
	Timeout             *int64            `json:"timeout"`
	Metadata            map[string]string `json:"metadata"`
	EnvVars             map[string]string `json:"envVars"`
	AllowInternetAccess *bool             `json:"allow_internet_access"`
	AutoPause           *bool             `json:"autoPause"`
	AutoPauseMemory     *bool             `json:"autoPauseMemory"`
	AutoResume          *autoResumeJSON   `json:"autoResume"`
	Secure              *bool             `json:"secure"`
	VolumeMounts        []volumeMountJSON `json:"volumeMounts"`
}

type autoResumeJSON struct {
	Enabled *bool `json:"enabled"`
}

type sandboxJSON struct {
	SandboxID          string  `json:"sandboxID"`
	TemplateID         string  `json:"templateID"`
	ClientID           string  `json:"clientID"`
	EnvdVersion        string  `json:"envdVersion"`
	EnvdAccessToken    string  `json:"envdAccessToken,omitempty"`
	Domain             string  `json:"domain"`
	TrafficAccessToken *string `json:"trafficAccessToken"`
	Alias              string  `json:"alias,omitempty"`
}

type volumeMountJSON struct {
	Name string `json:"name"`
	Path string `json:"path"`
}

type listedSandboxJSON struct {
	SandboxID   string    `json:"sandboxID"`
	TemplateID  string    `json:"templateID"`
	Alias       string    `json:"alias,omitempty"`
	ClientID    string    `json:"clientID"`
	CPUCount    int       `json:"cpuCount"`
	MemoryMB    int       `json:"memoryMB"`
	DiskSizeMB  int       `json:"diskSizeMB"`
	StartedAt   time.Time `json:"startedAt"`
	EndAt       time.Time `json:"endAt"`
	EnvdVersion string    `json:"envdVersion"`
	State       string    `json:"state"`
	// PausedIn is ember's: where a paused sandbox is, "memory" (a resume thaws it), "disk" (a
	// resume restores it) or "store" (the cluster's image store).
	PausedIn     string            `json:"pausedIn,omitempty"`
	Metadata     map[string]string `json:"metadata"`
	VolumeMounts []volumeMountJSON `json:"volumeMounts"`
	// ember's, on sandboxes lost with their node (state "lost", listed on request only).
	Node       string     `json:"node,omitempty"`
	LostAt     *time.Time `json:"lostAt,omitempty"`
	LostReason string     `json:"lostReason,omitempty"`
}

type lifecycleJSON struct {
	OnTimeout  string `json:"onTimeout"`
	AutoResume bool   `json:"autoResume"`
}

type sandboxDetailJSON struct {
	listedSandboxJSON
	EnvdAccessToken     string         `json:"envdAccessToken,omitempty"`
	Domain              string         `json:"domain"`
	AllowInternetAccess *bool          `json:"allowInternetAccess"`
	Network             map[string]any `json:"network"`
	Lifecycle           lifecycleJSON  `json:"lifecycle"`
}

type metricJSON struct {
	Timestamp     time.Time `json:"timestamp"`
	TimestampUnix int64     `json:"timestampUnix"`
	CPUCount      int       `json:"cpuCount"`
	CPUUsedPct    float64   `json:"cpuUsedPct"`
	MemUsed       uint64    `json:"memUsed"`
	MemTotal      uint64    `json:"memTotal"`
	MemCache      uint64    `json:"memCache"`
	DiskUsed      uint64    `json:"diskUsed"`
	DiskTotal     uint64    `json:"diskTotal"`
}

// snapshotJSON is E2B's SnapshotInfo plus ember's state of the snapshot's image: "uploading"
// (usable on this node; the upload to the snapshot store runs), "stored", "failed" (error says
// why) or "local" (no snapshot store).
type snapshotJSON struct {
	SnapshotID string    `json:"snapshotID"`
	Names      []string  `json:"names"`
	SandboxID  string    `json:"sandboxID,omitempty"`
	CreatedAt  time.Time `json:"createdAt"`
	State      string    `json:"state"`
	Error      string    `json:"error,omitempty"`
}

type createSnapshotResponse struct {
	SnapshotID string   `json:"snapshotID"`
	Names      []string `json:"names"`
	State      string   `json:"state"`
}

type templateJSON struct {
	TemplateID    string     `json:"templateID"`
	BuildID       string     `json:"buildID"`
	CPUCount      int        `json:"cpuCount"`
	MemoryMB      int        `json:"memoryMB"`
	DiskSizeMB    int        `json:"diskSizeMB"`
	Public        bool       `json:"public"`
	Aliases       []string   `json:"aliases"`
	Names         []string   `json:"names"`
	CreatedAt     time.Time  `json:"createdAt"`
	UpdatedAt     time.Time  `json:"updatedAt"`
	CreatedBy     *string    `json:"createdBy"`
	LastSpawnedAt *time.Time `json:"lastSpawnedAt"`
	SpawnCount    int        `json:"spawnCount"`
	BuildCount    int        `json:"buildCount"`
	EnvdVersion   string     `json:"envdVersion"`
	BuildStatus   string     `json:"buildStatus"`
	Kind          string     `json:"kind"`
	// SnapshotState and SnapshotError: a snapshot's, as in snapshotJSON.
	SnapshotState string `json:"snapshotState,omitempty"`
	SnapshotError string `json:"snapshotError,omitempty"`
}

type forkResultJSON struct {
	Sandbox *sandboxJSON `json:"sandbox,omitempty"`
	Error   *errorBody   `json:"error,omitempty"`
}

// resources is the service's templateResourcer, if it is one.
func (s *server) resources() templateResourcer {
	r, _ := s.shared.(templateResourcer)
	return r
}

func (s *server) toSandbox(sb *sandbox.Sandbox) sandboxJSON {
	return sandboxJSON{
		SandboxID:          sb.ID,
		TemplateID:         sb.TemplateID,
		ClientID:           s.cfg.ClientID,
		EnvdVersion:        sandbox.EnvdVersion,
		EnvdAccessToken:    sb.AccessToken,
		Domain:             s.cfg.Domain,
		TrafficAccessToken: trafficToken(sb),
		Alias:              sb.Alias,
	}
}

func (s *server) toListed(sb *sandbox.Sandbox) listedSandboxJSON {
	md := sb.Metadata
	if md == nil {
		md = map[string]string{}
	}
	return listedSandboxJSON{
		SandboxID:    sb.ID,
		TemplateID:   sb.TemplateID,
		Alias:        sb.Alias,
		ClientID:     s.cfg.ClientID,
		CPUCount:     sb.CPUCount,
		MemoryMB:     sb.MemoryMB,
		DiskSizeMB:   sb.DiskSizeMB,
		StartedAt:    sb.StartedAt.UTC(),
		EndAt:        sb.EndAt.UTC(),
		EnvdVersion:  sandbox.EnvdVersion,
		State:        string(sb.State),
		PausedIn:     sb.Tier(),
		Metadata:     md,
		VolumeMounts: volumeMountsJSON(sb),
	}
}

func (s *server) toDetail(sb *sandbox.Sandbox) sandboxDetailJSON {
	onTimeout := "kill"
	if sb.AutoPause {
		onTimeout = "pause"
	}
	allow := sb.AllowInternet
	return sandboxDetailJSON{
		listedSandboxJSON:   s.toListed(sb),
		EnvdAccessToken:     sb.AccessToken,
		Domain:              s.cfg.Domain,
		AllowInternetAccess: &allow,
		Network:             networkInfo(sb),
		Lifecycle:           lifecycleJSON{OnTimeout: onTimeout, AutoResume: sb.AutoResume},
	}
}

func toMetric(m sandbox.Metric) metricJSON {
	return metricJSON{
		Timestamp:     m.Timestamp.UTC(),
		TimestampUnix: m.Timestamp.Unix(),
		CPUCount:      m.CPUCount,
		CPUUsedPct:    m.CPUUsedPct,
		MemUsed:       m.MemUsed,
		MemTotal:      m.MemTotal,
		MemCache:      m.MemCache,
		DiskUsed:      m.DiskUsed,
		DiskTotal:     m.DiskTotal,
	}
}

func templateNames(t *sandbox.Template) []string {
	if len(t.Names) > 0 {
		return append([]string(nil), t.Names...)
	}
	if len(t.Aliases) > 0 {
		return append([]string(nil), t.Aliases...)
	}
	return []string{}
}

func toSnapshot(t *sandbox.Template) snapshotJSON {
	return snapshotJSON{
		SnapshotID: t.ID,
		Names:      templateNames(t),
		SandboxID:  t.SourceSandbox,
		CreatedAt:  t.CreatedAt.UTC(),
		State:      t.UploadState(),
		Error:      t.SnapshotError,
	}
}

// templateResourcer is implemented by services that know the resources a template's sandboxes
// get when the template sets none (*sandbox.Manager).
type templateResourcer interface {
	TemplateResources(t *sandbox.Template) (cpu, memoryMB, diskMB int)
}

// toTemplate is E2B's Template. The e2b CLI's `template list` shows its aliases as the name and
// its cpuCount, memoryMB and diskSizeMB: a template's names (or its id, which is its name) stand
// for its aliases when it has none of its own, and res (when not nil) fills in the node's default resources.
func toTemplate(t *sandbox.Template, res templateResourcer) templateJSON {
	aliases := append([]string{}, t.Aliases...)
	if len(aliases) == 0 {
		aliases = templateNames(t)
	}
	if len(aliases) == 0 && t.Kind != "snapshot" {
		aliases = []string{t.ID} // a template's id is its name
	}
	status := "building"
	if t.Ready {
		status = "ready"
	}
	kind := t.Kind
	if kind == "" {
		kind = "template"
	}
	buildID := t.BuildID
	if buildID == "" {
		buildID = t.ID
	}
	cpu, mem, disk := t.CPUCount, t.MemoryMB, t.DiskMB
	if res != nil {
		cpu, mem, disk = res.TemplateResources(t)
	}
	return templateJSON{
		Public:        t.Public,
		TemplateID:    t.ID,
		BuildID:       buildID,
		CPUCount:      cpu,
		MemoryMB:      mem,
		DiskSizeMB:    disk,
		Aliases:       aliases,
		Names:         templateNames(t),
		CreatedAt:     t.CreatedAt.UTC(),
		UpdatedAt:     t.CreatedAt.UTC(),
		BuildCount:    1,
		EnvdVersion:   sandbox.EnvdVersion,
		BuildStatus:   status,
		Kind:          kind,
		SnapshotState: t.UploadState(),
		SnapshotError: t.SnapshotError,
	}
}
