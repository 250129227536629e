package sandbox

import (
	"fmt"
	"path"
	"strings"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

// Volumes in sandboxes (E2B's volumeMounts): the caller (the API, through internal/volume)
// resolves each volume's name to its id and host directory; the sandbox keeps them in its
// record, and every launch of it (create, resume, fork children) bind-mounts them read-write.
// runsc restores a checkpoint only under the mounts it was taken with ("Mounts" does not match
// across checkpoint restore), so a create with volumes cannot use the template's checkpoint
// (nor a pool's or a pre-started instance): it boots the template's rootfs with the mounts.
// Its own checkpoints (pause, fork) carry the mounts, and their restores give them again.

// VolumeMount is one volume mounted in a sandbox.
type VolumeMount struct {
	Name    string `json:"name"`
	Path    string `json:"path"`
	ID      string `json:"id"`
	HostDir string `json:"hostDir"`
}

// reservedMountPaths cannot take a volume (the runtime's own mounts, or the whole root).
var reservedMountPaths = []string{"/proc", "/dev", "/sys"}

// ValidateVolumeMounts checks the guest paths of mounts: absolute, clean, not the root or a
// system directory, no two the same.
func ValidateVolumeMounts(mounts []VolumeMount) error {
	seen := map[string]bool{}
	for _, v := range mounts {
		p := v.Path
		switch {
		case v.Name == "":
			return fmt.Errorf("volume mount: name is required: %w", errdefs.ErrInvalid)
		case !strings.HasPrefix(p, "/") || path.Clean(p) != p || strings.ContainsRune(p, 0):
			return fmt.Errorf("volume mount path %q: must be an absolute, clean path: %w", p, errdefs.ErrInvalid)
		case p == "/":
			return fmt.Errorf("volume mount path %q: cannot mount over the root: %w", p, errdefs.ErrInvalid)
		case seen[p]:
			return fmt.Errorf("volume mount path %q: used twice: %w", p, errdefs.ErrInvalid)
		}
		for _, r := range reservedMountPaths {
			if p == r || strings.HasPrefix(p, r+"/") {
				return fmt.Errorf("volume mount path %q: %s is reserved: %w", p, r, errdefs.ErrInvalid)
			}
		}
		seen[p] = true
	}
	return nil
}

// binds are the runtime bind mounts of mounts.
func binds(mounts []VolumeMount) []runtime.Bind {
	var out []runtime.Bind
	for _, v := range mounts {
		out = append(out, runtime.Bind{Source: v.HostDir, Path: v.Path})
	}
	return out
}

// UsesVolume reports whether sb mounts volume id.
func (sb *Sandbox) UsesVolume(id string) bool {
	for _, v := range sb.VolumeMounts {
		if v.ID == id {
			return true
		}
	}
	return false
}
