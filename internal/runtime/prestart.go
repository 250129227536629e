package runtime

import "context"

// Prestarter is implemented by drivers that can create an instance ahead of time and restore a
// checkpoint image into it later, so that the runtime's process creation, mounts, network
// namespace join and platform set-up are off the restore's critical path. A pre-started instance
// runs nothing and is used once: RestoreInto it, or Delete it (then Release its StateDir) to
// discard it. Drivers without support do not implement it; callers fall back to Restore.
type Prestarter interface {
	// Prestart creates the instance spec describes (its id, state directory, network namespace,
	// hostname, env, limits and cgroup are fixed from here on) with the writable layer of
	// imageDir, an image written by Checkpoint: cloned in, or moved with spec.ConsumeImage as
	// Restore does (deleting the instance before the caller removes the image gives the layer
	// back); imageDir "" gives it an empty layer. Nothing runs in it until RestoreInto.
	Prestart(ctx context.Context, spec Spec, imageDir string) error
	// RestoreInto restores imageDir into the pre-started instance id: it then runs the
	// checkpointed processes, as after Restore. imageDir must be the image the instance was
	// pre-started with (its files and memory must agree): another is ErrInvalid. A second
	// RestoreInto of one instance, or of one that is not pre-started, is ErrConflict.
	RestoreInto(ctx context.Context, id, imageDir string) error
}

// MemoryReducer is implemented by drivers that can make a running instance give memory back to
// the host without changing what runs in it (e.g. collect the garbage a restore leaves in
// gVisor's sentry). Callers use it off the critical path, once an instance is idle.
type MemoryReducer interface {
	ReduceMemory(ctx context.Context, id string) error
}
