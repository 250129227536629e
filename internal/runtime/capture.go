package runtime

import "context"

// LayerCapturer is implemented by drivers that can checkpoint a running instance with its
// writable layer kept out of the image, as a read-only layer of its own: every instance restored
// from that image then stacks a fresh, empty writable layer over it instead of getting a copy of
// the layer (a fork's children share what the source had written; each writes only its own).
type LayerCapturer interface {
	// CapturesLayers reports whether CheckpointToLayer works with this driver's configuration.
	CapturesLayers() bool
	// CheckpointToLayer is Checkpoint with LeaveRunning, except that the instance's writable
	// layer as it was at the checkpoint goes to layerDir (it must not exist; the driver creates
	// it), not into imageDir. It returns top, the root of that read-only layer: the image
	// restores (Restore, Prestart) onto the stack top, then the instance's own RootFS and
	// Lowers, with an empty writable layer. Nothing writes layerDir afterwards; the instance
	// keeps running on its own writable layer. On error layerDir is absent.
	CheckpointToLayer(ctx context.Context, id, imageDir, layerDir string) (top string, err error)
	// OpenCapturedLayer makes layerDir usable as a layer again where what it needs on the host
	// is gone (its mount, after a host restart) and returns its top. Idempotent.
	OpenCapturedLayer(ctx context.Context, layerDir string) (top string, err error)
	// CloseCapturedLayer releases what layerDir holds on the host (its mount) and keeps its
	// files, for OpenCapturedLayer to open again. Call it only while no running instance
	// stacks it. Idempotent.
	CloseCapturedLayer(ctx context.Context, layerDir string) error
	// RemoveCapturedLayer deletes layerDir and releases what it holds on the host. Call it
	// only once no instance stacks it. Idempotent: an absent layerDir is fine.
	RemoveCapturedLayer(ctx context.Context, layerDir string) error
}
