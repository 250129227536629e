package sandbox

import (
	"time"
)

// State of a sandbox as users see it.
type State string

const (
	StateRunning State = "running"
	StatePaused  State = "paused"
	// StateKilled sandboxes are gone; they are kept (in memory and the store) for a while as
	// tombstones, so that calls to them answer 404 with the reason (EndReason), and are listed
	// only when asked for.
	StateKilled State = "killed"
)

// TemplateFormat is the format of the checkpoints this ember writes. It changes when an
// instance's runtime spec changes in a way a checkpoint of the old one cannot be restored
// under (2: a fixed in-sandbox process limit, per-sandbox disk images, nosuid layers; 3: the
// rootfs is a stack of layers, the template's own over its image's, see Template.Lowers).
const TemplateFormat = 3

// Stale reports whether t was built by an ember whose checkpoints this one cannot restore.
func (t *Template) Stale() bool { return t.Kind == "template" && t.Format < TemplateFormat }

// DefaultTimeout is a sandbox's lifetime when the caller sets none.
const DefaultTimeout = 300 * time.Second

// MaxTimeout bounds the timeout a caller may ask for.
const MaxTimeout = 24 * time.Hour

// EnvdVersion is the envd protocol version ember's envd implements (gates SDK features).
const EnvdVersion = "0.6.4"

// Sandbox is the user-visible record of one sandbox. It is what the store persists.
type Sandbox struct {
	ID string `json:"id"`
	// Team owns the sandbox (auth.Owner: "" is the default team's); its snapshots, forks and
	// checkpoints are the team's too.
	Team        string            `json:"team,omitempty"`
	TemplateID  string            `json:"templateId"`
	Alias       string            `json:"alias,omitempty"`
	State       State             `json:"state"`
	Metadata    map[string]string `json:"metadata,omitempty"`
	EnvVars     map[string]string `json:"envVars,omitempty"`
	AccessToken string            `json:"accessToken"`
	StartedAt   time.Time         `json:"startedAt"`
	EndAt       time.Time         `json:"endAt"`
	CPUCount    int               `json:"cpuCount"`
	MemoryMB    int               `json:"memoryMB"`
	DiskSizeMB  int               `json:"diskSizeMB"`
	// AutoPause: on timeout pause instead of kill. PauseDropsMemory makes that pause keep only
	// the filesystem (E2B's onTimeout {action: 'pause', keepMemory: false}). AutoResume: traffic
	// to any of its ports wakes a paused sandbox (memory pauses only).
	AutoPause        bool `json:"autoPause"`
	PauseDropsMemory bool `json:"pauseDropsMemory,omitempty"`
	AutoResume       bool `json:"autoResume,omitempty"`
	// PausedFilesOnly: the current pause kept the filesystem only; resume boots on it.
	PausedFilesOnly bool `json:"pausedFilesOnly,omitempty"`
	// PausedIn is where a paused sandbox is (TierMemory, TierDisk, TierStore; hotpause.go):
	// what its resume starts from. Empty while it runs, and in records of an older ember (disk).
	PausedIn string `json:"pausedIn,omitempty"`
	// RootFS is the template rootfs the sandbox runs on, kept so that it can be resumed,
	// snapshotted and forked after its template (or snapshot) is deleted.
	RootFS string `json:"rootfs,omitempty"`
	// Lowers are the read-only layers below RootFS (top first) that the sandbox runs on.
	Lowers []string `json:"lowers,omitempty"`
	// Timeout is the lifetime asked for at create (used again by an auto-resume).
	Timeout time.Duration `json:"timeout,omitempty"`
	// AllowInternet: egress to the internet (NAT); false denies every address except those in
	// Network.AllowOut (E2B: as denyOut 0.0.0.0/0). The daemon reaches envd either way.
	AllowInternet bool `json:"allowInternet"`
	// Network: egress lists and guest-port controls (E2B's network config; network.go).
	Network *NetworkConfig `json:"network,omitempty"`
	// VolumeMounts: volumes mounted read-write (volumemounts.go); kept for resume and fork.
	VolumeMounts []VolumeMount `json:"volumeMounts,omitempty"`

	// EndReason and EndedAt say why and when a sandbox ended (State killed): "killed",
	// "timeout", "out of memory", "exited", ... (see EndKilled and runtime.ExitReason).
	EndReason string    `json:"endReason,omitempty"`
	EndedAt   time.Time `json:"endedAt,omitzero"`

	// CheckpointHead is the step checkpoint the sandbox was last taken at or rolled back to:
	// the parent of its next checkpoint (checkpoints.go). Empty before its first.
	CheckpointHead string `json:"checkpointHead,omitempty"`

	// Runtime placement: which driver instance and network slot the sandbox uses now.
	Runtime Placement `json:"runtime"`
}

