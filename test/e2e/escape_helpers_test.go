package e2e

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Helpers of the escape tests (escape_test.go): probes run inside a sandbox, markers the host
// plants, and a packet capture on the host end of a sandbox's veth.

// randHex returns n random bytes as hex.
func randHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

// hostMarker writes /tmp/ember-escape-marker-<random> on the host, containing a random secret,
// and removes it when the test ends. No path inside a sandbox may ever show the secret.
func hostMarker(t *testing.T) (path, secret string) {
	t.Helper()
	secret = "ember-escape-secret-" + randHex(12)
	path = "/tmp/ember-escape-marker-" + randHex(6)
	if err := os.WriteFile(path, []byte(secret+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(path) })
	return path, secret
}

// inSandbox runs a bash script in the sandbox, as root (through sudo) or as the default user,
// bounded by timeout (seconds). The script travels base64-encoded, so it needs no quoting.
func (d *daemon) inSandbox(t *testing.T, s sbx, root bool, timeout int, script string) result {
	t.Helper()
	enc := base64.StdEncoding.EncodeToString([]byte(script))
	prefix := ""
	if root {
		prefix = "sudo -n "
	}
	cmd := fmt.Sprintf("echo %s | base64 -d > /tmp/.escape-probe-$$.sh && %stimeout -k 2 %d bash /tmp/.escape-probe-$$.sh; rc=$?; rm -f /tmp/.escape-probe-$$.sh; exit $rc", enc, prefix, timeout)
	r, err := d.tryRun(s, cmd, "")
	if err != nil {
		t.Fatalf("probe in %s: %v (stdout %q stderr %q)", s.SandboxID, err, r.stdout, r.stderr)
	}
	return r
}

// python runs a python3 program in the sandbox (as root or the default user) with args.
func (d *daemon) python(t *testing.T, s sbx, root bool, timeout int, program string, args ...string) result {
	t.Helper()
	enc := base64.StdEncoding.EncodeToString([]byte(program))
	quoted := make([]string, len(args))
	for i, a := range args {
		quoted[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
	}
	return d.inSandbox(t, s, root, timeout, fmt.Sprintf("echo %s | base64 -d > /tmp/.escape-probe-$$.py\npython3 /tmp/.escape-probe-$$.py %s\nrc=$?\nrm -f /tmp/.escape-probe-$$.py\nexit $rc\n", enc, strings.Join(quoted, " ")))
}

// who names the identity a probe ran as, for logs.
func who(root bool) string {
	if root {
		return "root (sudo)"
	}
	return "user"
}

// assertNoSecret fails if any secret shows in the probe's output.
func assertNoSecret(t *testing.T, what string, r result, secrets ...string) {
	t.Helper()
	for _, s := range secrets {
		if strings.Contains(r.stdout, s) || strings.Contains(r.stderr, s) {
			t.Errorf("HOLE: %s: the sandbox saw %q\nstdout:\n%s\nstderr:\n%s", what, s, r.stdout, r.stderr)
		}
	}
}

// sandboxNet is what a sandbox reports of its network: its address and its default gateway (the
// host end of its veth).
type sandboxNet struct{ ip, gw string }

const netProbe = `import socket
gw = ''
for l in open('/proc/net/route').readlines()[1:]:
    f = l.split()
    if f[1] == '00000000':
        gw = socket.inet_ntoa(bytes.fromhex(f[2])[::-1])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((gw or '10.255.255.255', 9))
print(s.getsockname()[0], gw)
`

func (d *daemon) netOf(t *testing.T, s sbx) sandboxNet {
	t.Helper()
	r := d.python(t, s, false, 10, netProbe)
	f := strings.Fields(r.stdout)
	if len(f) != 2 || net.ParseIP(f[0]) == nil || net.ParseIP(f[1]) == nil {
		t.Fatalf("sandbox %s network: %q %q", s.SandboxID, r.stdout, r.stderr)
	}
	return sandboxNet{ip: f[0], gw: f[1]}
}

// hostIfaceWithAddr returns the host interface holding ip (the host end of a sandbox's veth).
func hostIfaceWithAddr(t *testing.T, ip string) string {
	t.Helper()
	ifs, err := net.Interfaces()
	if err != nil {
		t.Fatal(err)
	}
	for _, i := range ifs {
		addrs, _ := i.Addrs()
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok && n.IP.String() == ip {
				return i.Name
			}
		}
	}
	t.Fatalf("no host interface has address %s", ip)
	return ""
}

// hostPrimaryIPv4 returns the IPv4 address of the host's default-route interface ("" if none).
// Packets to it from a sandbox are delivered locally: they never leave the machine.
func hostPrimaryIPv4(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("/proc/net/route")
	if err != nil {
		return ""
	}
	for _, l := range strings.Split(string(b), "\n")[1:] {
		f := strings.Fields(l)
		if len(f) < 2 || f[1] != "00000000" {
			continue
		}
		i, err := net.InterfaceByName(f[0])
		if err != nil {
			return ""
		}
		addrs, _ := i.Addrs()
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil {
				return n.IP.String()
			}
		}
	}
	return ""
}

// frame is one packet seen on a host interface.
type frame struct {
	outgoing bool // sent by the host towards the sandbox
	data     []byte
}

