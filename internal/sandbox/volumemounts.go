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
// Its own checkpoints (pause, fork, snapshots) carry the mounts, and their restores give them
// again: a sandbox created from a snapshot mounts its source's volumes at the same paths.

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

// binds are the runtime bind mounts of mounts; dir, when set, gives each volume's host
// directory on this node (Config.VolumeDir: a cluster's volumes, in a filesystem the nodes
// share, mounted Remote).
func binds(mounts []VolumeMount, dir func(id string) string) []runtime.Bind {
	var out []runtime.Bind
	for _, v := range mounts {
		src := v.HostDir
		if dir != nil {
			src = dir(v.ID)
		}
		out = append(out, runtime.Bind{Source: src, Path: v.Path, Remote: dir != nil})
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

// mountsFor is the mounts of a sandbox created from tpl with the mounts asked for: a
// snapshot's checkpoint restores only with its source's volumes, so they are the default, and
// other volumes are refused (a boot would lose the snapshot's memory and files).
func mountsFor(tpl *Template, asked []VolumeMount) ([]VolumeMount, error) {
	if tpl.Kind != "snapshot" || (len(tpl.VolumeMounts) == 0 && len(asked) == 0) {
		return asked, nil
	}
	if len(asked) == 0 {
		return append([]VolumeMount(nil), tpl.VolumeMounts...), nil
	}
	same := len(asked) == len(tpl.VolumeMounts)
	for i := 0; same && i < len(asked); i++ {
		same = asked[i].ID == tpl.VolumeMounts[i].ID && asked[i].Path == tpl.VolumeMounts[i].Path
	}
	if !same {
		return nil, fmt.Errorf("snapshot %q restores only with the volumes of the sandbox it was taken from, mounted at the same paths (give no volumeMounts, or the same): %w", tpl.ID, errdefs.ErrInvalid)
	}
	return asked, nil
}