// Placement is where a running sandbox lives on this node. Empty while paused.
type Placement struct {
	Driver     string `json:"driver,omitempty"`
	InstanceID string `json:"instanceId,omitempty"`
	SlotIndex  int    `json:"slotIndex"`
	GuestIP    string `json:"guestIp,omitempty"`
	StateDir   string `json:"stateDir,omitempty"`
	// Image is the checkpoint a paused sandbox resumes from. For a sandbox paused in memory
	// (its instance frozen, the fields above kept) it is set once the background checkpoint is
	// complete: the image a demotion keeps.
	Image string `json:"image,omitempty"`
	// HotImage, for a sandbox paused in memory, is where its background checkpoint writes (the
	// one image of this pause that reconcile may use once it is marked complete).
	HotImage string `json:"hotImage,omitempty"`
}

// CreateRequest is what a caller asks for when creating a sandbox.
type CreateRequest struct {
	TemplateID string
	Team       string        // the team the sandbox belongs to
	Timeout    time.Duration // 0 = DefaultTimeout
	Metadata   map[string]string
	EnvVars    map[string]string
	AutoPause  bool
	// AutoPauseMemory: with AutoPause, whether the pause keeps memory (nil = true).
	AutoPauseMemory *bool
	// AutoResume: traffic wakes the sandbox when paused (nil = false).
	AutoResume    *bool
	AllowInternet *bool // nil = default (true)
	// Network: egress lists and guest-port controls; nil = E2B's defaults. ValidateNetwork it.
	Network *NetworkConfig
	// Cold boots the template's rootfs instead of restoring its checkpoint (benchmarks, fallback).
	Cold bool
	// NoPool skips the warm pools (restored and pre-started) and restores the template's
	// checkpoint into a new instance (benchmarks).
	NoPool bool
	// NoRestoredPool skips the restored pool only: a pre-started instance serves the create
	// when one is ready (benchmarks: a pool miss).
	NoRestoredPool bool
	// Reservation is the cluster placement reservation the create consumes (told to the
	// listeners with EventStarted).
	Reservation string
	// VolumeMounts: volumes to mount (resolved by the caller; volumemounts.go). A create with
	// volumes skips the warm pools: their instances were made without the mounts.
	VolumeMounts []VolumeMount
}

// PauseOptions tune a pause.
type PauseOptions struct {
	// KeepMemory: checkpoint memory and files (the default); false keeps the filesystem only,
	// and resume boots the sandbox again on its files.
	KeepMemory bool
	// NoPrestart: no instance is pre-started for the resume (benchmarks).
	NoPrestart bool
	// LayerFirst: the answer waits until the instance's layer is in the pause image, as pauses
	// did before they answered on the memory image alone (benchmarks, for the A/B).
	LayerFirst bool
	// Mode overrides Config.PauseMode for this pause (PauseHot, PauseCheckpoint; "" = the
	// node's): benchmarks compare both in one run.
	Mode string
}

// ConnectOptions tune Connect.
type ConnectOptions struct {
	Timeout time.Duration // 0 = DefaultTimeout
	// Reboot resumes a paused sandbox by booting it on its files, dropping any memory state.
	Reboot bool
}

// Messages of the lifecycle combinations E2B refuses (the SDK's own wording).
const (
	msgKeepMemoryNeedsPause  = "onTimeout.keepMemory is only allowed when action is 'pause'."
	msgAutoResumeNeedsPause  = "autoResume can only be true when onTimeout action is 'pause'."
	msgAutoResumeNeedsMemory = "autoResume: true is not a valid value when keepMemory: false - a filesystem-only snapshot cannot be auto-resumed by traffic and must be resumed explicitly using Sandbox.connect()."
)

// ListFilter selects sandboxes for List.
type ListFilter struct {
	Metadata     map[string]string // all must match
	States       []State           // empty = running and paused
	TemplateID   string
	StartedAfter time.Time
}