// ipv4 returns the frame's IPv4 header fields (ok false if it is not IPv4).
func (f frame) ipv4() (src, dst net.IP, proto byte, payload []byte, ok bool) {
	b := f.data
	if len(b) < 34 || binary.BigEndian.Uint16(b[12:14]) != unix.ETH_P_IP {
		return nil, nil, 0, nil, false
	}
	ihl := int(b[14]&0x0f) * 4
	if len(b) < 14+ihl {
		return nil, nil, 0, nil, false
	}
	return net.IP(b[26:30]), net.IP(b[30:34]), b[23], b[14+ihl:], true
}

// arp returns an ARP frame's operation, sender and target IPv4 (ok false if it is not ARP).
func (f frame) arp() (op uint16, sender, target net.IP, ok bool) {
	b := f.data
	if len(b) < 42 || binary.BigEndian.Uint16(b[12:14]) != unix.ETH_P_ARP {
		return 0, nil, nil, false
	}
	return binary.BigEndian.Uint16(b[20:22]), net.IP(b[28:32]), net.IP(b[38:42]), true
}

func (f frame) String() string {
	dir := "in "
	if f.outgoing {
		dir = "out"
	}
	if src, dst, proto, p, ok := f.ipv4(); ok {
		extra := ""
		if (proto == unix.IPPROTO_TCP || proto == unix.IPPROTO_UDP) && len(p) >= 4 {
			extra = fmt.Sprintf(" sport %d dport %d", binary.BigEndian.Uint16(p[0:2]), binary.BigEndian.Uint16(p[2:4]))
		}
		if proto == unix.IPPROTO_ICMP && len(p) >= 1 {
			extra = fmt.Sprintf(" icmp type %d", p[0])
		}
		return fmt.Sprintf("%s ipv4 %s > %s proto %d%s", dir, src, dst, proto, extra)
	}
	if op, s, tg, ok := f.arp(); ok {
		return fmt.Sprintf("%s arp op %d sender %s target %s", dir, op, s, tg)
	}
	return fmt.Sprintf("%s ethertype %#x len %d", dir, binary.BigEndian.Uint16(f.data[12:14]), len(f.data))
}

// capture records every frame on one host interface until stop.
type capture struct {
	fd     int
	mu     sync.Mutex
	frames []frame
	quit   chan struct{}
	done   chan struct{}
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

func startCapture(t *testing.T, ifname string) *capture {
	t.Helper()
	ifi, err := net.InterfaceByName(ifname)
	if err != nil {
		t.Fatal(err)
	}
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, int(htons(unix.ETH_P_ALL)))
	if err != nil {
		t.Fatalf("capture on %s: %v", ifname, err)
	}
	if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: ifi.Index}); err != nil {
		unix.Close(fd)
		t.Fatalf("capture on %s: bind: %v", ifname, err)
	}
	tv := unix.Timeval{Usec: 100000}
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	c := &capture{fd: fd, quit: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(c.done)
		buf := make([]byte, 65536)
		for {
			select {
			case <-c.quit:
				return
			default:
			}
			n, from, err := unix.Recvfrom(fd, buf, 0)
			if err != nil || n < 14 {
				continue
			}
			out := false
			if ll, ok := from.(*unix.SockaddrLinklayer); ok {
				out = ll.Pkttype == unix.PACKET_OUTGOING
			}
			c.mu.Lock()
			c.frames = append(c.frames, frame{outgoing: out, data: append([]byte(nil), buf[:n]...)})
			c.mu.Unlock()
		}
	}()
	t.Cleanup(func() { c.stop() })
	return c
}

// stop ends the capture (after a short grace for late frames) and returns what it saw.
func (c *capture) stop() []frame {
	select {
	case <-c.quit:
	default:
		time.Sleep(300 * time.Millisecond)
		close(c.quit)
		<-c.done
		unix.Close(c.fd)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]frame(nil), c.frames...)
}

// sha256File returns the hex sha256 of a host file ("missing: <err>" if unreadable).
func sha256File(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return "missing: " + err.Error()
	}
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])
}

// hostTCP listens on all host addresses (IPv4 and IPv6) on a random port and records every
// connection it accepts.
type hostListener struct {
	port     int
	mu       sync.Mutex
	accepted []string
}

func (h *hostListener) record(s string) {
	h.mu.Lock()
	h.accepted = append(h.accepted, s)
	h.mu.Unlock()
}

func (h *hostListener) seen() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]string(nil), h.accepted...)
}

func startHostTCP(t *testing.T) *hostListener {
	t.Helper()
	l, err := net.Listen("tcp", ":0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	h := &hostListener{port: l.Addr().(*net.TCPAddr).Port}
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			h.record("tcp from " + c.RemoteAddr().String())
			c.Close()
		}
	}()
	return h
}

func startHostUDP(t *testing.T) *hostListener {
	t.Helper()
	pc, err := net.ListenPacket("udp", ":0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc.Close() })
	h := &hostListener{port: pc.LocalAddr().(*net.UDPAddr).Port}
	go func() {
		buf := make([]byte, 2048)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			h.record(fmt.Sprintf("udp from %s: %q", from, buf[:n]))
		}
	}()
	return h
}

// templateStack is a template's layer directories on the host, top first as overlayfs stacks
// them: its own top layers (templates/<name>/rootfs-*), then the node's image layers (over-
// inclusive: every layer of the node, which is what "nothing on the host changed" needs).
func templateStack(d *daemon, name string) []string {
	tops, _ := filepath.Glob(filepath.Join(d.dataDir, "templates", name, "rootfs-*"))
	layers, _ := filepath.Glob(filepath.Join(d.dataDir, "layers", "sha256-*", "root"))
	return append(tops, layers...)
}

func fileExists(p string) bool {
	_, err := os.Lstat(p)
	return err == nil
}
