package e2e

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestPythonRunsAndExitCodes(t *testing.T) {
	d := need(t)
	s := d.create(t, nil)
	r := d.run(t, s, "python3 -c 'print(6*7)'")
	if r.stdout != "42\n" || r.exitCode != 0 {
		t.Fatalf("python3: stdout %q exit %d stderr %q, want \"42\\n\" exit 0", r.stdout, r.exitCode, r.stderr)
	}
	r = d.run(t, s, "echo oops >&2; exit 3")
	if r.exitCode != 3 || r.stderr != "oops\n" {
		t.Fatalf("exit 3: got exit %d stderr %q", r.exitCode, r.stderr)
	}
	r = d.run(t, s, "whoami; echo $HOME; sudo -n whoami")
	if r.stdout != "user\n/home/user\nroot\n" {
		t.Fatalf("default user / sudo: got %q (stderr %q)", r.stdout, r.stderr)
	}
	// The CLI streams through the same protocol and exits with the command's code.
	cmd := exec.Command(d.bin, "--url", "http://"+d.addr, "sandbox", "exec", s.SandboxID, "--", "echo cli-$((40+2)); exit 5")
	cmd.Env = append(os.Environ(), "E2B_API_KEY="+d.key)
	out, err := cmd.Output()
	ee, ok := err.(*exec.ExitError)
	if !ok || ee.ExitCode() != 5 || string(out) != "cli-42\n" {
		t.Fatalf("ember sandbox exec: out %q err %v, want cli-42 and exit 5", out, err)
	}
}

func TestSandboxesAreIsolatedFromEachOther(t *testing.T) {
	d := need(t)
	a := d.create(t, nil)
	b := d.create(t, nil)
	d.run(t, a, "echo secret-a > /home/user/a.txt && echo tmp-a > /tmp/a.txt")
	pid := d.background(t, a, "exec sleep 4242")
	if r := d.run(t, b, "ls /home/user/a.txt /tmp/a.txt"); r.exitCode == 0 {
		t.Fatalf("sandbox B sees A's files: %q", r.stdout)
	}
	if r := d.run(t, b, "ps -eo args | grep -c '[s]leep 4242'"); strings.TrimSpace(r.stdout) != "0" {
		t.Fatalf("sandbox B sees A's process (pid %d): %q", pid, r.stdout)
	}
	if r := d.run(t, a, "ps -eo args | grep -c '[s]leep 4242'"); strings.TrimSpace(r.stdout) != "1" {
		t.Fatalf("sandbox A lost its own process: %q", r.stdout)
	}
	// Neither the template rootfs on the host nor a new sandbox sees the write.
	matches, _ := filepath.Glob(filepath.Join(d.dataDir, "templates", "base", "rootfs-*", "home", "user", "a.txt"))
	if len(matches) != 0 {
		t.Fatalf("sandbox write reached the template rootfs: %v", matches)
	}
	c := d.create(t, nil)
	if r := d.run(t, c, "test -e /home/user/a.txt"); r.exitCode == 0 {
		t.Fatal("a new sandbox sees a file written by another")
	}
}

func TestSandboxCannotReachHost(t *testing.T) {
	d := need(t)
	s := d.create(t, nil)
	secret := filepath.Join(t.TempDir(), "host-secret.txt")
	os.WriteFile(secret, []byte("host-only"), 0o644)
	if r := d.run(t, s, "cat "+secret); r.exitCode == 0 || strings.Contains(r.stdout, "host-only") {
		t.Fatalf("sandbox read a host file: %q", r.stdout)
	}
	// A TCP port on the host's 127.0.0.1 and one on all host addresses.
	lo, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer lo.Close()
	all, err := net.Listen("tcp", "0.0.0.0:0")
	if err != nil {
		t.Fatal(err)
	}
	defer all.Close()
	accepted := make(chan string, 4)
	for _, l := range []net.Listener{lo, all} {
		go func(l net.Listener) {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				accepted <- c.RemoteAddr().String()
				c.Close()
			}
		}(l)
	}
	loPort := lo.Addr().(*net.TCPAddr).Port
	allPort := all.Addr().(*net.TCPAddr).Port
	_, apiPort, _ := net.SplitHostPort(d.addr)
	probe := `import socket,sys
def gw():
    for l in open('/proc/net/route').readlines()[1:]:
        f=l.split()
        if f[1]=='00000000':
            return socket.inet_ntoa(bytes.fromhex(f[2])[::-1])
targets=[('127.0.0.1',%d),(gw(),%d),(gw(),%s)]
for h,p in targets:
    s=socket.socket(); s.settimeout(2)
    try:
        s.connect((h,p)); print('CONNECTED',h,p)
    except Exception as e:
        print('blocked',h,p,type(e).__name__)
`
	r := d.run(t, s, fmt.Sprintf("python3 -c \"$(cat <<'EOF'\n%s\nEOF\n)\"", fmt.Sprintf(probe, loPort, allPort, apiPort)))
	if strings.Contains(r.stdout, "CONNECTED") || strings.Count(r.stdout, "blocked") != 3 {
		t.Fatalf("sandbox reached the host: %q %q", r.stdout, r.stderr)
	}
	select {
	case a := <-accepted:
		t.Fatalf("host listener accepted a connection from %s", a)
	default:
	}
}

