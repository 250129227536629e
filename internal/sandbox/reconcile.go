package sandbox

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/runtime"
)

// reconcile makes the in-memory state match the store and the store match what really runs:
// running sandboxes whose instance still runs are re-adopted, the others are released and
// forgotten; paused sandboxes stay resumable; instances, network slots and directories that no
// record owns (leftovers of a crash) are removed.
func (m *Manager) reconcile(ctx context.Context) error {
	sbs, err := m.cfg.Store.ListSandboxes(ctx)
	if err != nil {
		return err
	}
	keepSlots := []int{}
	keepInstances := map[string]bool{}
	keepDirs := map[string]bool{}
	for _, sb := range sbs {
		log := m.logger(sb.ID)
		switch sb.State {
		case StateRunning:
			st, err := m.cfg.Driver.State(ctx, sb.Runtime.InstanceID)
			if err == nil && st.State == runtime.StateRunning {
				if _, err := m.cfg.Network.Adopt(sb.Runtime.SlotIndex, sb.Egress()); err == nil {
					keepSlots = append(keepSlots, sb.Runtime.SlotIndex)
					keepInstances[sb.Runtime.InstanceID] = true
					keepDirs[sb.ID] = true
					m.live[sb.ID] = &entry{sb: sb}
					m.guestT.open(sb.Runtime.GuestIP)
					log.Info("re-adopted running sandbox")
					continue
				} else {
					log.Warn("network slot of running sandbox is gone", "err", err)
				}
			}
			log.Warn("sandbox no longer runs; releasing it", "state_err", err)
			m.destroy(ctx, sb)
			m.cfg.Store.DeleteSandbox(ctx, sb.ID)
		case StatePaused:
			if _, err := os.Stat(sb.Runtime.Image); err != nil {
				log.Warn("paused sandbox lost its image; forgetting it", "err", err)
				m.cfg.Store.DeleteSandbox(ctx, sb.ID)
				os.RemoveAll(m.sandboxDir(sb.ID))
				continue
			}
			keepDirs[sb.ID] = true
			m.live[sb.ID] = &entry{sb: sb}
			// Run directories of the instance it was paused from (release interrupted by a crash).
			runs, _ := filepath.Glob(filepath.Join(m.sandboxDir(sb.ID), "run-*"))
			for _, r := range runs {
				removeTree(r)
			}
		default:
			m.cfg.Store.DeleteSandbox(ctx, sb.ID)
			os.RemoveAll(m.sandboxDir(sb.ID))
		}
	}
	ids, err := m.cfg.Driver.List(ctx)
	if err != nil {
		return fmt.Errorf("list instances: %w", err)
	}
	for _, id := range ids {
		if !keepInstances[id] {
			m.log.Info("removing orphan instance", "instance", id)
			if err := m.cfg.Driver.Delete(ctx, id); err != nil {
				m.log.Warn("delete orphan instance", "instance", id, "err", err)
			}
		}
	}
	if err := m.cfg.Network.Reconcile(ctx, keepSlots); err != nil {
		return fmt.Errorf("network: %w", err)
	}
	entries, _ := os.ReadDir(filepath.Join(m.cfg.DataDir, "sandboxes"))
	for _, e := range entries {
		if !keepDirs[e.Name()] {
			removeTree(filepath.Join(m.cfg.DataDir, "sandboxes", e.Name()))
		}
	}
	removeTree(filepath.Join(m.cfg.DataDir, "pool"))
	// Unfinished fork images are useless after a restart.
	imgs, _ := os.ReadDir(filepath.Join(m.cfg.DataDir, "images"))
	for _, e := range imgs {
		if len(e.Name()) > 5 && e.Name()[:5] == "fork-" {
			os.RemoveAll(filepath.Join(m.cfg.DataDir, "images", e.Name()))
		}
	}
	return nil
}

// removeTree unmounts whatever is mounted under dir (a crashed instance's rootfs) and removes it.
func removeTree(dir string) {
	data, _ := os.ReadFile("/proc/self/mounts")
	var points []string
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) > 1 && strings.HasPrefix(f[1], dir+"/") {
			points = append(points, f[1])
		}
	}
	for i := len(points) - 1; i >= 0; i-- {
		unix.Unmount(points[i], unix.MNT_DETACH)
	}
	os.RemoveAll(dir)
}
