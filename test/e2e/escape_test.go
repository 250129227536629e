package e2e

// Escape attempts (issue 8): from inside a sandbox, as its root (sudo) and as its default user,
// try to reach the host or another sandbox by every route a container escape usually takes. Each
// test asserts that the attempt failed and logs what was tried and what the sandbox saw. A failure
// whose message starts with "HOLE:" is a real way out, not a flaky test: do not weaken the test,
// fix the product.

import (
	"bytes"
	"encoding/base64"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// ---------------------------------------------------------------------------------------------
// Host files: /proc/*/root, /proc/*/cwd, /proc/*/fd, /sys, device nodes.

const procWalkProbe = `import os, sys, stat
marker, datadir = sys.argv[1], sys.argv[2]
cands = [marker, datadir, datadir + '/api-key', datadir + '/ember.db',
         '/proc/self/root' + marker, '/proc/self/root/../../..' + marker,
         '/proc/thread-self/root' + marker, '/proc/1/root' + marker, '/proc/1/root/../../..' + marker,
         '/proc/self/root' + datadir + '/api-key']
def readable(p):
    try:
        with open(p, 'rb') as f:
            data = f.read(4096)
        return data
    except Exception:
        return None
links = 0
for pid in sorted(os.listdir('/proc')):
    if not pid.isdigit():
        continue
    for l in ('root', 'cwd', 'exe'):
        p = '/proc/%s/%s' % (pid, l)
        try:
            print('LINK', p, '->', os.readlink(p)); links += 1
        except Exception as e:
            print('LINK', p, 'refused', type(e).__name__)
        if l != 'exe':
            cands += [p + marker, p + '/../../../..' + marker, p + datadir]
    fds = '/proc/%s/fd' % pid
    try:
        names = os.listdir(fds)
    except Exception as e:
        print('FDS', fds, 'refused', type(e).__name__)
        continue
    for n in names:
        p = fds + '/' + n
        try:
            tgt = os.readlink(p)
        except Exception as e:
            print('FD', p, 'refused', type(e).__name__)
            continue
        print('FD', p, '->', tgt)
        cands += [p + marker, p + '/../../../..' + marker]
        try:
            if stat.S_ISREG(os.stat(p).st_mode):
                data = readable(p)
                if data is not None:
                    print('FDREAD', p, repr(data[:120]))
        except Exception:
            pass
opened = 0
for c in cands:
    if os.path.lexists(c):
        print('EXISTS', c)
    data = readable(c)
    if data is not None:
        opened += 1
        print('OPENED', c, repr(data[:200]))
print('TRIED', len(cands), 'OPENED', opened, 'LINKS', links)
`

func TestEscapeHostFilesThroughProc(t *testing.T) {
	d := need(t)
	s := d.create(t, nil)
	marker, secret := hostMarker(t)
	key, _ := os.ReadFile(filepath.Join(d.dataDir, "api-key"))
	secrets := []string{secret, strings.TrimSpace(string(key))}
	d.background(t, s, "exec sleep 600") // one more process whose links to walk
	for _, root := range []bool{false, true} {
		r := d.python(t, s, root, 60, procWalkProbe, marker, d.dataDir)
		t.Logf("as %s: walked /proc/<pid>/{root,cwd,exe,fd/*} (+/..), /proc/self/root/.., /proc/thread-self/root, %s: %s",
			who(root), d.dataDir, lastLine(r.stdout))
		assertNoSecret(t, "reading host files through /proc as "+who(root), r, secrets...)
		for _, l := range strings.Split(r.stdout, "\n") {
			if strings.HasPrefix(l, "OPENED") || strings.HasPrefix(l, "EXISTS") {
				t.Errorf("HOLE: as %s a host path is visible inside the sandbox: %s", who(root), l)
			}
			if (strings.HasPrefix(l, "LINK") || strings.HasPrefix(l, "FD")) && strings.Contains(l, d.dataDir) {
				t.Errorf("HOLE: as %s a /proc link names a host path: %s", who(root), l)
			}
		}
		if !strings.Contains(r.stdout, "TRIED") {
			t.Errorf("probe did not finish: %q %q", r.stdout, r.stderr)
		}
	}
}

func TestEscapeHostFilesThroughSys(t *testing.T) {
	d := need(t)
	s := d.create(t, nil)
	marker, secret := hostMarker(t)
	cg, cgDirs := hostCgroupFiles(t, s.SandboxID)
	before := map[string]string{}
	for _, f := range cg {
		b, _ := os.ReadFile(f)
		before[f] = string(b)
	}
	subBefore := subdirs(cgDirs)
	corePattern, _ := os.ReadFile("/proc/sys/kernel/core_pattern")
	script := `
echo "sys entries: $(find /sys 2>/dev/null | wc -l)"
for p in /sys/firmware /sys/block /sys/dev/block /sys/class /sys/devices /sys/fs/cgroup /sys/kernel /sys/module; do
  echo "ls $p: $(ls $p 2>&1 | tr '\n' ' ' | cut -c1-200)"
done
for f in /sys/firmware/dmi/tables/DMI /sys/firmware/acpi/tables/DSDT /sys/class/dmi/id/product_uuid /sys/block/vda/dev /sys/block/sda/dev /sys/kernel/security/lsm; do
  if head -c 64 "$f" >/dev/null 2>&1; then echo "READ $f"; else echo "no $f"; fi
done
for f in /sys/fs/cgroup/cgroup.procs /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/pids/pids.max \
         /sys/fs/cgroup/memory.max /sys/kernel/uevent_helper /sys/kernel/mm/transparent_hugepage/enabled \
         /sys/power/state /sys/module/printk/parameters/time /proc/sys/kernel/core_pattern /proc/sys/vm/drop_caches \
         /proc/sys/kernel/modprobe; do
  # Write back what the file already says (harmless even if it reached the host); 1 for write-only files.
  v=$(cat "$f" 2>/dev/null | head -1); [ -n "$v" ] || v=1
  if (echo "$v" > "$f") 2>/dev/null; then echo "WROTE $f"; else echo "write refused $f"; fi
done
if mkdir /sys/fs/cgroup/escape 2>/dev/null; then echo "WROTE mkdir /sys/fs/cgroup/escape"; else echo "mkdir refused /sys/fs/cgroup/escape"; fi
# The sandbox's own cgroupfs (gVisor's, in a user namespace): writes there must not reach the host.
unshare -Urm bash -c '
  mkdir -p /tmp/cgm /tmp/cgp
  mount -t cgroup -o memory cgroup /tmp/cgm 2>/dev/null && echo "mounted cgroup memory" || echo "mount cgroup memory refused"
  mount -t cgroup -o pids cgroup /tmp/cgp 2>/dev/null && echo "mounted cgroup pids" || echo "mount cgroup pids refused"
  (echo 8388608 > /tmp/cgm/memory.limit_in_bytes) 2>/dev/null && echo "wrote sandbox memory.limit_in_bytes"
  (echo 3 > /tmp/cgp/pids.max) 2>/dev/null && echo "wrote sandbox pids.max"
  mkdir /tmp/cgm/x 2>/dev/null && (echo $$ > /tmp/cgm/x/cgroup.procs) 2>/dev/null && echo "moved into sandbox cgroup x"
  cat /tmp/cgm/memory.limit_in_bytes 2>/dev/null | sed "s/^/sandbox limit now /"
'
cat ` + marker + ` 2>&1 | head -1
`
	for _, root := range []bool{false, true} {
		r := d.inSandbox(t, s, root, 60, script)
		t.Logf("as %s: /sys listing, firmware and block-device reads, sysfs/procfs/cgroup writes:\n%s", who(root), r.stdout)
		assertNoSecret(t, "/sys as "+who(root), r, secret)
		for _, l := range strings.Split(r.stdout, "\n") {
			if strings.HasPrefix(l, "WROTE") {
				t.Errorf("HOLE: as %s a write into /sys or /proc/sys was accepted: %s", who(root), l)
			}
			if strings.HasPrefix(l, "READ /sys/firmware") || strings.HasPrefix(l, "READ /sys/block") || strings.HasPrefix(l, "READ /sys/class/dmi") {
				t.Errorf("HOLE: as %s host firmware or block device information is readable: %s", who(root), l)
			}
		}
	}
	for _, f := range cg {
		b, _ := os.ReadFile(f)
		if string(b) != before[f] {
			t.Errorf("HOLE: the sandbox changed its host cgroup file %s: %q -> %q", f, before[f], b)
		}
	}
	if sub := subdirs(cgDirs); sub != subBefore {
		t.Errorf("HOLE: cgroups made inside the sandbox appeared on the host: %q -> %q", subBefore, sub)
	}
	if cp, _ := os.ReadFile("/proc/sys/kernel/core_pattern"); !bytes.Equal(cp, corePattern) {
		os.WriteFile("/proc/sys/kernel/core_pattern", corePattern, 0o644) // put the host back first
		t.Errorf("HOLE: the sandbox changed the host's core_pattern to %q", cp)
	}
	t.Logf("host cgroup limit files of the sandbox unchanged and no new host cgroups under %v", cgDirs)
}

// hostCgroupFiles returns the limit files of the sandbox's cgroups on the host, and the cgroup
// directories.
func hostCgroupFiles(t *testing.T, id string) (files, dirs []string) {
	t.Helper()
	var out []string
	for _, ctl := range []string{"memory", "pids", "cpu", ""} {
		root := filepath.Join("/sys/fs/cgroup", ctl)
		filepath.WalkDir(root, func(p string, e fs.DirEntry, err error) error {
			if err != nil || !e.IsDir() {
				return nil
			}
			if strings.Count(strings.TrimPrefix(p, root), "/") > 6 {
				return fs.SkipDir
			}
			if strings.HasPrefix(e.Name(), id) {
				dirs = append(dirs, p)
				for _, f := range []string{"memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "pids.max", "cpu.cfs_quota_us", "cpu.cfs_period_us", "memory.max"} {
					if _, err := os.Stat(filepath.Join(p, f)); err == nil {
						out = append(out, filepath.Join(p, f))
					}
				}
				return fs.SkipDir
			}
			return nil
		})
	}
	return out, dirs
}

// subdirs lists the subdirectories of dirs (sorted, one string).
func subdirs(dirs []string) string {
	var out []string
	for _, d := range dirs {
		ents, _ := os.ReadDir(d)
		for _, e := range ents {
			if e.IsDir() {
				out = append(out, filepath.Join(d, e.Name()))
			}
		}
	}
	return strings.Join(out, ",")
}

func TestEscapeDeviceNodes(t *testing.T) {
	d := need(t)
	s := d.create(t, nil)
	var st unix.Stat_t
	if err := unix.Stat("/", &st); err != nil {
		t.Fatal(err)
	}
	hostMaj, hostMin := unix.Major(uint64(st.Dev)), unix.Minor(uint64(st.Dev))
	var dst unix.Stat_t
	unix.Stat(d.dataDir, &dst)
	dataMaj, dataMin := unix.Major(uint64(dst.Dev)), unix.Minor(uint64(dst.Dev))
	t.Logf("host / is on device %d:%d, the data dir on %d:%d", hostMaj, hostMin, dataMaj, dataMin)
	nodes := []struct{ name, kind string }{
		{"hostroot", fmt.Sprintf("b %d %d", hostMaj, hostMin)},
		{"hostdata", fmt.Sprintf("b %d %d", dataMaj, dataMin)},
		{"sda", "b 8 0"}, {"vda", "b 254 0"}, {"dm0", "b 253 0"}, {"nvme", "b 259 0"}, {"loop0", "b 7 0"},
		{"mem", "c 1 1"}, {"kmem", "c 1 2"}, {"port", "c 1 4"}, {"kmsg", "c 1 11"}, {"tty0", "c 4 0"},
		{"kvm", "c 10 232"}, {"fuse", "c 10 229"},
	}
	var sb strings.Builder
	sb.WriteString("for f in /dev/mem /dev/kmem /dev/port /dev/kmsg /dev/vda /dev/sda /dev/kvm /dev/console; do\n" +
		"  if [ -e $f ]; then echo \"present $f\"; fi\n" +
		"  if timeout 2 head -c 64 $f 2>/dev/null | od -An -tx1 | grep -q .; then echo \"READ $f\"; fi\n" +
		"done\n" +
		"timeout 2 dmesg 2>&1 | head -2 | sed 's/^/dmesg: /'\n")
	for _, dir := range []string{"/tmp", "/root", "/dev"} {
		for _, n := range nodes {
			p := dir + "/escape-" + n.name
			fmt.Fprintf(&sb, "if mknod %s %s 2>/dev/null; then echo \"mknod ok %s (%s)\"; else echo \"mknod refused %s\"; fi\n", p, n.kind, p, n.kind, p)
			fmt.Fprintf(&sb, "if timeout 2 head -c 512 %s 2>/dev/null | od -An -tx1 | grep -q .; then echo \"READ %s\"; fi\n", p, p)
			// Open for writing but never write: if a node did reach a host disk, nothing is harmed.
			fmt.Fprintf(&sb, "if (exec 3>>%s) 2>/dev/null && [ -c %s -o -b %s ]; then echo \"OPENED-FOR-WRITE %s\"; fi\n", p, p, p, p)
			fmt.Fprintf(&sb, "rm -f %s\n", p)
		}
	}
	r := d.inSandbox(t, s, true, 90, sb.String())
	t.Logf("as root: mknod of the host's disks (%d:%d, %d:%d, 8:0, 254:0, 253:0, 259:0, 7:0) and /dev/mem, kmem, port, kmsg, tty0, kvm, fuse in /tmp (sandbox tmpfs), /root (host-backed layer) and /dev, then read them and open them for writing (never writing):\n%s",
		hostMaj, hostMin, dataMaj, dataMin, r.stdout)
	for _, l := range strings.Split(r.stdout, "\n") {
		if strings.HasSuffix(l, "-fuse") {
			// 10:229 is gVisor's own FUSE device (the sandbox has /dev/fuse): it serves only
			// filesystems mounted inside the sandbox's kernel.
			continue
		}
		if strings.HasPrefix(l, "READ") || strings.HasPrefix(l, "OPENED-FOR-WRITE") {
			t.Errorf("HOLE: a device node gives the sandbox host data: %s", l)
		}
		if strings.HasPrefix(l, "mknod ok /root") {
			t.Errorf("HOLE: a device node was created on the host-backed layer: %s", l)
		}
	}
	// Nothing the sandbox did left a device node on the host (overlay whiteouts are 0:0 char devices).
	// Walk the raw layers only: rootfs/ (the merged mount) shows the template's own /dev nodes.
	uppers, _ := filepath.Glob(filepath.Join(d.dataDir, "sandboxes", s.SandboxID, "*", "layer", "upper"))
	if len(uppers) == 0 {
		t.Errorf("no layer/upper under %s", filepath.Join(d.dataDir, "sandboxes", s.SandboxID))
	}
	for _, u := range uppers {
		filepath.WalkDir(u, func(p string, e fs.DirEntry, err error) error {
			if err != nil || e.Type()&(fs.ModeDevice|fs.ModeCharDevice) == 0 {
				return nil
			}
			var ns unix.Stat_t
			if unix.Lstat(p, &ns) == nil && ns.Rdev != 0 {
				t.Errorf("HOLE: a device node %d:%d exists on the host in the sandbox's layer: %s", unix.Major(ns.Rdev), unix.Minor(ns.Rdev), p)
			}
			return nil
		})
	}
}

const symlinkProbe = `import ctypes, errno, os, struct, sys
marker, datadir = sys.argv[1], sys.argv[2]
up = '../' * 40
targets = {'abs': marker, 'rel': up + marker.lstrip('/'), 'datadir': datadir + '/api-key',
           'datadir-rel': up + datadir.lstrip('/') + '/api-key', 'proc1root': '/proc/1/root' + marker}
for d in ('/root', '/home/user', '/tmp', '/var/tmp'):
    for k, tgt in targets.items():
        l = '%s/.escape-link-%s' % (d, k)
        try:
            if os.path.lexists(l):
                os.remove(l)
            os.symlink(tgt, l)
        except OSError as e:
            print('symlink', l, 'refused', errno.errorcode.get(e.errno, e.errno)); continue
        try:
            print('READ', l, open(l).read()[:100])
        except OSError as e:
            print('read', l, 'refused', errno.errorcode.get(e.errno, e.errno))
        try:
            with open(l, 'w') as f:
                f.write('pwned-through-symlink\n')
            print('wrote through', l, '(inside the sandbox: it resolves there)')
        except OSError as e:
            print('write', l, 'refused', errno.errorcode.get(e.errno, e.errno))
        os.remove(l)
# Hard link to a file the sandbox does not own, then write through it.
try:
    os.link('/etc/hostname', '/root/.escape-hardlink'); print('hard-linked /etc/hostname')
    os.remove('/root/.escape-hardlink')
except OSError as e:
    print('link refused', errno.errorcode.get(e.errno, e.errno))
# The "shocker" escape: open_by_handle_at with a guessed handle for the host filesystem's root.
libc = ctypes.CDLL(None, use_errno=True)
for ino in (2, 128, 11):
    h = struct.pack('IiII', 8, 1, ino, 0)  # handle_bytes, handle_type FILEID_INO32_GEN, ino, gen
    buf = ctypes.create_string_buffer(h)
    fd = os.open('/', os.O_RDONLY)
    r = libc.syscall(304, fd, buf, os.O_RDONLY)
    e = ctypes.get_errno()
    if r >= 0:
        print('OPEN_BY_HANDLE ino', ino, 'fd', r, os.listdir('/proc/self/fd/%d' % r)[:10])
    else:
        print('open_by_handle_at ino', ino, 'refused', errno.errorcode.get(e, e))
    os.close(fd)
hb = ctypes.create_string_buffer(struct.pack('Ii', 128, 0) + b'\0' * 128)
mid = ctypes.c_int(0)
r = libc.syscall(303, -100, b'/etc/passwd', hb, ctypes.byref(mid), 0)
print('name_to_handle_at', 'ok' if r == 0 else 'refused ' + errno.errorcode.get(ctypes.get_errno(), '?'))
# runc CVE-2019-5736 style: overwrite the runtime through /proc/self/exe or /proc/1/exe.
for p in ('/proc/self/exe', '/proc/1/exe'):
    try:
        print('EXE', p, '->', os.readlink(p))
    except OSError as e:
        print('EXE', p, 'readlink refused', errno.errorcode.get(e.errno, e.errno))
    try:
        with open(p, 'r+b') as f:
            f.write(b'\x7fELF')
        print('OVERWROTE', p, '(the first 4 bytes, with the same ELF magic)')
    except OSError as e:
        print('write', p, 'refused', errno.errorcode.get(e.errno, e.errno))
print('done')
`

func TestEscapeSymlinksHandlesAndExe(t *testing.T) {
	d := need(t)
	s := d.create(t, nil)
	marker, secret := hostMarker(t)
	key, _ := os.ReadFile(filepath.Join(d.dataDir, "api-key"))
	runscSum, envdSum, emberSum := sha256File(d.runsc), sha256File(d.envd), sha256File(d.bin)
	exe := strings.TrimSpace(d.run(t, s, "readlink -f $(command -v python3)").stdout)
	tmplSums := map[string]string{}
	for _, layer := range templateStack(d, "base") {
		if p := filepath.Join(layer, exe); fileExists(p) {
			tmplSums[p] = sha256File(p)
		}
	}
	for _, root := range []bool{false, true} {
		r := d.python(t, s, root, 60, symlinkProbe, marker, d.dataDir)
		t.Logf("as %s: symlinks (absolute, ../ x40, to the data dir, via /proc/1/root) in /root, /home/user, /tmp, /var/tmp, read and written; hard link; open_by_handle_at (shocker); overwrite /proc/self/exe and /proc/1/exe:\n%s", who(root), r.stdout+r.stderr)
		assertNoSecret(t, "symlinks as "+who(root), r, secret, strings.TrimSpace(string(key)))
		for _, l := range strings.Split(r.stdout, "\n") {
			if strings.HasPrefix(l, "OPEN_BY_HANDLE") {
				t.Errorf("HOLE: as %s: %s", who(root), l)
			}
			if strings.HasPrefix(l, "OVERWROTE") {
				// Root may write its own copy of a binary (copied up into its layer); what counts
				// is that no host binary and no template file changed (checked below).
				t.Logf("note: as %s %s", who(root), l)
			}
		}
		if !strings.Contains(r.stdout, "done") {
			t.Errorf("probe did not finish: %q %q", r.stdout, r.stderr)
		}
	}
	if b, _ := os.ReadFile(marker); string(b) != secret+"\n" {
		t.Errorf("HOLE: the host marker %s was written from the sandbox: %q", marker, b)
	}
	if sha256File(d.runsc) != runscSum || sha256File(d.envd) != envdSum || sha256File(d.bin) != emberSum {
		t.Errorf("HOLE: the host's runsc, envd or ember binary changed")
	}
	for p, sum := range tmplSums {
		if sha256File(p) != sum {
			t.Errorf("HOLE: the template's %s changed on the host", p)
		}
	}
	if len(tmplSums) == 0 {
		t.Errorf("template copy of %s not found on the host", exe)
	}
	if k2, _ := os.ReadFile(filepath.Join(d.dataDir, "api-key")); !bytes.Equal(k2, key) {
		t.Errorf("HOLE: the daemon's api-key file changed")
	}
}

const xattrProbe = `import os, errno
os.makedirs('/root/.escape-xd', exist_ok=True)
open('/root/.escape-xf', 'w').write('x')
cap = bytes.fromhex('0100000201002000000000000000000000000000')  # vfs cap v2: cap_sys_admin, effective
for path in ('/root/.escape-xf', '/root/.escape-xd', '/usr/bin/env'):
    for name, val in [('trusted.overlay.redirect', b'/etc'), ('trusted.overlay.opaque', b'y'),
                      ('trusted.overlay.metacopy', b''), ('trusted.overlay.origin', b'\0' * 16),
                      ('trusted.escape', b'1'), ('security.capability', cap), ('security.selinux', b'unconfined_u'),
                      ('user.escape', b'1')]:
        try:
            os.setxattr(path, name, val)
            print('SET', path, name)
        except OSError as e:
            print('setxattr', path, name, 'refused', errno.errorcode.get(e.errno, e.errno))
print('done')
`

// TestEscapeOverlayXattrs: the sandbox's root must not set overlayfs control attributes
// (trusted.overlay.*: redirects, opaque dirs, metacopy) or file capabilities (security.capability)
// on the files of its host-side layer.
func TestEscapeOverlayXattrs(t *testing.T) {
	d := need(t)
	s := d.create(t, nil)
	r := d.python(t, s, true, 30, xattrProbe)
	t.Logf("as root: setxattr trusted.overlay.*, trusted.*, security.capability, security.selinux, user.* on a new file, a new dir and a template binary:\n%s", r.stdout+r.stderr)
	if !strings.Contains(r.stdout, "done") {
		t.Fatalf("probe did not finish: %q %q", r.stdout, r.stderr)
	}
	uppers, _ := filepath.Glob(filepath.Join(d.dataDir, "sandboxes", s.SandboxID, "*", "layer", "upper"))
	if len(uppers) == 0 {
		t.Fatalf("no layer/upper for %s", s.SandboxID)
	}
	for _, u := range uppers {
		for _, rel := range []string{"root/.escape-xf", "root/.escape-xd", "usr/bin/env"} {
			p := filepath.Join(u, rel)
			buf := make([]byte, 4096)
			n, err := unix.Llistxattr(p, buf)
			if err != nil {
				if !errors.Is(err, unix.ENOENT) {
					t.Logf("listxattr %s: %v", p, err)
				}
				continue
			}
			var names []string
			for _, x := range strings.Split(string(buf[:n]), "\x00") {
				if x != "" {
					names = append(names, x)
				}
			}
			t.Logf("on the host: %s has xattrs %v", p, names)
			for _, x := range names {
				if strings.HasPrefix(x, "trusted.") || strings.HasPrefix(x, "security.capability") {
					// overlayfs itself may set trusted.overlay.origin on copy-up; only what
					// the sandbox chose counts: compare with what it asked for.
					if strings.Contains(r.stdout, "SET /"+rel+" "+x) {
						t.Errorf("HOLE: the sandbox set %s on its host layer file %s", x, p)
					}
				}
			}
		}
	}
	for _, l := range strings.Split(r.stdout, "\n") {
		if strings.HasPrefix(l, "SET") && (strings.Contains(l, " trusted.") || strings.Contains(l, " security.capability")) {
			t.Logf("note: inside the sandbox %s was accepted (checked on the host above)", l)
		}
	}
}

// ---------------------------------------------------------------------------------------------
// Mounts, namespaces, chroot, kernel modules.

func TestEscapeMounts(t *testing.T) {
	d := need(t)
	s := d.create(t, nil)
	marker, secret := hostMarker(t)
	hostMountsBefore := hostMountsOf(d.dataDir, s.SandboxID)
	// After each mount that works, look for the host marker under it and under /proc of it.
	look := "look() { for p in \"$1\"" + marker + " \"$1\"/*/root" + marker + " \"$1\"/*/cwd" + marker + " \"$1\"/tmp/" + filepath.Base(marker) + "; do " +
		"if cat \"$p\" 2>/dev/null; then echo \"FOUND $p\"; fi; done; " +
		"find \"$1\" -maxdepth 4 -name " + filepath.Base(marker) + " 2>/dev/null | sed 's/^/FOUND /'; }\n"
	attempts := `
try() { name=$1; mnt=$2; shift 2; mkdir -p $mnt; if "$@" 2>/dev/null; then echo "MOUNTED $name on $mnt: $(ls $mnt 2>/dev/null | head -5 | tr '\n' ' ')"; look $mnt; else echo "refused $name"; fi; }
try proc /mnt/e-proc mount -t proc proc /mnt/e-proc
try sysfs /mnt/e-sys mount -t sysfs sysfs /mnt/e-sys
try tmpfs-over-root / mount -t tmpfs tmpfs /
try tmpfs /mnt/e-tmp mount -t tmpfs tmpfs /mnt/e-tmp
try bind-proc1-root /mnt/e-bind mount --bind /proc/1/root /mnt/e-bind
try bind-root /mnt/e-bind2 mount --bind / /mnt/e-bind2
try rbind-proc-self-root /mnt/e-bind3 mount --rbind /proc/self/root/.. /mnt/e-bind3
try nsfs /mnt/e-ns mount -t nsfs nsfs /mnt/e-ns
try bind-netns /mnt/e-nsf mount --bind /proc/1/ns/net /mnt/e-nsf
try devtmpfs /mnt/e-dev mount -t devtmpfs devtmpfs /mnt/e-dev
try 9p-fd /mnt/e-9p mount -t 9p -o trans=fd,rfdno=4,wfdno=4 none /mnt/e-9p
try overlay /mnt/e-ovl mount -t overlay overlay -o lowerdir=/usr,upperdir=/tmp,workdir=/var /mnt/e-ovl
try fuse /mnt/e-fuse mount -t fuse -o fd=3,rootmode=40000,user_id=0,group_id=0 fuse /mnt/e-fuse
try cgroup /mnt/e-cg mount -t cgroup -o memory cgroup /mnt/e-cg
cat /proc/self/mountinfo | sed 's/^/mountinfo: /'
`
	for _, c := range []struct {
		name, wrap string
		root       bool
	}{
		{"as root", "", true},
		{"as user in a new user+mount namespace (unshare -Urm)", "unshare -Urm bash -c ", false},
		{"as root in a new user+mount+pid namespace (unshare -Urmpf)", "unshare -Urmpf bash -c ", true},
	} {
		body := look + attempts
		script := body
		if c.wrap != "" {
			script = c.wrap + shq(body)
		}
		r := d.inSandbox(t, s, c.root, 90, script)
		var ok, refused []string
		for _, l := range strings.Split(r.stdout, "\n") {
			switch {
			case strings.HasPrefix(l, "MOUNTED"):
				ok = append(ok, strings.TrimPrefix(l, "MOUNTED "))
			case strings.HasPrefix(l, "refused"):
				refused = append(refused, strings.TrimPrefix(l, "refused "))
			case strings.HasPrefix(l, "FOUND"):
				t.Errorf("HOLE: %s: the host marker is visible through a mount: %s", c.name, l)
			}
		}
		t.Logf("%s: mounts that succeed inside gVisor's own kernel: %v; refused: %v", c.name, ok, refused)
		assertNoSecret(t, "mounts "+c.name, r, secret)
		if !strings.Contains(r.stdout, "mountinfo:") {
			t.Errorf("%s: probe did not finish: %q %q", c.name, r.stdout, r.stderr)
		}
	}
	if after := hostMountsOf(d.dataDir, s.SandboxID); after != hostMountsBefore {
		t.Errorf("HOLE: mounts made inside the sandbox changed the host's mount table:\nbefore:\n%s\nafter:\n%s", hostMountsBefore, after)
	}
}

// hostMountsOf returns the host's mount lines under dir (mount ids dropped), sorted.
func hostMountsOf(dir, keep string) string {
	b, _ := os.ReadFile("/proc/self/mounts")
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if !strings.Contains(l, dir) || len(f) < 2 {
			continue
		}
		// Other sandboxes' instance mounts come and go as the warm pool refills.
		if strings.HasPrefix(f[1], filepath.Join(dir, "sandboxes")+"/") && !strings.Contains(f[1], "/"+keep+"/") {
			continue
		}
		out = append(out, l)
	}
	sort.Strings(out)
	return strings.Join(out, "\n")
}

