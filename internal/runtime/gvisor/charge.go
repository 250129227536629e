package gvisor

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// MemoryCharge is the host memory the instance's cgroup is charged for (its sentry, gofer and
// stubs, and the sentry's memory file): cgroup v2 memory.current or v1 memory.usage_in_bytes.
// The Manager's warm pools count their instances at this cost.
func (d *Driver) MemoryCharge(ctx context.Context, id string) (uint64, error) {
	if err := validateID(id); err != nil {
		return 0, err
	}
	for _, dir := range d.instanceCgroups(id) {
		for _, name := range []string{"memory.current", "memory.usage_in_bytes"} {
			b, err := os.ReadFile(filepath.Join(dir, name))
			if err != nil {
				continue
			}
			return strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
		}
	}
	return 0, fmt.Errorf("gvisor: memory charge of %s: no memory cgroup: %w", id, errdefs.ErrNotFound)
}
