package gvisor

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/ember-sandbox/ember/internal/overlayfs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

// ownCgroupDirs returns the directory of the calling process's cgroup in every mounted hierarchy
// (cgroup v1 controllers, named hierarchies and v2). runsc resolves a relative CgroupsPath
// against these, so an instance's cgroups are <dir>/<CgroupParent>/<id>.
func ownCgroupDirs() []string {
	type mnt struct{ root, point string }
	mounts := map[string]mnt{} // controller or "name=x" or "" (v2) -> mount
	table, err := overlayfs.Mounts()
	if err != nil {
		return nil
	}
	for _, mt := range table {
		m := mnt{root: mt.Root, point: mt.Point}
		switch mt.FSType {
		case "cgroup2":
			mounts[""] = m
		case "cgroup":
			for _, o := range strings.Split(mt.SuperOptions, ",") {
				mounts[o] = m
			}
		}
	}
	cg, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return nil
	}
	var dirs []string
	seen := map[string]bool{}
	for _, line := range strings.Split(strings.TrimSpace(string(cg)), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 {
			continue
		}
		for _, ctrl := range strings.Split(parts[1], ",") {
			m, ok := mounts[ctrl]
			if !ok {
				continue
			}
			rel := parts[2]
			if m.root != "/" {
				rel = strings.TrimPrefix(rel, m.root)
			}
			dir := filepath.Join(m.point, rel)
			if !seen[dir] {
				seen[dir] = true
				dirs = append(dirs, dir)
			}
			break
		}
	}
	return dirs
}

// instanceCgroups lists the cgroup directories runsc creates for id.
func (d *Driver) instanceCgroups(id string) []string {
	var out []string
	for _, dir := range d.cgroupDirs {
		out = append(out, filepath.Join(dir, d.cgroupPath(id)))
	}
	return out
}

// removeCgroups removes the instance's cgroup directories that are left (pitfall: a killed runsc
// leaves its cgroup v1 directories behind). A directory still busy is retried briefly.
func (d *Driver) removeCgroups(id string) error {
	var errs []error
	for _, dir := range d.instanceCgroups(id) {
		var err error
		for i := 0; i < 50; i++ {
			err = os.Remove(dir)
			if err == nil || errors.Is(err, fs.ErrNotExist) {
				err = nil
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("gvisor: remove cgroup: %w", err))
		}
	}
	return errors.Join(errs...)
}

// cgroupMemoryLimit reads the instance's memory limit from its cgroup (v1 or v2); 0 if none.
func (d *Driver) cgroupMemoryLimit(id string) uint64 {
	for _, dir := range d.instanceCgroups(id) {
		for _, name := range []string{"memory.limit_in_bytes", "memory.max"} {
			b, err := os.ReadFile(filepath.Join(dir, name))
			if err != nil {
				continue
			}
			v, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
			if err != nil {
				return 0 // "max"
			}
			return v
		}
	}
	return 0
}

var (
	swapAccountOnce sync.Once
	swapAccountOK   bool
)

// swapAccounting reports whether runsc can set a memory+swap limit: cgroup v1 with swap
// accounting (memory.memsw.*) or cgroup v2 (memory.swap.max). runsc fails a start whose spec
// sets Memory.Swap on a host without it.
func swapAccounting() bool {
	swapAccountOnce.Do(func() {
		for _, dir := range ownCgroupDirs() {
			for _, f := range []string{"memory.memsw.limit_in_bytes", "memory.swap.max"} {
				if _, err := os.Stat(filepath.Join(dir, f)); err == nil {
					swapAccountOK = true
					return
				}
			}
		}
	})
	return swapAccountOK
}

// limitExit tells, from an instance's cgroups, whether it was stopped by one of its limits:
// the host OOM killer (memory.oom_control oom_kill, or v2 memory.events oom_kill) or the host
// pids bound (pids.events max). ok is false when neither counter moved. Read it before Delete
// removes the cgroups. (For Wait: runtime.ExitOOM is the reason of an OOM-killed sandbox.)
func (d *Driver) limitExit(id string) (reason runtime.ExitReason, detail string, ok bool) {
	for _, dir := range d.instanceCgroups(id) {
		for _, f := range []string{"memory.oom_control", "memory.events"} {
			if n := readKeyed(filepath.Join(dir, f), "oom_kill"); n > 0 {
				return runtime.ExitOOM, fmt.Sprintf("memory limit %d MiB exceeded", guestMemory(d.cgroupMemoryLimit(id))>>20), true
			}
		}
	}
	for _, dir := range d.instanceCgroups(id) {
		if n := readKeyed(filepath.Join(dir, "pids.events"), "max"); n > 0 {
			return runtime.ExitKilled, "task limit reached (host pids cgroup)", true
		}
	}
	return "", "", false
}

