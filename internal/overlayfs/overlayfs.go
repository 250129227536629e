// Package overlayfs mounts Linux overlay filesystems of a stack of read-only layer directories
// and knows overlayfs's on-disk format for whiteouts and opaque directories. It is shared by the
// gvisor driver (an instance's writable layer over its template's stack) and the image builder
// (a template's own top layer written over its image's layers). It owns no state.
package overlayfs

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// OpaqueXattr marks a directory of a layer whose lower layers' entries are hidden.
const OpaqueXattr = "trusted.overlay.opaque"

// IsWhiteout reports whether st is an overlay whiteout (a 0:0 character device).
func IsWhiteout(st *unix.Stat_t) bool {
	return st.Mode&unix.S_IFMT == unix.S_IFCHR && st.Rdev == 0
}

// Mount mounts at target (nosuid, nodev) an overlay filesystem of the read-only stack lowers
// (top first) under upper and work (same filesystem; both empty strings: a read-only mount,
// which needs two lowers at least). It uses the mount API (fsopen, one fsconfig "lowerdir+" per
// layer; Linux 6.8+), so the number of layers is never limited by the length of one option
// string. On a kernel without "lowerdir+" it falls back to mount(2) with one "lowerdir=a:b:c"
// option and says so clearly when the stack's paths do not fit in it.
func Mount(target string, lowers []string, upper, work string) error {
	if len(lowers) == 0 {
		return fmt.Errorf("overlayfs: no lower layer: %w", errdefs.ErrInvalid)
	}
	err := fsmount(target, lowers, upper, work)
	if !errors.Is(err, errNoLowerdirPlus) {
		return err
	}
	return mountLegacy(target, lowers, upper, work)
}

// mountLegacy mounts with mount(2) and one "lowerdir=a:b:c" option (kernels before 6.8).
func mountLegacy(target string, lowers []string, upper, work string) error {
	for _, p := range append([]string{upper, work}, lowers...) {
		if strings.ContainsAny(p, ",:\\\n") {
			return fmt.Errorf("overlayfs: path %q: , : or \\ cannot be passed to mount(2): %w", p, errdefs.ErrInvalid)
		}
	}
	opts := "lowerdir=" + strings.Join(lowers, ":")
	if upper != "" {
		opts += ",upperdir=" + upper + ",workdir=" + work
	}
	if len(opts) >= os.Getpagesize() {
		return fmt.Errorf("overlayfs: %d layers: their paths (%d bytes) exceed what mount(2) takes in one option string, and this kernel's overlayfs has no \"lowerdir+\" (Linux 6.8 or later): %w",
			len(lowers), len(opts), errdefs.ErrInvalid)
	}
	if err := unix.Mount("overlay", target, "overlay", unix.MS_NOSUID|unix.MS_NODEV, opts); err != nil {
		return fmt.Errorf("overlayfs: mount on %s: %w", target, err)
	}
	return nil
}

// errNoLowerdirPlus: the kernel's overlayfs takes no "lowerdir+" (or there is no mount API).
var errNoLowerdirPlus = errors.New("overlayfs without lowerdir+")

func fsmount(target string, lowers []string, upper, work string) error {
	fd, err := unix.Fsopen("overlay", unix.FSOPEN_CLOEXEC)
	if errors.Is(err, unix.ENOSYS) {
		return errNoLowerdirPlus
	}
	if err != nil {
		return fmt.Errorf("overlayfs: fsopen: %w", err)
	}
	defer unix.Close(fd)
	fail := func(what string, err error) error {
		if msg := fsLog(fd); msg != "" {
			return fmt.Errorf("overlayfs: mount on %s: %s: %w (%s)", target, what, err, msg)
		}
		return fmt.Errorf("overlayfs: mount on %s: %s: %w", target, what, err)
	}
	for i, l := range lowers {
		if err := unix.FsconfigSetString(fd, "lowerdir+", l); err != nil {
			if i == 0 && errors.Is(err, unix.EINVAL) && strings.Contains(fsLog(fd), "nknown parameter") {
				return errNoLowerdirPlus
			}
			return fail("lower layer "+l, err)
		}
	}
	if upper != "" {
		for _, kv := range [][2]string{{"upperdir", upper}, {"workdir", work}} {
			if err := unix.FsconfigSetString(fd, kv[0], kv[1]); err != nil {
				return fail(kv[0]+" "+kv[1], err)
			}
		}
	}
	if err := unix.FsconfigCreate(fd); err != nil {
		return fail("create", err)
	}
	attrs := unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV
	if upper == "" {
		attrs |= unix.MOUNT_ATTR_RDONLY
	}
	mfd, err := unix.Fsmount(fd, unix.FSMOUNT_CLOEXEC, attrs)
	if err != nil {
		return fail("fsmount", err)
	}
	defer unix.Close(mfd)
	if err := unix.MoveMount(mfd, "", unix.AT_FDCWD, target, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("overlayfs: mount on %s: %w", target, err)
	}
	return nil
}