// Template is a sandbox template (or a named snapshot, which can be used as one).
type Template struct {
	ID      string   `json:"id"`
	Aliases []string `json:"aliases,omitempty"`
	Kind    string   `json:"kind"` // "template" or "snapshot"
	// Team owns the template ("" : the default team's, or public for a built-in one); Public
	// makes it readable and usable by every team.
	Team   string `json:"team,omitempty"`
	Public bool   `json:"public,omitempty"`
	// VolumeMounts: a snapshot's source's volumes; its checkpoint restores only with them
	// (volumemounts.go).
	VolumeMounts []VolumeMount `json:"volumeMounts,omitempty"`
	// RootFS is the template's own (top) layer; Lowers the read-only layers below it, top first
	// (its image's, shared with other templates). The rootfs is their overlay stack; without
	// Lowers, RootFS alone (a template of an older ember).
	RootFS    string    `json:"rootfs"`
	Lowers    []string  `json:"lowers,omitempty"`
	Image     string    `json:"image,omitempty"` // warm checkpoint, if any
	CreatedAt time.Time `json:"createdAt"`
	Ready     bool      `json:"ready"`
	CPUCount  int       `json:"cpuCount"`
	MemoryMB  int       `json:"memoryMB"`
	DiskMB    int       `json:"diskMB"`
	// InitToken is the envd access token the image's envd already holds (a snapshot keeps its
	// source's token); /init of a sandbox restored from the image authenticates with it.
	InitToken string `json:"initToken,omitempty"`
	// SnapshotStored: the image lives in the snapshot store (content-addressed chunks); Image is
	// then its node-local, verified copy.
	SnapshotStored bool `json:"snapshotStored,omitempty"`
	// SnapshotState is where a named snapshot's image is: SnapshotUploading while it goes to
	// the snapshot store in the background (sandboxes are created from its node-local capture,
	// Image, meanwhile), SnapshotStoredState once it is there, SnapshotFailed when the upload
	// gave up (SnapshotError says why; the node-local capture still serves this node). Empty for
	// templates and for records written before the state existed (see UploadState).
	SnapshotState string `json:"snapshotState,omitempty"`
	SnapshotError string `json:"snapshotError,omitempty"`
	// Env, User and Workdir are the defaults of every sandbox of the template (from an image's
	// config); empty User means "user", empty Workdir the user's home.
	Env     map[string]string `json:"env,omitempty"`
	User    string            `json:"user,omitempty"`
	Workdir string            `json:"workdir,omitempty"`
	// Format is the checkpoint format the template was built with (TemplateFormat then);
	// an older one does not restore under this ember and is rebuilt.
	Format int `json:"format,omitempty"`
	// BuildID changes on every rebuild.
	BuildID string `json:"buildId,omitempty"`
	// LoadedFrom is the store id of the image a template built on another node was loaded
	// from (portable.go); empty for one built here.
	LoadedFrom string `json:"loadedFrom,omitempty"`
	// SourceSandbox is the sandbox a snapshot was taken from.
	SourceSandbox string   `json:"sourceSandbox,omitempty"`
	Names         []string `json:"names,omitempty"`
	// BuildKey identifies what a step build made the template from (parent, steps, files,
	// start and ready commands, resources): a rebuild with the same key is a cache hit.
	BuildKey string `json:"buildKey,omitempty"`
	// Tags name builds of the template (E2B's name:tag); every tag names the current build.
	Tags []TemplateTag `json:"tags,omitempty"`
}

// TemplateTag is one tag of a template.
type TemplateTag struct {
	Tag       string    `json:"tag"`
	BuildID   string    `json:"buildId"`
	CreatedAt time.Time `json:"createdAt"`
}

// States of a named snapshot's image (Template.SnapshotState).
const (
	SnapshotUploading   = "uploading"
	SnapshotStoredState = "stored"
	SnapshotFailed      = "failed"
	// SnapshotLocal: no snapshot store is configured; the image lives on this node only.
	SnapshotLocal = "local"
)

// UploadState is a snapshot's SnapshotState ("" for a template), with records written before
// the state existed read as stored or local.
func (t *Template) UploadState() string {
	switch {
	case t.Kind != "snapshot":
		return ""
	case t.SnapshotState != "":
		return t.SnapshotState
	case t.SnapshotStored:
		return SnapshotStoredState
	}
	return SnapshotLocal
}

// Metric is one resource-usage sample of a sandbox.
type Metric struct {
	Timestamp  time.Time
	CPUCount   int
	CPUUsedPct float64
	MemUsed    uint64
	MemTotal   uint64
	MemCache   uint64
	DiskUsed   uint64
	DiskTotal  uint64
}

// ForkResult is one child of a fork: a sandbox or the error that prevented it.
type ForkResult struct {
	Sandbox *Sandbox
	Err     error
}