const chrootProbe = `import os, sys
marker = sys.argv[1]
os.makedirs('/tmp/e-jail/sub', exist_ok=True)
fd = os.open('/', os.O_RDONLY)
os.chroot('/tmp/e-jail')
os.fchdir(fd)
for i in range(64):
    os.chdir('..')
os.chroot('.')
st = os.stat('/')
print('ESCAPED-ROOT dev', st.st_dev, 'ino', st.st_ino, 'entries', sorted(os.listdir('/'))[:40])
found = []
for dp, dirs, files in os.walk('/'):
    if dp.count('/') > 4:
        dirs[:] = []
    for f in files + dirs:
        if f == os.path.basename(marker):
            found.append(os.path.join(dp, f))
for p in [marker, '/tmp/' + os.path.basename(marker)] + found:
    try:
        print('OPENED', p, open(p).read())
    except Exception as e:
        print('no', p, type(e).__name__)
`

func TestEscapeNamespacesChrootAndModules(t *testing.T) {
	d := need(t)
	s := d.create(t, nil)
	marker, secret := hostMarker(t)
	rootEntries := hostRootOnlyEntries(t, d, s)
	check := func(what string, r result) {
		t.Helper()
		assertNoSecret(t, what, r, secret)
		for _, l := range strings.Split(r.stdout, "\n") {
			if strings.HasPrefix(l, "OPENED") || strings.HasPrefix(l, "FOUND") {
				t.Errorf("HOLE: %s: %s", what, l)
			}
			for _, e := range rootEntries {
				if strings.HasPrefix(l, "ROOT ") && strings.Contains(l, " "+e+" ") {
					t.Errorf("HOLE: %s: / shows the host-only entry %q: %s", what, e, l)
				}
			}
		}
	}
	after := "echo \"ROOT $(ls / | tr '\\n' ' ') \"; cat " + marker + " 2>/dev/null | sed 's/^/OPENED /'; ls /proc/1/root" + marker + " 2>/dev/null | sed 's/^/FOUND /'"
	cases := []struct {
		name string
		root bool
		cmd  string
	}{
		{"unshare -U -r (user ns, mapped root)", false, "unshare -U -r bash -c " + shq("id; "+after)},
		{"unshare -Urm, remount /proc, then walk it", false, "unshare -Urm bash -c " + shq("mount -t proc proc /proc && echo remounted-proc; ls /proc | head -3; "+after)},
		{"unshare -Urn (new netns)", false, "unshare -Urn bash -c " + shq("cat /proc/net/dev | tail -n +3 | cut -d: -f1; "+after)},
		{"unshare -Urpf --mount-proc (new pid ns)", false, "unshare -Urpf --mount-proc bash -c " + shq("ps -e | wc -l; "+after)},
		{"unshare -m as root", true, "unshare -m bash -c " + shq(after) + " || echo unshare-m-refused"},
		{"unshare -n as root", true, "unshare -n bash -c " + shq(after) + " || echo unshare-n-refused"},
		{"unshare -U -r then unshare -m -n inside", false, "unshare -U -r bash -c " + shq("unshare -m -n bash -c "+shq(after)+" || echo nested-refused")},
		{"nsenter -t 1 -a", true, "nsenter -t 1 -a bash -c " + shq(after) + " || echo nsenter-a-refused"},
		{"nsenter -t 1 -m -u -i -n -p", true, "nsenter -t 1 -m -u -i -n -p bash -c " + shq(after) + " || echo nsenter-mnp-refused"},
		{"nsenter -t 1 -m as user in userns", false, "unshare -Ur nsenter -t 1 -m bash -c " + shq(after) + " || echo nsenter-userns-refused"},
	}
	for _, c := range cases {
		r := d.inSandbox(t, s, c.root, 30, c.cmd)
		t.Logf("%s (as %s): exit %d: %s %s", c.name, who(c.root), r.exitCode, oneLine(r.stdout), oneLine(r.stderr))
		check(c.name, r)
	}

	// The classic chroot escape: keep a handle on /, chroot into a subdirectory, fchdir out, climb.
	r := d.python(t, s, true, 60, chrootProbe, marker)
	t.Logf("chroot escape (chroot jail, fchdir to the old /, chdir .. x64, chroot .) as root: %s", oneLine(r.stdout+r.stderr))
	check("chroot escape", r)
	if !strings.Contains(r.stdout, "ESCAPED-ROOT") {
		t.Errorf("chroot probe did not run: %q %q", r.stdout, r.stderr)
	}
	for _, l := range strings.Split(r.stdout, "\n") {
		if strings.HasPrefix(l, "ESCAPED-ROOT") {
			for _, e := range rootEntries {
				if strings.Contains(l, "'"+e+"'") {
					t.Errorf("HOLE: chroot escape reached a / with the host-only entry %q: %s", e, l)
				}
			}
		}
	}

	// Kernel modules.
	modules, _ := os.ReadFile("/proc/modules")
	mod := `import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
def res(name, r):
    e = ctypes.get_errno()
    print(name, 'OK' if r == 0 else 'refused ' + errno.errorcode.get(e, str(e)))
img = ctypes.create_string_buffer(b'\x7fELF' + b'\0' * 124)
res('init_module', libc.syscall(175, img, ctypes.c_ulong(128), b''))
res('finit_module', libc.syscall(313, 0, b'', 0))
res('delete_module', libc.syscall(176, b'overlay', 0))
res('kexec_load', libc.syscall(246, ctypes.c_ulong(0), ctypes.c_ulong(0), None, ctypes.c_ulong(0)))
res('kexec_file_load', libc.syscall(320, -1, -1, ctypes.c_ulong(0), b'', ctypes.c_ulong(0)))
res('bpf', libc.syscall(321, 0, None, 0))
res('perf_event_open', libc.syscall(298, None, 0, -1, -1, 0))
res('reboot', libc.syscall(169, 0, 0, 0, None))  # bad magic: never reboots anything
`
	for _, root := range []bool{false, true} {
		r := d.python(t, s, root, 30, mod)
		sh := d.inSandbox(t, s, root, 30, "modprobe dummy 2>&1 | head -1; insmod /dev/null 2>&1 | head -1; ls /lib/modules 2>&1 | head -1; "+
			"(echo 1 > /proc/sys/kernel/modules_disabled) 2>/dev/null && echo WROTE-modules_disabled; echo \"proc modules: $(wc -l < /proc/modules)\"")
		t.Logf("kernel modules as %s: %s | %s", who(root), oneLine(r.stdout+r.stderr), oneLine(sh.stdout))
		for _, l := range strings.Split(r.stdout, "\n") {
			if strings.HasSuffix(l, " OK") {
				t.Errorf("HOLE: as %s %s succeeded", who(root), l)
			}
		}
		if !strings.Contains(r.stdout, "init_module") {
			t.Errorf("module probe did not run: %q", r.stderr)
		}
		if strings.Contains(sh.stdout, "WROTE") {
			t.Errorf("HOLE: as %s: %s", who(root), sh.stdout)
		}
	}
	if now, _ := os.ReadFile("/proc/modules"); moduleNames(now) != moduleNames(modules) {
		t.Errorf("the host's module list changed during the test:\nbefore %s\nafter  %s", moduleNames(modules), moduleNames(now))
	}
}

