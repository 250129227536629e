package sandbox

import "time"

// Stage names a timed step of the sandbox lifecycle, as the Manager reports it to its Observer.
type Stage string

// The stages the Manager times.
const (
	StageCreatePool     Stage = "create_pool"       // create served by a warm pool instance
	StageCreateRestore  Stage = "create_checkpoint" // create restoring a template or snapshot checkpoint
	StageCreateBoot     Stage = "cold_boot"         // create booting a rootfs
	StagePause          Stage = "pause"
	StageResume         Stage = "resume"
	StageFork           Stage = "fork" // the whole fork: checkpoint and every child
	StageSnapshot       Stage = "snapshot_capture"
	StageSnapshotUpload Stage = "snapshot_upload" // chunking and upload, in the background
	StageTemplateBuild  Stage = "template_build"
	StageCheckpoint     Stage = "checkpoint" // a step checkpoint (checkpoints.go)
	StageRollback       Stage = "rollback"
)

// Observer is told how long each stage took and whether it failed (err != nil). The daemon
// wires metrics into it; the default does nothing. Implementations must be safe for concurrent
// use and must not block: they are called on the request path.
type Observer interface {
	ObserveStage(stage Stage, took time.Duration, err error)
}

type nopObserver struct{}

func (nopObserver) ObserveStage(Stage, time.Duration, error) {}

// observe reports a stage that started at start.
func (m *Manager) observe(stage Stage, start time.Time, err error) {
	m.cfg.Observer.ObserveStage(stage, time.Since(start), err)
}

// Stages lists every Stage, in lifecycle order.
var Stages = []Stage{StageCreatePool, StageCreateRestore, StageCreateBoot, StagePause, StageResume, StageFork,
	StageSnapshot, StageSnapshotUpload, StageTemplateBuild, StageCheckpoint, StageRollback}