func TestSandboxCannotReachAnotherSandbox(t *testing.T) {
	d := need(t)
	a := d.create(t, nil)
	b := d.create(t, nil)
	d.background(t, b, "exec python3 -m http.server 8000 --bind 0.0.0.0")
	ipB := strings.TrimSpace(d.run(t, b, `python3 -c "import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.connect(('10.255.255.255',1)); print(s.getsockname()[0])"`).stdout)
	if net.ParseIP(ipB) == nil {
		t.Fatalf("cannot find B's address: %q", ipB)
	}
	// The server really runs: the host reaches it through ember's sandbox plane.
	var ok bool
	for i := 0; i < 50 && !ok; i++ {
		ok = d.proxyGet(t, b, 8000, "/") == 200
		time.Sleep(100 * time.Millisecond)
	}
	if !ok {
		t.Fatal("B's http server is not reachable from the host through the sandbox plane")
	}
	r := d.run(t, a, fmt.Sprintf("curl -s -m 3 -o /dev/null -w '%%{http_code}' http://%s:8000/", ipB))
	if r.exitCode == 0 {
		t.Fatalf("sandbox A reached sandbox B at %s: %q", ipB, r.stdout)
	}
}

func TestKillReleasesEverything(t *testing.T) {
	d := need(t)
	before := settledResources(t)
	s := d.create(t, nil)
	d.background(t, s, "exec sleep 999")
	// The sandbox has a running instance, with its netns and state dir (wherever the daemon
	// keeps it: with the warm pool on, the instance may have been started ahead of the create).
	inst, ns := d.instanceOf(t, s)
	if inst.Status != "running" {
		t.Fatalf("instance %s of the sandbox is %s", inst.ID, inst.Status)
	}
	stateDir := filepath.Dir(inst.Bundle)
	if _, err := os.Stat(stateDir); err != nil {
		t.Fatalf("sandbox state dir missing while running: %v", err)
	}
	if inode(filepath.Join("/run/netns", ns)) == 0 {
		t.Fatalf("sandbox netns %s missing while running", ns)
	}
	if code := d.api(t, "DELETE", "/sandboxes/"+s.SandboxID, nil, nil); code != 204 {
		t.Fatalf("kill: %d", code)
	}
	gone := func() string {
		for _, i := range d.instances() {
			if i.ID == inst.ID {
				return "runsc still knows instance " + inst.ID
			}
		}
		for _, p := range d.runscProcs() {
			if strings.Contains(p.args, inst.ID) {
				return "a process of the killed sandbox is still running: " + p.args
			}
		}
		for _, m := range d.mountsUnder() {
			if strings.Contains(m, inst.ID) || strings.Contains(m, s.SandboxID) || strings.HasPrefix(m, stateDir+"/") {
				return "a mount of the killed sandbox remains: " + m
			}
		}
		if _, err := os.Stat(stateDir); !os.IsNotExist(err) {
			return fmt.Sprintf("sandbox state dir %s remains: %v", stateDir, err)
		}
		if _, err := os.Stat(filepath.Join(d.dataDir, "sandboxes", s.SandboxID)); !os.IsNotExist(err) {
			return fmt.Sprintf("sandbox dir remains: %v", err)
		}
		return ""
	}
	left := "?"
	for i := 0; i < 50 && left != ""; i++ {
		left = gone()
		time.Sleep(100 * time.Millisecond)
	}
	if left != "" {
		t.Fatal(left)
	}
	// The pool refills what the create took (and follows demand, so it may also shrink): once
	// settled, no more netns, veths and runsc processes than before.
	if after := settledResources(t); !after.notMore(before) {
		t.Fatalf("resources leaked after kill:\nbefore %+v\nafter  %+v", before.summary(), after.summary())
	}
	if code := d.api(t, "GET", "/sandboxes/"+s.SandboxID, nil, nil); code != 404 {
		t.Fatalf("get after kill: %d, want 404", code)
	}
}