// fsLog reads the messages the kernel left on a filesystem context (fsopen's fd).
func fsLog(fd int) string {
	var msgs []string
	buf := make([]byte, 1024)
	for range 8 {
		n, err := unix.Read(fd, buf)
		if err != nil || n <= 0 {
			break
		}
		msgs = append(msgs, strings.TrimSpace(string(buf[:n])))
	}
	return strings.Join(msgs, "; ")
}

// Unmount unmounts target, detaching it lazily when it stays busy; not mounted is fine.
func Unmount(target string) error {
	err := unix.Unmount(target, 0)
	if errors.Is(err, unix.EBUSY) {
		err = unix.Unmount(target, unix.MNT_DETACH)
	}
	if err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("overlayfs: unmount %s: %w", target, err)
	}
	return nil
}

// MountedLayers lists the lower layer directories of every overlay filesystem mounted in this
// mount namespace (from /proc/self/mountinfo), so that nothing a live mount stacks on is
// removed.
func MountedLayers() ([]string, error) {
	mounts, err := Mounts()
	if err != nil {
		return nil, err
	}
	var dirs []string
	for _, mt := range mounts {
		if mt.FSType != "overlay" {
			continue
		}
		for _, opt := range strings.Split(mt.SuperOptions, ",") {
			switch {
			case strings.HasPrefix(opt, "lowerdir+="):
				dirs = append(dirs, UnescapeMount(strings.TrimPrefix(opt, "lowerdir+=")))
			case strings.HasPrefix(opt, "lowerdir="):
				for _, d := range strings.Split(strings.TrimPrefix(opt, "lowerdir="), ":") {
					dirs = append(dirs, UnescapeMount(d))
				}
			}
		}
	}
	return dirs, nil
}

// MountInfo is one line of this mount namespace's mount table (/proc/self/mountinfo), paths
// unescaped; SuperOptions are as the kernel writes them (an overlay's lowerdir list escaped).
type MountInfo struct {
	Root, Point    string
	FSType, Source string
	Options        string // per-mount options (ro, nosuid, ...)
	SuperOptions   string
}

// Mounts reads this mount namespace's mount table, in mount order: the one place ember parses
// it.
func Mounts() ([]MountInfo, error) {
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	var out []MountInfo
	for _, line := range strings.Split(string(data), "\n") {
		// id parent major:minor root mountpoint options [optional...] - fstype source superopts
		pre, post, ok := strings.Cut(line, " - ")
		f, g := strings.Fields(pre), strings.Fields(post)
		if !ok || len(f) < 6 || len(g) < 2 {
			continue
		}
		mt := MountInfo{Root: UnescapeMount(f[3]), Point: UnescapeMount(f[4]), Options: f[5], FSType: g[0], Source: UnescapeMount(g[1])}
		if len(g) > 2 {
			mt.SuperOptions = g[2]
		}
		out = append(out, mt)
	}
	return out, nil
}

// UnescapeMount undoes the octal escapes of a path in /proc/mounts or mountinfo (\040 for a
// space, \134 for a backslash, ...).
func UnescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			v, ok := byte(0), true
			for j := 1; j <= 3; j++ {
				c := s[i+j]
				if c < '0' || c > '7' {
					ok = false
					break
				}
				v = v*8 + (c - '0')
			}
			if ok {
				b.WriteByte(v)
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// MountsUnder lists the mount points below dir, in mount order.
func MountsUnder(dir string) []string {
	mounts, _ := Mounts()
	var points []string
	for _, mt := range mounts {
		if strings.HasPrefix(mt.Point, dir+"/") {
			points = append(points, mt.Point)
		}
	}
	return points
}

// MountedOn reports whether something is mounted on dir itself.
func MountedOn(dir string) bool {
	mounts, _ := Mounts()
	for _, mt := range mounts {
		if mt.Point == dir {
			return true
		}
	}
	return false
}
