package e2e

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/ember-sandbox/ember/internal/layerfs"
)

// What one daemon holds on the host, found by its own names only: runsc processes whose command
// line has --root=<its data dir>/runsc, netns e<node>-*, veths e<node><n>h, mounts under its data
// dir, instance state directories.

// instance is one line of `runsc --root=<root> list --format json`.
type instance struct {
	ID     string `json:"id"`
	Pid    int    `json:"pid"`
	Status string `json:"status"`
	Bundle string `json:"bundle"`
}

type proc struct {
	pid  int
	args string
}

type hostState struct {
	instances []instance
	procs     []proc   // runsc processes under the daemon's root
	netns     []string // e<node>-*
	veths     []string // e<node><n>h
	mounts    []string // mount points under the data dir (runsc's null-netns excluded)
	dirs      []string // instance state dirs: pool/*, sandboxes/*/run-*
}

func (h hostState) String() string {
	ids := make([]string, 0, len(h.instances))
	for _, i := range h.instances {
		ids = append(ids, i.ID+"("+i.Status+")")
	}
	return fmt.Sprintf("instances=%v runsc-procs=%d netns=%v veths=%v mounts=%v dirs=%v",
		ids, len(h.procs), h.netns, h.veths, h.mounts, h.dirs)
}

// empty: nothing of the daemon is left on the host.
func (h hostState) empty() bool {
	return len(h.instances)+len(h.procs)+len(h.netns)+len(h.veths)+len(h.mounts)+len(h.dirs) == 0
}

// runscCmd runs runsc on the daemon's root.
func (d *daemon) runscCmd(args ...string) ([]byte, error) {
	cmd := exec.Command(d.runsc, append([]string{"--root=" + d.runscRoot()}, args...)...)
	var out strings.Builder
	cmd.Stdout = &out
	err := cmd.Run()
	return []byte(out.String()), err
}

// instances lists what runsc knows under the daemon's root.
func (d *daemon) instances() []instance {
	if _, err := os.Stat(d.runscRoot()); err != nil {
		return nil
	}
	out, err := d.runscCmd("list", "--format", "json")
	if err != nil {
		return nil
	}
	var l []instance
	json.Unmarshal(out, &l)
	sort.Slice(l, func(i, j int) bool { return l[i].ID < l[j].ID })
	return l
}

// instanceState is `runsc state <id>` (status and the sandbox process's pid).
func (d *daemon) instanceState(id string) (instance, error) {
	out, err := d.runscCmd("state", id)
	if err != nil {
		return instance{}, err
	}
	var s instance
	err = json.Unmarshal(out, &s)
	return s, err
}

// runscProcs are the processes whose command line names the daemon's runsc root.
func (d *daemon) runscProcs() []proc {
	root := "--root=" + d.runscRoot()
	var out []proc
	files, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil || len(b) == 0 {
			continue
		}
		args := strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
		hit := false
		for _, a := range args {
			if a == root {
				hit = true
				break
			}
		}
		if !hit {
			continue
		}
		pid, _ := strconv.Atoi(filepath.Base(filepath.Dir(f)))
		if isZombie(pid) {
			continue
		}
		out = append(out, proc{pid: pid, args: strings.Join(args, " ")})
	}
	return out
}

func isZombie(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	i := strings.LastIndexByte(string(b), ')')
	return i < 0 || i+2 >= len(b) || b[i+2] == 'Z' || b[i+2] == 'X'
}

func (d *daemon) netnsList() []string {
	var out []string
	b, _ := exec.Command("ip", "netns", "list").Output()
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 0 && strings.HasPrefix(f[0], d.netPrefix()+"-") {
			out = append(out, f[0])
		}
	}
	sort.Strings(out)
	return out
}

// isVeth: name is <prefix><digits>h.
func (d *daemon) isVeth(name string) bool {
	rest, ok := strings.CutPrefix(name, d.netPrefix())
	if !ok || !strings.HasSuffix(rest, "h") || len(rest) < 2 {
		return false
	}
	_, err := strconv.Atoi(rest[:len(rest)-1])
	return err == nil
}

func (d *daemon) vethList() []string {
	var out []string
	ifs, _ := net.Interfaces()
	for _, i := range ifs {
		if d.isVeth(i.Name) {
			out = append(out, i.Name)
		}
	}
	sort.Strings(out)
	return out
}

// mountsUnder lists mount points under the data dir, deepest last.
func (d *daemon) mountsUnder() []string {
	b, _ := os.ReadFile("/proc/self/mounts")
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) > 1 && strings.HasPrefix(f[1], d.dataDir+"/") {
			out = append(out, f[1])
		}
	}
	return out
}