// pidsLimitHit reports whether the instance's host pids cgroup refused a task.
func (d *Driver) pidsLimitHit(id string) bool {
	r, _, ok := d.limitExit(id)
	return ok && r == runtime.ExitKilled
}

// readKeyed reads the value of key in a "key value" per line cgroup file; 0 if absent.
func readKeyed(path, key string) int64 {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) == 2 && f[0] == key {
			n, _ := strconv.ParseInt(f[1], 10, 64)
			return n
		}
	}
	return 0
}

// The memory guard. gVisor has no OOM killer: a sandbox whose host memory cgroup fills is
// stopped whole (the host kills the Sentry). So the guest sees MemoryMB (the Sentry's total
// memory, /proc/meminfo's MemTotal, set by runsc from the cgroup limit it applies at create),
// and once the instance runs the driver raises the host limit by headroom: envd's guard
// (internal/envd, oomguard.go) kills the guest's largest process when the guest's use nears
// MemoryMB, the way a VM's kernel would, and the headroom holds the Sentry's own memory and what
// the guest allocates between two looks of the guard. The whole-sandbox stop stays the last
// resort, with its reason (limitExit).
const (
	headroomBase    = 256 << 20 // bytes above MemoryMB, plus guestMemory/headroomDivisor
	headroomDivisor = 2
)

// hostMemoryLimit is the host cgroup limit of a sandbox whose guest sees guest bytes.
func hostMemoryLimit(guest int64) int64 { return guest + headroomBase + guest/headroomDivisor }

// guestMemory is the inverse of hostMemoryLimit (whole MiB): the memory the guest sees under a
// host limit of host bytes. A limit that was never raised (no room for headroom) is returned
// as it is.
func guestMemory(host uint64) uint64 {
	if host <= headroomBase {
		return host
	}
	mib := (host - headroomBase) >> 20
	// mib = g + g/d for whole MiB g: g = ceil(d*mib/(d+1)), or one less.
	g := (mib*headroomDivisor + headroomDivisor) / (headroomDivisor + 1)
	for g > 0 && g+g/headroomDivisor > mib {
		g--
	}
	return g << 20
}

// raiseMemoryLimit gives the running instance its headroom: the host memory cgroup limit (and
// memory+swap on cgroup v1, raised first: it may not be below the limit) becomes
// hostMemoryLimit(MemoryMB). runsc sized the Sentry's total memory from the limit it applied
// at create, so the guest keeps seeing MemoryMB. It is done after every run, create and
// restore (runsc applies the spec's limit each time it makes the sandbox's cgroup).
func (d *Driver) raiseMemoryLimit(id string, memoryMB int) error {
	if memoryMB <= 0 || d.cfg.IgnoreCgroups {
		return nil
	}
	want := strconv.FormatInt(hostMemoryLimit(int64(memoryMB)<<20), 10)
	var errs []error
	for _, dir := range d.instanceCgroups(id) {
		for _, name := range []string{"memory.memsw.limit_in_bytes", "memory.limit_in_bytes", "memory.max"} {
			p := filepath.Join(dir, name)
			if _, err := os.Stat(p); err != nil {
				continue
			}
			if err := os.WriteFile(p, []byte(want), 0o644); err != nil {
				errs = append(errs, fmt.Errorf("gvisor: memory headroom: %s: %w", name, err))
			}
		}
	}
	return errors.Join(errs...)
}

// bundleMemoryMB is the MemoryMB an instance was made with: the memory limit of the spec in its
// bundle (0 if none or unreadable).
func bundleMemoryMB(stateDir string) int {
	b, err := os.ReadFile(filepath.Join(stateDir, "bundle", "config.json"))
	if err != nil {
		return 0
	}
	var sp specs.Spec
	if json.Unmarshal(b, &sp) != nil || sp.Linux == nil || sp.Linux.Resources == nil || sp.Linux.Resources.Memory == nil || sp.Linux.Resources.Memory.Limit == nil {
		return 0
	}
	return int(*sp.Linux.Resources.Memory.Limit >> 20)
}