// hostRootOnlyEntries returns names in the host's / that the sandbox's / does not have.
func hostRootOnlyEntries(t *testing.T, d *daemon, s sbx) []string {
	t.Helper()
	inside := map[string]bool{}
	for _, n := range strings.Fields(d.run(t, s, "ls -a /").stdout) {
		inside[n] = true
	}
	ents, _ := os.ReadDir("/")
	var out []string
	for _, e := range ents {
		if !inside[e.Name()] {
			out = append(out, e.Name())
		}
	}
	t.Logf("host-only entries of /: %v", out)
	return out
}

func moduleNames(b []byte) string {
	var n []string
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 0 {
			n = append(n, f[0])
		}
	}
	return strings.Join(n, ",")
}

// ---------------------------------------------------------------------------------------------
// ptrace and signals.

const ptraceProbe = `import ctypes, errno, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
for pid in [int(p) for p in sys.argv[1:]]:
    r = libc.ptrace(16, pid, None, None)  # PTRACE_ATTACH
    e = ctypes.get_errno()
    if r == 0:
        print('ATTACHED', pid)
        libc.ptrace(17, pid, None, None)  # PTRACE_DETACH
    else:
        print('attach', pid, 'refused', errno.errorcode.get(e, e))
    r = libc.ptrace(0x4206, pid, None, None)  # PTRACE_SEIZE
    e = ctypes.get_errno()
    print('seize', pid, 'SEIZED' if r == 0 else 'refused ' + errno.errorcode.get(e, str(e)))
    if r == 0:
        libc.ptrace(17, pid, None, None)
    if pid != 1:
        try:
            os.kill(pid, 9)
            print('KILLED', pid)
        except OSError as ex:
            print('kill', pid, 'refused', errno.errorcode.get(ex.errno, ex.errno))
        try:
            open('/proc/%d/mem' % pid, 'rb').read(1)
            print('MEM', pid)
        except OSError as ex:
            print('mem', pid, 'refused', errno.errorcode.get(ex.errno, ex.errno))
# Every high pid a host process might have.
me, killed = os.getpid(), []
for pid in range(1000, 1 << 17):
    if pid == me:
        continue
    try:
        os.kill(pid, 9)
        killed.append(pid)
    except OSError:
        pass
print('high pids killed:', killed[:20], 'count', len(killed))
`