// instanceDirs lists the state directories instances live in.
func (d *daemon) instanceDirs() []string {
	a, _ := filepath.Glob(filepath.Join(d.dataDir, "pool", "*"))
	b, _ := filepath.Glob(filepath.Join(d.dataDir, "sandboxes", "*", "run-*"))
	return append(a, b...)
}

func (d *daemon) host() hostState {
	h := hostState{instances: d.instances(), procs: d.runscProcs(), netns: d.netnsList(), veths: d.vethList(), dirs: d.instanceDirs()}
	null := filepath.Join(d.runscRoot(), "null-netns")
	for _, m := range d.mountsUnder() {
		if m != null {
			h.mounts = append(h.mounts, m)
		}
	}
	return h
}

// purge removes everything the (stopped) daemon left on the host: its runsc instances and
// processes, netns, veths, nftables table, mounts and cgroups. It keeps the data dir (templates,
// store) so a later daemon of the same node can reuse it, and returns what it could not remove.
func (d *daemon) purge() []string {
	if d.running() {
		d.crash()
	}
	for _, i := range d.instances() {
		d.runscCmd("kill", "--all", i.ID, "KILL")
		d.runscCmd("delete", "--force", i.ID)
	}
	for i := 0; i < 3; i++ {
		ps := d.runscProcs()
		if len(ps) == 0 {
			break
		}
		for _, p := range ps {
			syscall.Kill(p.pid, syscall.SIGKILL)
		}
		time.Sleep(200 * time.Millisecond)
	}
	for _, n := range d.netnsList() {
		exec.Command("ip", "netns", "delete", n).Run()
	}
	for _, v := range d.vethList() {
		exec.Command("ip", "link", "delete", v).Run()
	}
	exec.Command("nft", "delete", "table", "inet", "ember_"+d.nodeID).Run()
	ms := d.mountsUnder()
	for i := len(ms) - 1; i >= 0; i-- {
		syscall.Unmount(ms[i], syscall.MNT_DETACH)
	}
	// The layer filesystem mounted over the data dir (ext4 hosts): its unmount detaches its
	// loop device.
	if err := layerfs.Unmount(d.dataDir, 10*time.Second); err != nil {
		fmt.Fprintf(os.Stderr, "e2e: node %s: %v\n", d.nodeID, err)
	}
	for _, pat := range []string{"/sys/fs/cgroup/*/ember-%s", "/sys/fs/cgroup/*/*/ember-%s", "/sys/fs/cgroup/*/*/*/ember-%s"} {
		dirs, _ := filepath.Glob(fmt.Sprintf(pat, d.nodeID))
		for _, dir := range dirs {
			kids, _ := filepath.Glob(filepath.Join(dir, "*"))
			for _, k := range kids {
				if fi, err := os.Stat(k); err == nil && fi.IsDir() {
					os.Remove(k)
				}
			}
			os.Remove(dir)
		}
	}
	var left []string
	if ps := d.runscProcs(); len(ps) > 0 {
		left = append(left, fmt.Sprintf("%d runsc processes", len(ps)))
	}
	left = append(left, d.netnsList()...)
	left = append(left, d.vethList()...)
	left = append(left, d.mountsUnder()...)
	left = append(left, d.layerLoops()...)
	return left
}

// layerLoops lists the loop devices still attached to the data dir's layer filesystem image.
func (d *daemon) layerLoops() []string {
	image := filepath.Join(d.dataDir, layerfs.ImageName)
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	var out []string
	for _, f := range files {
		b, _ := os.ReadFile(f)
		if strings.TrimSuffix(strings.TrimSpace(string(b)), " (deleted)") == image {
			out = append(out, "/dev/"+filepath.Base(filepath.Dir(filepath.Dir(f)))+" ("+image+")")
		}
	}
	return out
}

// poolSandboxIDs are the ids the daemon's pool instances (ready or being restored) will be
// assigned with (GET /ember/pools): their state lives under sandboxes/<id> before any create.
func (d *daemon) poolSandboxIDs() map[string]bool {
	var pools []struct {
		SandboxIDs []string `json:"sandboxIDs"`
	}
	out := map[string]bool{}
	if code, _, err := d.call(10*time.Second, "GET", "/ember/pools", nil, &pools); err != nil || code != 200 {
		return out
	}
	for _, p := range pools {
		for _, id := range p.SandboxIDs {
			out[id] = true
		}
	}
	return out
}
