package gvisor

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// SetCPUWeight sets the instance's CPU weight against the node's other instances, in cgroup v2
// units (1–10000, 100 the default): cpu.weight, or on cgroup v1 cpu.shares (weight × 1024 /
// 100). The Manager lowers it for pool refills and restores it when a sandbox takes the
// instance.
func (d *Driver) SetCPUWeight(ctx context.Context, id string, weight int) error {
	if err := validateID(id); err != nil {
		return err
	}
	if weight < 1 || weight > 10000 {
		return fmt.Errorf("gvisor: cpu weight %d: not in 1..10000: %w", weight, errdefs.ErrInvalid)
	}
	set := false
	for _, dir := range d.instanceCgroups(id) {
		for _, f := range []struct {
			name string
			v    int
		}{{"cpu.weight", weight}, {"cpu.shares", max(2, weight*1024/100)}} {
			// Only where the file exists: cgroupfs refuses to create one (EACCES).
			path := filepath.Join(dir, f.name)
			if _, err := os.Stat(path); errors.Is(err, fs.ErrNotExist) {
				continue
			}
			if err := os.WriteFile(path, []byte(strconv.Itoa(f.v)), 0o644); err != nil {
				return fmt.Errorf("gvisor: set %s of %s: %w", f.name, id, err)
			}
			set = true
		}
	}
	if !set {
		return fmt.Errorf("gvisor: cpu weight of %s: no cpu cgroup: %w", id, errdefs.ErrNotFound)
	}
	return nil
}