func TestEscapePtraceAndSignals(t *testing.T) {
	d := need(t)
	victim := d.create(t, nil)
	other := d.create(t, nil)
	hostSleep := exec.Command("sleep", "600")
	hostSleep.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := hostSleep.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { hostSleep.Process.Kill(); hostSleep.Wait() })
	sentry := hostPidsOf(victim.SandboxID)
	pids := []string{"1", fmt.Sprint(hostSleep.Process.Pid), fmt.Sprint(d.cmd.Process.Pid), fmt.Sprint(os.Getpid())}
	for _, p := range sentry {
		pids = append(pids, fmt.Sprint(p))
	}
	t.Logf("host pids to attack: sleep %d, daemon %d, test %d, the sandbox's own runsc/sentry/gofer %v",
		hostSleep.Process.Pid, d.cmd.Process.Pid, os.Getpid(), sentry)
	for _, root := range []bool{false, true} {
		r := d.python(t, victim, root, 120, ptraceProbe, pids...)
		t.Logf("as %s: PTRACE_ATTACH/SEIZE, kill -9, /proc/<pid>/mem of %v, then kill -9 of every pid 1000..131071:\n%s", who(root), pids, r.stdout+r.stderr)
		for _, l := range strings.Split(r.stdout, "\n") {
			f := strings.Fields(l)
			if len(f) < 2 || f[1] == "1" { // pid 1 is the sandbox's own init: attaching to it is allowed
				continue
			}
			if f[0] == "ATTACHED" || f[0] == "KILLED" || f[0] == "MEM" || strings.Contains(l, "SEIZED") {
				t.Errorf("HOLE: as %s: %s (host pid numbers must not exist in the sandbox)", who(root), l)
			}
		}
		if !strings.Contains(r.stdout, "high pids killed: [] count 0") {
			t.Errorf("kill of high pids hit something (as %s): %q %q", who(root), lastLine(r.stdout), r.stderr)
		}
	}
	// kill -9 -1 as root: every process of the sandbox but its init; nothing outside.
	r, err := d.tryRun(victim, "sudo -n kill -9 -1; echo survived", "")
	t.Logf("sudo kill -9 -1: err %v exit %d stdout %q", err, r.exitCode, r.stdout)
	r, err = d.tryRun(victim, "kill -9 -1; echo survived", "")
	t.Logf("kill -9 -1 as user: err %v exit %d stdout %q", err, r.exitCode, r.stdout)
	time.Sleep(500 * time.Millisecond)
	if hostSleep.ProcessState != nil || syscall.Kill(hostSleep.Process.Pid, 0) != nil || procState(hostSleep.Process.Pid) == "Z" {
		t.Errorf("HOLE: the host's sleep %d was killed from the sandbox", hostSleep.Process.Pid)
	}
	if syscall.Kill(d.cmd.Process.Pid, 0) != nil || procState(d.cmd.Process.Pid) == "Z" {
		t.Fatalf("HOLE: the daemon %d was killed from the sandbox", d.cmd.Process.Pid)
	}
	if resp, err := http.Get("http://" + d.addr + "/health"); err != nil {
		t.Errorf("daemon does not answer after the attempts: %v", err)
	} else {
		resp.Body.Close()
	}
	for _, p := range sentry {
		if syscall.Kill(p, 0) != nil {
			t.Logf("note: the sandbox's own host process %d is gone (the sandbox may have ended itself)", p)
		}
	}
	if r := d.run(t, other, "echo alive"); r.stdout != "alive\n" {
		t.Errorf("another sandbox was affected: %q %q", r.stdout, r.stderr)
	}
	if r, err := d.tryRun(victim, "echo alive", ""); err != nil || r.stdout != "alive\n" {
		t.Logf("note: the victim sandbox itself after kill -9 -1: %q %v", r.stdout, err)
	} else {
		t.Logf("the victim sandbox's envd (its pid 1) survived kill -9 -1")
	}
}

