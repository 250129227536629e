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
			Rlimits: []specs.POSIXRlimit{{Type: "RLIMIT_NOFILE", Hard: 1048576, Soft: 1048576}},
		},
		// The template rootfs is shared and only ever read: writes go to the instance's own layer,
		// a host overlayfs upper (OverlayHost, RootFS is then the instance's overlay mount) or
		// runsc's memory overlay (Config.Overlay "root:memory").
		Root:     &specs.Root{Path: s.RootFS},
		Hostname: hostname,
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
	if !d.cfg.IgnoreCgroups {
		// Relative: runsc puts it under the daemon's own cgroup of each controller.
		sp.Linux.CgroupsPath = d.cgroupPath(s.ID)
	}
	return sp
}

func resources(s runtime.Spec) *specs.LinuxResources {
	r := &specs.LinuxResources{}
	if s.MemoryMB > 0 {
		limit := int64(s.MemoryMB) << 20
		r.Memory = &specs.LinuxMemory{Limit: &limit}
	}
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
	case s.CPUCount < 0 || s.MemoryMB < 0:
		return fmt.Errorf("gvisor: spec limits: negative: %w", errdefs.ErrInvalid)
	}
	if fi, err := os.Stat(s.RootFS); err != nil || !fi.IsDir() {
		return fmt.Errorf("gvisor: spec.RootFS %q: not a directory: %w", s.RootFS, errdefs.ErrInvalid)
	}
	return nil
}