// settledResources waits until the shared daemon's resources have not changed for 1 s (at most
// 20 s; the warm pool refills in the background).
func settledResources(t *testing.T) resources {
	t.Helper()
	prev := snapshotResources(t)
	stable := 0
	for i := 0; i < 200 && stable < 10; i++ {
		time.Sleep(100 * time.Millisecond)
		cur := snapshotResources(t)
		if cur.equal(prev) {
			stable++
		} else {
			stable = 0
		}
		prev = cur
	}
	return prev
}

type resources struct {
	netns, links []string
	runsc        int
	procs        string
	mounts       string
}

func (r resources) summary() string {
	return fmt.Sprintf("netns=%v links=%v runsc=%d", r.netns, r.links, r.runsc)
}

// sameCounts: as many netns, veths and runsc processes (names may differ: the pools refill).

func (r resources) notMore(o resources) bool {
	return len(r.netns) <= len(o.netns) && len(r.links) <= len(o.links) && r.runsc <= o.runsc
}

func (r resources) equal(o resources) bool {
	return strings.Join(r.netns, ",") == strings.Join(o.netns, ",") &&
		strings.Join(r.links, ",") == strings.Join(o.links, ",") && r.runsc == o.runsc
}

// snapshotResources lists what the shared daemon holds on the host: its network namespaces and
// veths (prefix "e<node id>"), the runsc processes of its data directory, processes and mounts.
func snapshotResources(t *testing.T) resources {
	t.Helper()
	dataDir := shared.dataDir
	var r resources
	r.netns = shared.netnsList()
	r.links = shared.vethList()
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	var sb strings.Builder
	for _, p := range procs {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		cl := strings.ReplaceAll(string(b), "\x00", " ")
		if argv0 := strings.SplitN(string(b), "\x00", 2)[0]; strings.Contains(filepath.Base(argv0), "runsc") && strings.Contains(cl, dataDir) {
			r.runsc++
		}
		sb.WriteString(cl + "\n")
	}
	r.procs = sb.String()
	m, _ := os.ReadFile("/proc/mounts")
	r.mounts = string(m)
	return r
}

func (d *daemon) proxyGet(t *testing.T, s sbx, port int, path string) int {
	t.Helper()
	req, _ := newRequest("GET", "http://"+d.addr+path)
	req.Header.Set("E2b-Sandbox-Id", s.SandboxID)
	req.Header.Set("E2b-Sandbox-Port", fmt.Sprint(port))
	resp, err := httpClient.Do(req)
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

func TestTemplateBuildWithStartAndReadyCommands(t *testing.T) {
	d := need(t)
	cli := func(args ...string) ([]byte, error) {
		cmd := exec.Command(d.bin, append([]string{"--url", "http://" + d.addr}, args...)...)
		cmd.Env = append(os.Environ(), "E2B_API_KEY="+d.key)
		return cmd.Output()
	}
	// A server started before the checkpoint is already running in every sandbox of the template.
	out, err := cli("template", "build", "web", "--json",
		"--start-cmd", "cd /tmp && echo warm > index.html && python3 -m http.server 8080",
		"--ready-cmd", "curl -sf http://127.0.0.1:8080/index.html")
	if err != nil {
		t.Fatalf("ember template build: %v\n%s\n%s", err, out, d.logs())
	}
	var built map[string]any
	if err := json.Unmarshal(out, &built); err != nil {
		t.Fatalf("--json output is not JSON: %q", out)
	}
	t.Cleanup(func() { d.api(t, "DELETE", "/templates/web", nil, nil) })
	out, err = cli("template", "ls", "--json")
	if err != nil || !strings.Contains(string(out), `"web"`) {
		t.Fatalf("template ls --json: %v %s", err, out)
	}
	s := d.create(t, map[string]any{"templateID": "web"})
	if r := d.run(t, s, "curl -sf http://127.0.0.1:8080/index.html"); r.stdout != "warm\n" {
		t.Fatalf("the template's server is not running in a new sandbox: %q %q", r.stdout, r.stderr)
	}
	if code := d.proxyGet(t, s, 8080, "/index.html"); code != 200 {
		t.Fatalf("guest port through the sandbox plane: %d", code)
	}
}