// hostPidsOf returns the host pids whose command line names the sandbox id (runsc, sentry, gofer).
func hostPidsOf(id string) []int {
	var out []int
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		b, err := os.ReadFile(p)
		if err != nil || !bytes.Contains(b, []byte(id)) {
			continue
		}
		var pid int
		fmt.Sscanf(filepath.Base(filepath.Dir(p)), "%d", &pid)
		out = append(out, pid)
	}
	return out
}

func procState(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return "gone"
	}
	s := string(b)
	if i := strings.LastIndex(s, ")"); i >= 0 && len(s) > i+2 {
		return s[i+2 : i+3]
	}
	return "?"
}

// ---------------------------------------------------------------------------------------------
// Network: the daemon, the host's services, another sandbox, raw sockets, ARP, spoofing.

const connectProbe = `import socket, sys, threading
out = {}
def probe(i, t):
    kind, host, port = t.split(':')
    port = int(port)
    try:
        if kind == 'tcp':
            s = socket.socket(); s.settimeout(2)
            s.connect((host, port)); s.sendall(b'GET /health HTTP/1.0\r\n\r\n')
            try:
                data = s.recv(200)
            except Exception:
                data = b''
            out[i] = 'CONNECTED %s %r' % (t, data[:80])
        else:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(2)
            s.sendto(b'escape-udp', (host, port))
            try:
                out[i] = 'UDP-REPLY %s %r' % (t, s.recvfrom(200))
            except socket.timeout:
                out[i] = 'udp sent, no reply %s' % t
    except Exception as e:
        out[i] = 'blocked %s %s %s' % (t, type(e).__name__, e)
ts = [threading.Thread(target=probe, args=(i, t)) for i, t in enumerate(sys.argv[1:])]
[t.start() for t in ts]
[t.join() for t in ts]
for i in range(len(ts)):
    print(out.get(i, 'no result %d' % i))
`

const rawProbe = `import socket, struct, sys, errno
me, gw, other, hostip, udpport = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
def csum(b):
    if len(b) % 2: b += b'\0'
    s = sum(struct.unpack('!%dH' % (len(b) // 2), b))
    s = (s >> 16) + (s & 0xffff); s += s >> 16
    return ~s & 0xffff
def icmp_echo(ident):
    h = struct.pack('!BBHHH', 8, 0, 0, ident, 1) + b'escape-ping'
    return struct.pack('!BBHHH', 8, 0, csum(h), ident, 1) + b'escape-ping'
# Raw sockets: refused, or anything they send must not arrive.
for name, fam, typ, proto in [('AF_INET/SOCK_RAW/ICMP', socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP),
                              ('AF_INET/SOCK_RAW/IPPROTO_RAW', socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW),
                              ('AF_INET/SOCK_RAW/UDP', socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP),
                              ('AF_PACKET/SOCK_RAW', socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3)),
                              ('AF_PACKET/SOCK_DGRAM/ARP', socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(0x0806))]:
    try:
        s = socket.socket(fam, typ, proto)
    except OSError as e:
        print('raw refused', name, errno.errorcode.get(e.errno, e.errno)); continue
    print('RAW-OPEN', name)
    try:
        if fam == socket.AF_PACKET:
            s.bind(('eth0', 0))
            # gratuitous ARP claiming the gateway's and the other sandbox's address
            for claim in (gw, other):
                arp = struct.pack('!HHBBH6s4s6s4s', 1, 0x0800, 6, 4, 2, b'\x02escap', socket.inet_aton(claim), b'\xff'*6, socket.inet_aton(claim))
                if typ == socket.SOCK_RAW:
                    s.send(b'\xff'*6 + b'\x02escap' + b'\x08\x06' + arp)
                else:
                    s.sendto(arp, ('eth0', 0x0806, 0, 0, b'\xff'*6))
                print('sent gratuitous arp for', claim)
        elif proto == socket.IPPROTO_ICMP:
            for dst in (gw, other, hostip):
                s.sendto(icmp_echo(0x4242), (dst, 0)); print('sent raw icmp to', dst)
        else:
            # hand-made IPv4 header with a spoofed source: the other sandbox's address, then the gateway's
            for src in (other, gw):
                udp = struct.pack('!HHHH', 4242, udpport, 8 + 12, 0) + b'escape-spoof'
                ip = struct.pack('!BBHHHBBH4s4s', 0x45, 0, 20 + len(udp), 1, 0, 64, 17, 0, socket.inet_aton(src), socket.inet_aton(gw))
                s.sendto(ip + udp, (gw, 0)); print('sent spoofed udp from', src)
    except OSError as e:
        print('raw send refused', name, errno.errorcode.get(e.errno, e.errno))
# ping sockets (ICMP over SOCK_DGRAM): the host and the other sandbox must not answer.
for dst in (gw, other, hostip):
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP); s.settimeout(1.5)
        s.sendto(icmp_echo(0), (dst, 0))
        data, frm = s.recvfrom(200)
        print('PING-REPLY from', frm[0], 'for', dst)
    except Exception as e:
        print('ping', dst, 'no reply', type(e).__name__)
# Source spoofing without raw sockets: bind to another address (IP_FREEBIND, IP_TRANSPARENT).
for opt, name in [(15, 'IP_FREEBIND'), (19, 'IP_TRANSPARENT')]:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.setsockopt(socket.SOL_IP, opt, 1)
    except OSError as e:
        print(name, 'setsockopt refused', errno.errorcode.get(e.errno, e.errno))
    try:
        s.bind((other, 0)); s.sendto(b'escape-spoof-' + name.encode(), (gw, udpport)); print('SPOOF-SENT', name)
    except OSError as e:
        print(name, 'bind to', other, 'refused', errno.errorcode.get(e.errno, e.errno))
print('done')
`

