package gvisor

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/runtime"
)

// idPattern is what the driver accepts as an instance id. runsc matches ids by prefix, so callers
// must also give every id the same length (runtime.Spec.ID); the driver cannot check that alone.
var idPattern = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,63}$`)

func validateID(id string) error {
	if !idPattern.MatchString(id) {
		return fmt.Errorf("gvisor: id %q: must be 1-64 characters of [a-z0-9-]: %w", id, errdefs.ErrInvalid)
	}
	return nil
}

// capabilities is the set every sandbox's init process gets: Docker's default set. CAP_NET_RAW is
// listed but runsc drops it unless --net-raw is among Config.ExtraFlags.
var capabilities = []string{
	"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
	"CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
	"CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
}

const defaultPath = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// ociSpec builds the OCI runtime spec of one instance. Everything runsc validates on restore
// (args, cwd, user, capabilities, rlimits, mounts, namespace types) depends only on spec.Args and
// spec.Cwd, so an image restores under a spec that differs in id, hostname, env, netns and limits.
func (d *Driver) ociSpec(s runtime.Spec) *specs.Spec {
	env := s.Env
	hasPath := false
	for _, e := range env {
		if len(e) >= 5 && e[:5] == "PATH=" {
			hasPath = true
		}
	}
	if !hasPath {
		env = append([]string{defaultPath}, env...)
	}
	cwd := s.Cwd
	if cwd == "" {
		cwd = "/"
	}
	hostname := s.Hostname
	if hostname == "" {
		hostname = "sandbox"
	}
	caps := append([]string(nil), capabilities...)
	netns := specs.LinuxNamespace{Type: specs.NetworkNamespace, Path: s.NetNSPath}

	sp := &specs.Spec{
		Version: specs.Version,
		Process: &specs.Process{
			User: specs.User{UID: 0, GID: 0},
			Args: s.Args,
			Env:  env,
			Cwd:  cwd,
			Capabilities: &specs.LinuxCapabilities{
				Bounding: caps, Effective: caps, Permitted: caps,
			},
			Rlimits: rlimits(),
		},
		// The template rootfs is shared and only ever read: writes go to the instance's own layer,
		// a host overlayfs upper (OverlayHost, RootFS is then the instance's overlay mount) or
		// runsc's memory overlay (Config.Overlay "root:memory").
		Root:        &specs.Root{Path: s.RootFS},
		Hostname:    hostname,
		Annotations: d.gcAnnotations(),
		Mounts: []specs.Mount{
			{Destination: "/proc", Type: "proc", Source: "proc"},
			{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
			{Destination: "/dev/pts", Type: "devpts", Source: "devpts", Options: []string{"nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"}},
			{Destination: "/dev/shm", Type: "tmpfs", Source: "shm", Options: []string{"nosuid", "noexec", "nodev", "mode=1777", "size=65536k"}},
			{Destination: "/sys", Type: "sysfs", Source: "sysfs", Options: []string{"nosuid", "noexec", "nodev", "ro"}},
		},
		Linux: &specs.Linux{
			Namespaces: []specs.LinuxNamespace{
				{Type: specs.PIDNamespace}, {Type: specs.IPCNamespace}, {Type: specs.UTSNamespace},
				{Type: specs.MountNamespace}, netns,
			},
			Resources: resources(s),
		},
	}
	for _, b := range s.Binds { // volumes: after the fixed mounts, so they stay in the same order
		opts := []string{"rbind", "rw", "nosuid", "nodev"}
		if b.Remote {
			// gVisor otherwise keeps a host file open for each file it has cached (directfs opens
			// one per dentry) and shares one among a file's guest opens: while any is open, s3fs
			// serves what it read first. No dentry cache on this mount: the host files close with
			// the guest's.
			opts = append(opts, "disable_file_handle_sharing", "dcache=0")
		}
		sp.Mounts = append(sp.Mounts, specs.Mount{Destination: b.Path, Type: "bind", Source: b.Source, Options: opts})
	}
	if s.DiskMB > 0 && !d.hostLayers() {
		diskUnsupported.Do(func() {
			d.log.Warn("disk limits not enforced: they need host layers (overlay "+OverlayHost+")", "overlay", d.cfg.Overlay)
		})
	}
	if !d.cfg.IgnoreCgroups {
		// Relative: runsc puts it under the daemon's own cgroup of each controller.
		sp.Linux.CgroupsPath = d.cgroupPath(s.ID)
	}
	return sp
}

// Limits the driver applies when runtime.Spec leaves them at zero, and how they map to gVisor.
const (
	// DefaultPidsLimit is the task bound of a sandbox whose Spec.PidsLimit is 0.
	DefaultPidsLimit = 4096
	// hostTasksPerTask and hostTasksBase size the host pids cgroup from a sandbox's task bound:
	// with systrap every sandbox process is a host stub process plus a stub thread (measured:
	// 300 sleeping processes = 631 host tasks, 600 = 1237; an idle sandbox 18-19).
	hostTasksPerTask = 2
	hostTasksBase    = 128
)

// tasksPerUID is RLIMIT_NPROC of every sandbox (soft = hard): inside gVisor, a fork or clone
// past it fails with EAGAIN for that uid, and the sandbox lives on. runsc refuses a restore whose
// rlimits differ from the checkpointed instance's, so it is one value for every instance, not
// Spec.PidsLimit; tests lower it (export_test.go-style hook in quota_test.go).
var tasksPerUID uint64 = DefaultPidsLimit

// rlimits of every instance's init process. Keep them independent of runtime.Spec (restore).
func rlimits() []specs.POSIXRlimit {
	return []specs.POSIXRlimit{
		{Type: "RLIMIT_NOFILE", Hard: 1048576, Soft: 1048576},
		{Type: "RLIMIT_NPROC", Hard: tasksPerUID, Soft: tasksPerUID},
	}
}

// resources are the host cgroup limits of an instance. runsc accepts different resources on
// restore, so they follow the spec of each instance.
//
//   - Memory: memory.limit_in_bytes = MemoryMB, and memory+swap the same (no swap, so a sandbox
//     over its limit is killed at once instead of swapping); the Sentry reports MemoryMB as its
//     total memory. Once the instance runs, raiseMemoryLimit lifts both to
//     hostMemoryLimit(MemoryMB), headroom for envd's guard to kill the guest's largest process
//     first. gVisor (this version) has no OOM killer of its own and cannot survive the host
//     killing one of its stub processes, so going past the host limit stops the whole sandbox
//     (the host OOM killer takes the Sentry): memory.oom_control's oom_kill counts it.
//   - Pids: a host backstop sized from PidsLimit (DefaultPidsLimit when 0); the per-uid bound
//     inside is tasksPerUID. Past the host bound the Sentry cannot make host threads and the
//     sandbox stops (pids.events "max" counts it).
//   - CPU: CFS quota of CPUCount cores per 100 ms period.
func resources(s runtime.Spec) *specs.LinuxResources {
	r := &specs.LinuxResources{}
	if s.MemoryMB > 0 {
		limit := int64(s.MemoryMB) << 20
		swap := limit
		r.Memory = &specs.LinuxMemory{Limit: &limit}
		if swapAccounting() {
			r.Memory.Swap = &swap
		}
	}
	pids := int64(s.PidsLimit)
	if pids <= 0 {
		pids = DefaultPidsLimit
	}
	host := pids*hostTasksPerTask + hostTasksBase
	r.Pids = &specs.LinuxPids{Limit: &host}
	if s.CPUCount > 0 {
		period := uint64(100000)
		quota := int64(s.CPUCount) * int64(period)
		r.CPU = &specs.LinuxCPU{Period: &period, Quota: &quota}
	}
	return r
}

// writeBundle writes <StateDir>/bundle/config.json and creates <StateDir>/logs. It returns the
// bundle directory.
func (d *Driver) writeBundle(s runtime.Spec) (string, error) {
	bundle := filepath.Join(s.StateDir, "bundle")
	if err := os.MkdirAll(s.StateDir, 0o700); err != nil {
		return "", fmt.Errorf("gvisor: state dir: %w", err)
	}
	if err := os.Chmod(s.StateDir, 0o700); err != nil { // the instance's files: root only
		return "", fmt.Errorf("gvisor: state dir: %w", err)
	}
	if err := os.MkdirAll(bundle, 0o700); err != nil {
		return "", fmt.Errorf("gvisor: bundle: %w", err)
	}
	if err := os.MkdirAll(filepath.Join(s.StateDir, "logs"), 0o700); err != nil {
		return "", fmt.Errorf("gvisor: logs: %w", err)
	}
	b, err := json.MarshalIndent(d.ociSpec(s), "", "  ")
	if err != nil {
		return "", fmt.Errorf("gvisor: spec: %w", err)
	}
	if err := os.WriteFile(filepath.Join(bundle, "config.json"), b, 0o600); err != nil {
		return "", fmt.Errorf("gvisor: bundle: %w", err)
	}
	return bundle, nil
}

func validateSpec(s runtime.Spec) error {
	if err := validateID(s.ID); err != nil {
		return err
	}
	switch {
	case s.RootFS == "" || !filepath.IsAbs(s.RootFS):
		return fmt.Errorf("gvisor: spec.RootFS %q: must be an absolute path: %w", s.RootFS, errdefs.ErrInvalid)
	case s.StateDir == "" || !filepath.IsAbs(s.StateDir):
		return fmt.Errorf("gvisor: spec.StateDir %q: must be an absolute path: %w", s.StateDir, errdefs.ErrInvalid)
	case len(s.Args) == 0:
		return fmt.Errorf("gvisor: spec.Args: empty: %w", errdefs.ErrInvalid)
	case s.NetNSPath != "" && !filepath.IsAbs(s.NetNSPath):
		return fmt.Errorf("gvisor: spec.NetNSPath %q: must be an absolute path: %w", s.NetNSPath, errdefs.ErrInvalid)
	case s.CPUCount < 0 || s.MemoryMB < 0 || s.DiskMB < 0 || s.PidsLimit < 0:
		return fmt.Errorf("gvisor: spec limits: negative: %w", errdefs.ErrInvalid)
	}
	for _, b := range s.Binds {
		if fi, err := os.Stat(b.Source); !filepath.IsAbs(b.Source) || err != nil || !fi.IsDir() || !filepath.IsAbs(b.Path) {
			return fmt.Errorf("gvisor: spec bind %q at %q: needs an absolute path of a host directory and an absolute guest path: %w", b.Source, b.Path, errdefs.ErrInvalid)
		}
	}
	for _, l := range s.Stack() {
		if fi, err := os.Stat(l); !filepath.IsAbs(l) || err != nil || !fi.IsDir() {
			return fmt.Errorf("gvisor: spec rootfs layer %q: not an absolute path of a directory: %w", l, errdefs.ErrInvalid)
		}
	}
	return nil
}