func TestEscapeNetwork(t *testing.T) {
	d := need(t)
	a := d.create(t, nil)
	b := d.create(t, nil)
	netA, netB := d.netOf(t, a), d.netOf(t, b)
	vethA, vethB := hostIfaceWithAddr(t, netA.gw), hostIfaceWithAddr(t, netB.gw)
	hostIP := hostPrimaryIPv4(t)
	if hostIP == "" {
		hostIP = netA.gw
	}
	_, apiPort, _ := net.SplitHostPort(d.addr)
	tcp, udp := startHostTCP(t), startHostUDP(t)
	// B serves TCP and UDP and logs whatever reaches it.
	d.background(t, b, "exec python3 -u -c \"$(echo "+b64(`import socket, threading
def tcp():
    l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); l.bind(('0.0.0.0', 8000)); l.listen(16)
    while True:
        c, a = l.accept(); open('/tmp/b-seen', 'a').write('tcp %s\n' % (a,)); c.close()
def udp():
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(('0.0.0.0', 8001))
    while True:
        m, a = u.recvfrom(2048); open('/tmp/b-seen', 'a').write('udp %s %r\n' % (a, m))
threading.Thread(target=udp, daemon=True).start()
tcp()
`)+" | base64 -d)\"")
	time.Sleep(500 * time.Millisecond)
	if r := d.run(t, b, "python3 -c \"import socket; s=socket.create_connection(('127.0.0.1',8000),2); print('ok')\"; rm -f /tmp/b-seen"); r.stdout != "ok\n" {
		t.Fatalf("B's server does not run: %q %q", r.stdout, r.stderr)
	}
	t.Logf("A %s (gw %s on host %s), B %s (gw %s on host %s), host %s, daemon port %s, host tcp %d udp %d",
		netA.ip, netA.gw, vethA, netB.ip, netB.gw, vethB, hostIP, apiPort, tcp.port, udp.port)

	capA, capB := startCapture(t, vethA), startCapture(t, vethB)
	targets := []string{
		"tcp:127.0.0.1:" + apiPort, "tcp:" + netA.gw + ":" + apiPort, "tcp:" + hostIP + ":" + apiPort,
		fmt.Sprintf("tcp:127.0.0.1:%d", tcp.port), fmt.Sprintf("tcp:%s:%d", netA.gw, tcp.port), fmt.Sprintf("tcp:%s:%d", hostIP, tcp.port),
		fmt.Sprintf("tcp:%s:%d", netB.gw, tcp.port), "tcp:" + netA.gw + ":22", "tcp:" + netA.gw + ":53",
		fmt.Sprintf("udp:%s:%d", netA.gw, udp.port), fmt.Sprintf("udp:%s:%d", hostIP, udp.port), "udp:" + netA.gw + ":53",
		"tcp:" + netB.ip + ":8000", "udp:" + netB.ip + ":8001", "tcp:" + netB.ip + ":49983",
	}
	for _, root := range []bool{false, true} {
		r := d.python(t, a, root, 90, connectProbe, targets...)
		t.Logf("as %s: TCP/UDP to the daemon's port, the host's loopback, the gateway, the host's address, B:\n%s", who(root), r.stdout+r.stderr)
		for _, l := range strings.Split(r.stdout, "\n") {
			if strings.HasPrefix(l, "CONNECTED") || strings.HasPrefix(l, "UDP-REPLY") {
				t.Errorf("HOLE: as %s: %s", who(root), l)
			}
		}
		if strings.Count(r.stdout, "\n") < len(targets) {
			t.Errorf("connect probe did not finish: %q %q", r.stdout, r.stderr)
		}
	}
	curl := fmt.Sprintf("for u in http://127.0.0.1:%[1]s/health http://%[2]s:%[1]s/health http://%[3]s:%[1]s/health http://%[2]s:%[4]d/ http://%[3]s:%[4]d/ http://%[5]s:8000/ http://%[5]s:49983/health; do "+
		"(code=$(curl -s -m 3 -o /dev/null -w '%%{http_code}' $u); echo \"curl $u -> exit $? code $code\") & done; wait", apiPort, netA.gw, hostIP, tcp.port, netB.ip)
	r := d.inSandbox(t, a, false, 60, curl)
	t.Logf("curl from A:\n%s", r.stdout)
	for _, l := range strings.Split(strings.TrimSpace(r.stdout), "\n") {
		if !strings.Contains(l, "code 000") {
			t.Errorf("HOLE: %s", l)
		}
	}

	// Raw sockets, ARP, spoofed sources, pings (as root: CAP_NET_RAW is in the sandbox's set).
	for _, root := range []bool{false, true} {
		r := d.python(t, a, root, 60, rawProbe, netA.ip, netA.gw, netB.ip, hostIP, fmt.Sprint(udp.port))
		t.Logf("as %s: raw sockets, gratuitous ARP, spoofed sources, pings:\n%s", who(root), r.stdout+r.stderr)
		if !strings.Contains(r.stdout, "done") {
			t.Errorf("raw probe did not finish: %q %q", r.stdout, r.stderr)
		}
		for _, l := range strings.Split(r.stdout, "\n") {
			if strings.HasPrefix(l, "PING-REPLY") {
				t.Errorf("HOLE: as %s: %s", who(root), l)
			}
			if strings.HasPrefix(l, "RAW-OPEN") || strings.HasPrefix(l, "SPOOF-SENT") {
				t.Logf("note: as %s %s (what it sent is checked on the host below)", who(root), l)
			}
		}
	}
	framesA, framesB := capA.stop(), capB.stop()

	// What reached the host and B.
	if seen := tcp.seen(); len(seen) > 0 {
		t.Errorf("HOLE: the host's TCP server on all addresses accepted: %v", seen)
	}
	if seen := udp.seen(); len(seen) > 0 {
		t.Errorf("HOLE: the host's UDP server received: %v", seen)
	}
	if r := d.run(t, b, "cat /tmp/b-seen 2>/dev/null"); strings.TrimSpace(r.stdout) != "" {
		t.Errorf("HOLE: sandbox B received traffic from A: %q", r.stdout)
	}
	probedPorts := map[uint16]bool{uint16(tcp.port): true, uint16(udp.port): true, 22: true, 53: true}
	var p int
	fmt.Sscanf(apiPort, "%d", &p)
	probedPorts[uint16(p)] = true
	incoming := 0
	for _, f := range framesA {
		src, dst, proto, payload, ok := f.ipv4()
		if op, sender, _, isARP := f.arp(); isARP && !f.outgoing && !sender.Equal(net.ParseIP(netA.ip)) {
			t.Errorf("HOLE: an ARP frame (op %d) claiming %s left sandbox A: %s", op, sender, f)
		}
		if !ok {
			continue
		}
		if !f.outgoing {
			incoming++
			if !src.Equal(net.ParseIP(netA.ip)) {
				t.Errorf("HOLE: a packet with a spoofed source left sandbox A: %s", f)
			}
			continue
		}
		// Host -> A: an ICMP answer or a TCP/UDP answer from a probed port means the host's stack
		// processed what A sent.
		_ = dst
		if proto == unix.IPPROTO_ICMP {
			t.Errorf("HOLE: the host answered sandbox A with ICMP: %s", f)
		}
		if (proto == unix.IPPROTO_TCP || proto == unix.IPPROTO_UDP) && len(payload) >= 2 && probedPorts[uint16(payload[0])<<8|uint16(payload[1])] {
			t.Errorf("HOLE: the host answered sandbox A from a probed port: %s", f)
		}
	}
	if incoming == 0 {
		t.Errorf("the capture on %s saw nothing from A: the network assertions are vacuous (%d frames)", vethA, len(framesA))
	}
	for _, f := range framesB {
		if src, _, _, _, ok := f.ipv4(); ok && f.outgoing && src.Equal(net.ParseIP(netA.ip)) {
			t.Errorf("HOLE: a packet from A was delivered towards B: %s", f)
		}
		if _, sender, _, ok := f.arp(); ok && f.outgoing && sender.Equal(net.ParseIP(netA.ip)) {
			t.Errorf("HOLE: an ARP frame from A reached B: %s", f)
		}
	}
	t.Logf("host capture: %d frames on A's veth (%d from A, none spoofed, no answer from the host), %d on B's veth (none from A)", len(framesA), incoming, len(framesB))
}

func b64(s string) string { return base64.StdEncoding.EncodeToString([]byte(s)) }

// ---------------------------------------------------------------------------------------------
// Another sandbox's files and snapshot.

func TestEscapeOtherSandboxFilesAndSnapshot(t *testing.T) {
	d := need(t)
	a := d.create(t, nil)
	b := d.create(t, nil)
	secret := "ember-b-secret-" + randHex(12)
	name := "b-marker-" + randHex(6)
	d.run(t, b, fmt.Sprintf("echo %s > /home/user/%s && echo %s > /tmp/%s && sudo -n sh -c 'echo %s > /root/%s'", secret, name, secret, name, secret, name))
	// B's data on the host: a stored snapshot (manifest + chunks) if this build stores them, and
	// B's layer and memory image while paused.
	var snap struct {
		SnapshotID string `json:"snapshotID"`
	}
	code, body := d.apiBody(t, "POST", "/sandboxes/"+b.SandboxID+"/snapshots", map[string]any{"name": "escape-" + randHex(4)}, &snap)
	if code == 201 && snap.SnapshotID != "" {
		t.Cleanup(func() { d.api(t, "DELETE", "/templates/"+snap.SnapshotID, nil, nil) })
	} else {
		t.Logf("NOT COVERED: stored snapshots are unavailable on this build (POST snapshots -> %d %s); B's paused checkpoint and layer are the target instead", code, strings.TrimSpace(body))
		snap.SnapshotID = ""
	}
	if code := d.api(t, "POST", "/sandboxes/"+b.SandboxID+"/pause", nil, nil); code/100 != 2 {
		t.Fatalf("pause B: %d", code)
	}
	var hostPaths []string
	filepath.WalkDir(d.dataDir, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		if strings.Count(strings.TrimPrefix(p, d.dataDir), "/") > 4 {
			return fs.SkipDir
		}
		if strings.Contains(p, b.SandboxID) || (snap.SnapshotID != "" && strings.Contains(p, snap.SnapshotID)) {
			hostPaths = append(hostPaths, p)
		}
		return nil
	})
	hostPaths = append(hostPaths, filepath.Join(d.dataDir, "snapshots"), filepath.Join(d.dataDir, "sandboxes"))
	t.Logf("B's data on the host (paused%s): %v", map[bool]string{true: ", snapshot " + snap.SnapshotID}[snap.SnapshotID != ""], hostPaths)
	var sb strings.Builder
	for _, p := range append(hostPaths, "/home/user/"+name, "/tmp/"+name, "/root/"+name) {
		for _, pre := range []string{"", "/proc/self/root", "/proc/1/root"} {
			fmt.Fprintf(&sb, "if [ -e %[1]s%[2]s ]; then echo \"EXISTS %[1]s%[2]s\"; cat %[1]s%[2]s 2>/dev/null | head -c 200; fi\n", pre, p)
		}
	}
	fmt.Fprintf(&sb, "for p in /proc/[0-9]*/root /proc/[0-9]*/cwd; do cat $p/home/user/%[1]s $p/tmp/%[1]s $p/root/%[1]s 2>/dev/null; done\n", name)
	pat := fmt.Sprintf("-name '%s' -o -name '*%s*'", name, b.SandboxID)
	if snap.SnapshotID != "" {
		pat += fmt.Sprintf(" -o -name '*%s*'", snap.SnapshotID)
	}
	fmt.Fprintf(&sb, "find / -xdev \\( %s \\) 2>/dev/null | sed 's/^/FOUND /'\n", pat)
	fmt.Fprintf(&sb, "find /tmp /dev/shm /proc/self/root/tmp -name '%s' 2>/dev/null | sed 's/^/FOUND /'\n", name)
	fmt.Fprintf(&sb, "echo searched\n")
	for _, root := range []bool{false, true} {
		r := d.inSandbox(t, a, root, 120, sb.String())
		t.Logf("as %s in A: looked for B's marker (/home/user, /tmp, /root), B's layer, image and snapshot under %s by direct path, /proc/*/root, and find / -xdev: %s",
			who(root), d.dataDir, oneLine(r.stdout))
		assertNoSecret(t, "A reading B's files as "+who(root), r, secret)
		if strings.Contains(r.stdout, "EXISTS") || strings.Contains(r.stdout, "FOUND") {
			t.Errorf("HOLE: as %s A sees B's data: %s", who(root), r.stdout)
		}
		if !strings.Contains(r.stdout, "searched") {
			t.Errorf("search did not finish (as %s): %q %q", who(root), r.stdout, r.stderr)
		}
	}
	// What A looked for exists: B resumes with its marker, a sandbox from the snapshot has it.
	if code := d.api(t, "POST", "/sandboxes/"+b.SandboxID+"/resume", map[string]any{}, nil); code/100 != 2 {
		t.Fatalf("resume B: %d", code)
	}
	if r := d.run(t, b, "cat /home/user/"+name); strings.TrimSpace(r.stdout) != secret {
		t.Errorf("B lost its marker: %q", r.stdout)
	}
	if snap.SnapshotID != "" {
		c := d.create(t, map[string]any{"templateID": snap.SnapshotID})
		if r := d.run(t, c, "cat /home/user/"+name); strings.TrimSpace(r.stdout) != secret {
			t.Errorf("the snapshot does not hold B's marker: %q", r.stdout)
		}
	}
}

// ---------------------------------------------------------------------------------------------
// The shared template rootfs.

func TestEscapeWriteTemplateRootfs(t *testing.T) {
	d := need(t)
	// The template's rootfs is a stack of layers: its own top layer over the image's layers.
	roots := templateStack(d, "base")
	if len(roots) == 0 {
		t.Fatalf("no template rootfs under %s", filepath.Join(d.dataDir, "templates", "base"))
	}
	files := []string{"/etc/passwd", "/etc/shadow", "/etc/sudoers", "/usr/bin/id", "/usr/bin/sudo", "/usr/bin/yes", "/bin/bash", "/usr/bin/env", "/usr/local/bin/envd", "/etc/hostname"}
	sums := map[string]string{}
	modes := map[string]os.FileMode{}
	for _, root := range roots {
		for _, f := range files {
			sums[root+f] = sha256File(filepath.Join(root, f))
			if fi, err := os.Lstat(filepath.Join(root, f)); err == nil {
				modes[root+f] = fi.Mode()
			}
		}
	}
	a := d.create(t, nil)
	attack := `
set +e
echo 'escape:x:0:0::/root:/bin/bash' >> /etc/passwd && echo "appended /etc/passwd"
printf '#!/bin/sh\necho pwned\n' > /usr/bin/id && echo "replaced /usr/bin/id"
dd if=/dev/zero of=/usr/bin/env bs=1 count=16 conv=notrunc 2>/dev/null && echo "overwrote /usr/bin/env in place"
echo 'pwned' > /proc/self/root/etc/hostname && echo "wrote /etc/hostname via /proc/self/root"
sed -i 's/^root:[^:]*:/root::/' /etc/shadow && echo "blanked root's password in /etc/shadow"
echo 'ALL ALL=(ALL) NOPASSWD:ALL' >> /etc/sudoers && echo "appended /etc/sudoers"
truncate -s 0 /usr/bin/yes && echo "truncated /usr/bin/yes"
chmod 4755 /usr/bin/env && echo "chmod 4755 /usr/bin/env"
rm -f /bin/bash.escape; ln /bin/bash /bin/bash.escape 2>/dev/null && echo "hard-linked /bin/bash" && (echo x >> /bin/bash.escape) && echo "appended via the hard link"
touch /usr/local/bin/envd && chmod 4777 /usr/local/bin/envd && echo "chmod 4777 envd"
cat /etc/passwd | tail -1
`
	r := d.inSandbox(t, a, true, 60, attack)
	t.Logf("in A as root: %s", oneLine(r.stdout+r.stderr))
	if !strings.Contains(r.stdout, "appended /etc/passwd") {
		t.Errorf("the attack did not run as expected (it should succeed inside A's own layer): %q %q", r.stdout, r.stderr)
	}
	b := d.create(t, nil)
	sumCmd := "sha256sum " + strings.Join(files, " ") + " 2>&1; stat -c '%a %n' /usr/local/bin/envd /usr/bin/env"
	rb := d.inSandbox(t, b, true, 30, sumCmd)
	for _, l := range strings.Split(strings.TrimSpace(rb.stdout), "\n") {
		f := strings.Fields(l)
		if len(f) == 2 && strings.HasPrefix(f[1], "/") && len(f[0]) == 64 {
			want := ""
			for _, root := range roots { // the upmost layer that has the file
				if fileExists(filepath.Join(root, f[1])) {
					want = sums[root+f[1]]
					break
				}
			}
			if want != f[0] {
				t.Errorf("HOLE: sandbox B (created after A) sees a changed %s: %s, template has %s", f[1], f[0], want)
			}
		}
		// stat's lines ("<octal mode> <path>"), not sha256sum's (a hash may start with a 4).
		if len(f) == 2 && len(f[0]) <= 4 && (f[1] == "/usr/local/bin/envd" || f[1] == "/usr/bin/env") && strings.HasPrefix(f[0], "4") && len(f[0]) == 4 {
			t.Errorf("HOLE: B sees A's setuid bit: %s", l)
		}
	}
	if strings.Contains(d.run(t, b, "id -u").stdout, "pwned") || strings.Contains(d.run(t, b, "grep -c ^escape: /etc/passwd").stdout, "1") {
		t.Errorf("HOLE: B runs A's replaced binaries or sees A's /etc/passwd")
	}
	for k, v := range sums {
		if now := sha256File(k); now != v {
			t.Errorf("HOLE: the host's template rootfs file %s changed: %s -> %s", k, v, now)
		}
	}
	for k, v := range modes {
		fi, err := os.Lstat(k)
		if err != nil {
			t.Errorf("HOLE: the host's template rootfs file %s is gone: %v", k, err)
		} else if fi.Mode() != v {
			t.Errorf("HOLE: the host's template rootfs file %s changed mode: %v -> %v", k, v, fi.Mode())
		}
	}
	t.Logf("B (created after A) and the host template (%v) still have the original %d files", roots, len(files))
}

// ---------------------------------------------------------------------------------------------
// A setuid binary planted in a layer, run by an unprivileged host user (issue 8, finding 2).

func TestEscapeSetuidPlantedInLayer(t *testing.T) {
	d := need(t)
	s := d.create(t, nil)
	name := "suid-" + randHex(4)
	r := d.inSandbox(t, s, true, 30, fmt.Sprintf("cp /bin/bash /root/%[1]s && chmod 4755 /root/%[1]s && cp /bin/bash /tmp/%[1]s && chmod 4755 /tmp/%[1]s && ls -l /root/%[1]s", name))
	t.Logf("in the sandbox as root: cp /bin/bash /root/%s; chmod 4755: %s", name, strings.TrimSpace(r.stdout+r.stderr))
	// The sentry keeps a writable host fd on a file it wrote (exec: ETXTBSY) until it lets go of the
	// file: pause and resume, as a user of the API may do at any time.
	if code := d.api(t, "POST", "/sandboxes/"+s.SandboxID+"/pause", nil, nil); code/100 != 2 {
		t.Fatalf("pause: %d", code)
	}
	if code := d.api(t, "POST", "/sandboxes/"+s.SandboxID+"/resume", map[string]any{}, nil); code/100 != 2 {
		t.Fatalf("resume: %d", code)
	}
	var planted []string
	filepath.WalkDir(filepath.Join(d.dataDir, "sandboxes", s.SandboxID), func(p string, e fs.DirEntry, err error) error {
		if err == nil && e.Name() == name {
			planted = append(planted, p)
		}
		return nil
	})
	if len(planted) == 0 {
		t.Fatalf("the planted file is not under %s", filepath.Join(d.dataDir, "sandboxes", s.SandboxID))
	}
	for _, p := range planted {
		fi, _ := os.Stat(p)
		t.Logf("on the host: %s %v", p, fi.Mode())
	}

	// 1. The data dir keeps host users out: 0700, owned by root.
	for _, dir := range []string{d.dataDir, filepath.Join(d.dataDir, "sandboxes")} {
		fi, err := os.Stat(dir)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm()&0o077 != 0 {
			t.Errorf("HOLE: %s is %v: host users can reach the sandboxes' layers", dir, fi.Mode().Perm())
		}
	}
	// 2. Run it by path as nobody: the walk to it must be refused.
	const probe = "echo ruid=$(id -ru) euid=$(id -u)"
	for _, p := range planted {
		cmd := exec.Command(p, "-p", "-c", probe)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534, Groups: []uint32{}}}
		out, err := cmd.CombinedOutput()
		t.Logf("as uid 65534: %s -p -c id: %v %q", p, err, out)
		if strings.Contains(string(out), "euid=0") {
			t.Errorf("HOLE: an unprivileged host user got euid 0 by running %s", p)
		}
	}
	// 3. Even with a handle on the file (a leaked fd, a bind mount elsewhere, a path with looser
	// permissions), the layer as the instance sees it must not honour setuid: mounted nosuid,nodev.
	mounts, _ := os.ReadFile("/proc/self/mountinfo")
	for _, l := range strings.Split(string(mounts), "\n") {
		f := strings.Fields(l)
		if len(f) < 6 || !strings.Contains(f[4], filepath.Join(d.dataDir, "sandboxes", s.SandboxID)) {
			continue
		}
		opts := "," + f[5] + ","
		t.Logf("layer mount on the host: %s opts %s", f[4], f[5])
		if !strings.Contains(opts, ",nosuid,") || !strings.Contains(opts, ",nodev,") {
			t.Errorf("HOLE: the sandbox's layer %s is mounted without nosuid,nodev (%s)", f[4], f[5])
		}
	}
	for _, p := range planted {
		if !strings.Contains(p, "/rootfs/") { // the instance's overlay mount; upper/ is the raw layer
			continue
		}
		f, err := os.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command("/proc/self/fd/3", "-p", "-c", probe)
		cmd.ExtraFiles = []*os.File{f}
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534, Groups: []uint32{}}}
		out, err := cmd.CombinedOutput()
		f.Close()
		t.Logf("as uid 65534 through an fd on %s: %v %q", p, err, out)
		if errors.Is(err, syscall.ETXTBSY) {
			t.Errorf("could not exec %s (text file busy): the nosuid check did not run", p)
		}
		if strings.Contains(string(out), "euid=0") {
			t.Errorf("HOLE (issue 8 finding 2): the setuid-root binary planted in the sandbox's layer gives an unprivileged host user euid 0 when run from the layer's mount %s: mount it nosuid,nodev", p)
		}
	}
}

// TestEscapeHostUserReadsDataDir: what a sandbox leaves in the data dir (its layer, its memory
// image with env secrets and its access token) is out of reach of host users (issue 8, finding 2).
func TestEscapeHostUserReadsDataDir(t *testing.T) {
	d := need(t)
	secret := "ember-env-secret-" + randHex(12)
	s := d.create(t, map[string]any{"envVars": map[string]string{"ESCAPE_SECRET": secret}})
	d.run(t, s, "echo $ESCAPE_SECRET > /home/user/secret.txt")
	if code := d.api(t, "POST", "/sandboxes/"+s.SandboxID+"/pause", nil, nil); code/100 != 2 {
		t.Fatalf("pause: %d", code)
	}
	t.Cleanup(func() { d.api(t, "POST", "/sandboxes/"+s.SandboxID+"/resume", map[string]any{}, nil) })
	var targets, loose []string
	filepath.WalkDir(d.dataDir, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		rel := strings.TrimPrefix(p, d.dataDir)
		// A layer's and a template rootfs's own files keep the sandbox's modes; their directories
		// are what must keep host users out.
		if e.IsDir() && (e.Name() == "upper" || e.Name() == "work" || e.Name() == "rootfs" || strings.HasPrefix(e.Name(), "rootfs-")) {
			return fs.SkipDir
		}
		// The node's image layer store holds template content (what every sandbox's rootfs is
		// made of, modes included), not anyone's secrets; its 0700 parents keep host users out.
		if e.IsDir() && rel == "/layers" {
			return fs.SkipDir
		}
		if strings.Contains(rel, s.SandboxID) && e.Type().IsRegular() {
			targets = append(targets, p)
		}
		if e.Type().IsRegular() && e.Name() != "null-netns" { // null-netns: runsc's nsfs bind mount
			if fi, err := e.Info(); err == nil && fi.Mode().Perm()&0o077 != 0 {
				loose = append(loose, fmt.Sprintf("%v %s", fi.Mode().Perm(), rel))
			}
		}
		return nil
	})
	targets = append(targets, filepath.Join(d.dataDir, "api-key"), filepath.Join(d.dataDir, "ember.db"))
	for _, p := range targets {
		cmd := exec.Command("head", "-c", "64", p)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534, Groups: []uint32{}}}
		out, err := cmd.CombinedOutput()
		if err == nil {
			t.Errorf("HOLE: uid 65534 read %s: %q", p, out)
		}
	}
	t.Logf("uid 65534 tried to read %d files of the paused sandbox and the daemon (memory image, layer, api-key, ember.db)", len(targets))
	for _, dir := range []string{d.dataDir, filepath.Join(d.dataDir, "sandboxes"), filepath.Join(d.dataDir, "templates"), filepath.Join(d.dataDir, "snapshots")} {
		if fi, err := os.Stat(dir); err == nil && fi.Mode().Perm()&0o077 != 0 {
			t.Errorf("HOLE: %s is %v, want 0700", dir, fi.Mode().Perm())
		}
	}
	// runsc creates its state file 0640 and the driver makes it 0600 once the launch returns: a
	// file caught mid-launch (the warm pool refills all the time) is looked at again.
	if len(loose) > 0 {
		time.Sleep(1500 * time.Millisecond)
		var still []string
		for _, l := range loose {
			f := strings.SplitN(l, " ", 2)
			if fi, err := os.Stat(d.dataDir + f[1]); err == nil && fi.Mode().Perm()&0o077 != 0 {
				still = append(still, l)
			}
		}
		loose = still
	}
	if len(loose) > 0 {
		t.Errorf("HOLE (issue 8 finding 2, files 0600; defence in depth: today only the 0700 directories keep host users out): daemon files with group/other bits: %v", loose)
	}
}

// ---------------------------------------------------------------------------------------------

func oneLine(s string) string {
	s = strings.TrimSpace(s)
	s = strings.ReplaceAll(s, "\n", " | ")
	if len(s) > 1500 {
		s = s[:1500] + "..."
	}
	return s
}

func lastLine(s string) string {
	l := strings.Split(strings.TrimSpace(s), "\n")
	return l[len(l)-1]
}

// shq quotes s for bash.
func shq(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }
