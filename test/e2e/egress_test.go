package e2e

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netns"

	"github.com/ember-sandbox/ember/internal/testutil"
)

// The egress test runs its own daemon (node id "net", slot CIDR 10.213.0.0/16) and plays the
// internet with an "upstream" namespace of its own: every packet from that CIDR is routed there
// by policy routing (never off the machine), where servers answer on documentation addresses,
// a stand-in for the metadata service, a private address, and the sandbox's resolver (the
// host's nameserver, which the template copied).
const (
	egressNodeID = "net"
	egressCIDR   = "10.213.0.0/16"
	e2eNS        = "xnet-e2e"
	e2eVeth      = "xnete2e0"
	e2eTable     = "21313"
	e2eHostIP    = "203.0.113.249"
	e2eNSIP      = "203.0.113.250"
	e2ePubA      = "203.0.113.20"
	e2ePubB      = "203.0.113.21"
	e2eMetadata  = "169.254.169.254"
	e2ePrivate   = "10.250.98.1"
	e2eName      = "egress.test" // resolved by the upstream resolver to e2ePubA
)

func sh(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
		t.Fatalf("%s: %v: %s", strings.Join(args, " "), err, out)
	}
}

func quiet(args ...string) { _ = exec.Command(args[0], args[1:]...).Run() }

// sandboxResolver is the first IPv4 nameserver of the host's resolv.conf (what templates copy).
func sandboxResolver(t *testing.T) string {
	t.Helper()
	f, err := os.Open("/etc/resolv.conf")
	testutil.Need(t, err == nil, "no /etc/resolv.conf")
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if fs := strings.Fields(sc.Text()); len(fs) >= 2 && fs[0] == "nameserver" {
			if a, err := netip.ParseAddr(fs[1]); err == nil && a.Is4() && !a.IsLoopback() {
				return a.String()
			}
		}
	}
	testutil.Need(t, false, "the host has no IPv4 non-loopback nameserver for templates to copy")
	return ""
}

// inNetns runs fn on a thread inside the named netns (sockets it opens stay there).
func inNetns(t *testing.T, name string, fn func()) {
	t.Helper()
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			done <- err
			return
		}
		ns, err := netns.GetFromName(name)
		if err != nil {
			done <- err
			return
		}
		defer ns.Close()
		if err := netns.Set(ns); err != nil {
			done <- err
			return
		}
		fn()
		if err := netns.Set(orig); err == nil {
			runtime.UnlockOSThread()
		}
		done <- nil
	}()
	if err := <-done; err != nil {
		t.Fatalf("netns %s: %v", name, err)
	}
}

func makeE2EUpstream(t *testing.T, resolver string) (port string) {
	t.Helper()
	// Moved by EMBER_E2E_NODE_PREFIX/EMBER_E2E_NET_OFFSET like the daemon (newDaemonOpts).
	e2eNS, e2eVeth, e2eTable := e2eNS, e2eVeth, e2eTable
	if p := os.Getenv("EMBER_E2E_NODE_PREFIX"); p != "" {
		e2eNS, e2eVeth = e2eNS+p, "xnet"+p+"0"
	}
	if off := os.Getenv("EMBER_E2E_NET_OFFSET"); off != "" {
		e2eTable = fmt.Sprint(mustAtoi(e2eTable) + mustAtoi(off))
	}
	_, egressCIDR := isolate("", egressCIDR)
	cleanup := func() {
		quiet("ip", "rule", "del", "priority", e2eTable)
		quiet("ip", "rule", "del", "priority", fmt.Sprint(mustAtoi(e2eTable)-1))
		quiet("ip", "route", "flush", "table", e2eTable)
		quiet("ip", "link", "del", e2eVeth)
		quiet("ip", "netns", "del", e2eNS)
	}
	cleanup()
	t.Cleanup(cleanup)
	sh(t, "ip", "netns", "add", e2eNS)
	sh(t, "ip", "link", "add", e2eVeth, "type", "veth", "peer", "name", "eth0", "netns", e2eNS)
	sh(t, "ip", "addr", "add", e2eHostIP+"/30", "dev", e2eVeth)
	sh(t, "ip", "link", "set", e2eVeth, "up")
	in := func(args ...string) { sh(t, append([]string{"ip", "netns", "exec", e2eNS}, args...)...) }
	in("ip", "link", "set", "lo", "up")
	in("ip", "addr", "add", e2eNSIP+"/30", "dev", "eth0")
	for _, a := range []string{e2ePubA, e2ePubB, e2eMetadata, e2ePrivate, resolver} {
		in("ip", "addr", "add", a+"/32", "dev", "eth0")
	}
	in("ip", "link", "set", "eth0", "up")
	in("ip", "route", "add", "default", "via", e2eHostIP)
	for _, dst := range []string{e2ePubA, e2ePubB, e2eMetadata, e2ePrivate, resolver} {
		sh(t, "ip", "route", "add", dst+"/32", "via", e2eNSIP, "table", e2eTable)
	}
	sh(t, "ip", "route", "add", "unreachable", "default", "table", e2eTable) // nothing else leaves
	sh(t, "ip", "rule", "add", "from", egressCIDR, "to", egressCIDR, "lookup", "main", "priority", fmt.Sprint(mustAtoi(e2eTable)-1))
	sh(t, "ip", "rule", "add", "from", egressCIDR, "lookup", e2eTable, "priority", e2eTable)

	var ln net.Listener
	var pc net.PacketConn
	var err, uerr error
	inNetns(t, e2eNS, func() {
		ln, err = net.Listen("tcp4", "0.0.0.0:0")
		pc, uerr = net.ListenPacket("udp4", resolver+":53")
	})
	if err != nil || uerr != nil {
		t.Fatalf("upstream servers: %v %v", err, uerr)
	}
	t.Cleanup(func() { ln.Close(); pc.Close() })
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host, _, _ := net.SplitHostPort(r.Context().Value(http.LocalAddrContextKey).(net.Addr).String())
		fmt.Fprintf(w, "upstream %s\n", host)
	})}
	go srv.Serve(ln)
	go serveDNS(pc, map[string]string{e2eName + ".": e2ePubA}) // egressproxy_test.go
	_, port, _ = net.SplitHostPort(ln.Addr().String())
	return port
}

func mustAtoi(s string) int {
	var n int
	fmt.Sscan(s, &n)
	return n
}

// startEgressDaemon runs a daemon of its own (node id, CIDR and data dir of this test) and
// removes what it leaves.
func startEgressDaemon(t *testing.T) *daemon {
	t.Helper()
	testutil.RequireRoot(t)
	runsc := testutil.Runsc(t)
	dir, err := os.MkdirTemp("/tmp", "net-e2e-")
	if err != nil {
		t.Fatal(err)
	}
	// Its own node id and CIDR: the upstream's policy routing matches that CIDR.
	d, err := newDaemonOpts(runsc, daemonOpts{NodeID: egressNodeID, CIDR: egressCIDR, DataDir: filepath.Join(dir, "data")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		d.stop()
		quiet("umount", filepath.Join(d.dataDir, "runsc", "null-netns"))
		quiet("nft", "delete", "table", "inet", "ember_"+d.nodeID)
		os.RemoveAll(dir)
	})
	if err := d.start(); err != nil {
		t.Fatalf("starting ember: %v\n%s", err, d.logs())
	}
	return d
}

func TestEgressFromSandboxes(t *testing.T) {
	d := startEgressDaemon(t)
	resolver := sandboxResolver(t)
	port := makeE2EUpstream(t, resolver)
	url := func(host string) string { return "http://" + net.JoinHostPort(host, port) + "/" }
	// curl prints the upstream's answer, or FAIL when it cannot connect.
	curl := func(t *testing.T, s sbx, host string) string {
		t.Helper()
		r := d.run(t, s, "curl -sS -m 3 "+url(host)+" || echo FAIL")
		return strings.TrimSpace(r.stdout)
	}
	reach := func(t *testing.T, s sbx, host string, want bool) {
		t.Helper()
		out := curl(t, s, host)
		if got := strings.HasPrefix(out, "upstream "); got != want {
			t.Errorf("curl %s from %s: %q, want reachable = %v", host, s.SandboxID, out, want)
		}
	}
	alwaysDenied := func(t *testing.T, s sbx) {
		t.Helper()
		for _, h := range []string{e2eMetadata, e2ePrivate, resolver} {
			reach(t, s, h, false)
		}
	}

	t.Run("default: internet and DNS", func(t *testing.T) {
		s := d.create(t, nil)
		reach(t, s, e2ePubA, true)
		reach(t, s, e2ePubB, true)
		if out := curl(t, s, e2eName); out != "upstream "+e2ePubA {
			t.Errorf("curl %s (DNS through %s): %q", e2eName, resolver, out)
		}
		alwaysDenied(t, s)
	})
	t.Run("allowInternetAccess false", func(t *testing.T) {
		s := d.create(t, map[string]any{"allow_internet_access": false})
		reach(t, s, e2ePubA, false)
		if out := curl(t, s, e2eName); !strings.Contains(out, "FAIL") {
			t.Errorf("DNS works with internet off: %q", out)
		}
	})
	t.Run("internet off, allowOut", func(t *testing.T) {
		s := d.create(t, map[string]any{"allow_internet_access": false, "network": map[string]any{"allowOut": []string{e2ePubB}}})
		reach(t, s, e2ePubA, false)
		reach(t, s, e2ePubB, true)
	})
	t.Run("allowOut everything still denies the always-denied", func(t *testing.T) {
		s := d.create(t, map[string]any{"network": map[string]any{"allowOut": []string{"0.0.0.0/0", "169.254.0.0/16", "10.0.0.0/8"}}})
		reach(t, s, e2ePubA, true)
		alwaysDenied(t, s)
	})
	t.Run("denyOut, updateNetwork, pause and resume keep the rules", func(t *testing.T) {
		s := d.create(t, map[string]any{"network": map[string]any{"denyOut": []string{e2ePubA}}})
		reach(t, s, e2ePubA, false)
		reach(t, s, e2ePubB, true)
		if code := d.api(t, "PUT", "/sandboxes/"+s.SandboxID+"/network", map[string]any{"denyOut": []string{"0.0.0.0/0"}, "allowOut": []string{e2ePubA}}, nil); code != 204 {
			t.Fatalf("updateNetwork: %d", code)
		}
		reach(t, s, e2ePubA, true)
		reach(t, s, e2ePubB, false)
		if code := d.api(t, "POST", "/sandboxes/"+s.SandboxID+"/pause", map[string]any{}, nil); code != 204 {
			t.Fatalf("pause: %d", code)
		}
		if code := d.api(t, "PUT", "/sandboxes/"+s.SandboxID+"/network", map[string]any{}, nil); code != 409 {
			t.Errorf("updateNetwork of a paused sandbox: %d, want 409", code)
		}
		var resumed sbx
		if code := d.api(t, "POST", "/v2/sandboxes/"+s.SandboxID+"/connect", map[string]any{"timeout": 120}, &resumed); code != 201 {
			t.Fatalf("connect: %d\n%s", code, d.logs())
		}
		reach(t, s, e2ePubA, true)
		reach(t, s, e2ePubB, false)
		if code := d.api(t, "PUT", "/sandboxes/"+s.SandboxID+"/network", map[string]any{}, nil); code != 204 {
			t.Fatalf("updateNetwork (clear): %d", code)
		}
		reach(t, s, e2ePubB, true)
	})
	t.Run("fork children and a restarted daemon keep the rules", func(t *testing.T) {
		s := d.create(t, map[string]any{"network": map[string]any{"denyOut": []string{e2ePubA}}})
		var forks []struct {
			Sandbox *sbx `json:"sandbox"`
		}
		if code := d.api(t, "POST", "/sandboxes/"+s.SandboxID+"/fork", map[string]any{"count": 1}, &forks); code != 201 || len(forks) != 1 || forks[0].Sandbox == nil {
			t.Fatalf("fork: %d %+v\n%s", code, forks, d.logs())
		}
		child := *forks[0].Sandbox
		t.Cleanup(func() { d.api(t, "DELETE", "/sandboxes/"+child.SandboxID, nil, nil) })
		reach(t, child, e2ePubA, false)
		reach(t, child, e2ePubB, true)
		d.crash()
		if err := d.start(); err != nil {
			t.Fatalf("restart: %v\n%s", err, d.logs())
		}
		reach(t, s, e2ePubA, false)
		reach(t, s, e2ePubB, true)
		reach(t, child, e2ePubA, false)
	})
	t.Run("bad rules are 400", func(t *testing.T) {
		for _, body := range []map[string]any{
			{"templateID": "base", "network": map[string]any{"denyOut": []string{"example.com"}}},
			{"templateID": "base", "network": map[string]any{"allowOut": []string{"example.com"}}},
		} {
			if code := d.api(t, "POST", "/v2/sandboxes", body, nil); code != 400 {
				t.Errorf("create %v: %d, want 400", body, code)
			}
		}
		if code := d.api(t, "PUT", "/sandboxes/nosuch/network", map[string]any{}, nil); code != 404 {
			t.Errorf("updateNetwork of an unknown sandbox: %d, want 404", code)
		}
	})
	t.Run("traffic access token on guest ports", func(t *testing.T) {
		var s struct {
			sbx
			TrafficAccessToken *string `json:"trafficAccessToken"`
		}
		if code := d.api(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "base", "network": map[string]any{"allowPublicTraffic": false}}, &s); code != 201 {
			t.Fatalf("create: %d", code)
		}
		t.Cleanup(func() { d.api(t, "DELETE", "/sandboxes/"+s.SandboxID, nil, nil) })
		if s.TrafficAccessToken == nil || *s.TrafficAccessToken == "" {
			t.Fatal("no trafficAccessToken")
		}
		d.background(t, s.sbx, "exec python3 -m http.server 8080 --bind 0.0.0.0")
		get := func(token string) int {
			req, _ := http.NewRequest("GET", "http://"+d.addr+"/", nil)
			req.Header.Set("E2b-Sandbox-Id", s.SandboxID)
			req.Header.Set("E2b-Sandbox-Port", "8080")
			if token != "" {
				req.Header.Set("e2b-traffic-access-token", token)
			}
			resp, err := httpClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			return resp.StatusCode
		}
		testutil.Eventually(t, 10*time.Second, "guest http server reachable with the token", func() bool {
			return get(*s.TrafficAccessToken) == 200
		})
		if code := get(""); code != 403 {
			t.Errorf("without token: %d, want 403", code)
		}
		if code := get("wrong"); code != 403 {
			t.Errorf("wrong token: %d, want 403", code)
		}
	})

	// network.httpsPorts: the sandbox plane speaks TLS to a guest port that serves it itself
	// (a self-signed certificate: not verified, as in E2B). It was refused with 400 before.
	t.Run("httpsPorts", func(t *testing.T) {
		var s sbx
		if code := d.api(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "base", "network": map[string]any{"httpsPorts": []int{8443}}}, &s); code != 201 {
			t.Fatalf("create: %d", code)
		}
		t.Cleanup(func() { d.api(t, "DELETE", "/sandboxes/"+s.SandboxID, nil, nil) })
		d.background(t, s, `cd /tmp && openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout k.pem -out c.pem -days 1 -subj /CN=sandbox 2>/dev/null && `+
			`exec python3 -c 'import http.server, ssl; s = http.server.HTTPServer(("0.0.0.0", 8443), http.server.SimpleHTTPRequestHandler); c = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); c.load_cert_chain("c.pem", "k.pem"); s.socket = c.wrap_socket(s.socket, server_side=True); s.serve_forever()'`)
		code, body := 0, ""
		testutil.EventuallyOr(t, 20*time.Second, func() bool {
			req, _ := http.NewRequest("GET", "http://"+d.addr+"/c.pem", nil)
			req.Header.Set("E2b-Sandbox-Id", s.SandboxID)
			req.Header.Set("E2b-Sandbox-Port", "8443")
			resp, err := httpClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			code, body = resp.StatusCode, string(b)
			return code == 200
		}, func() string { return fmt.Sprintf("GET through the plane to the HTTPS port: %d %q", code, body) })
		if !strings.Contains(body, "BEGIN CERTIFICATE") {
			t.Fatalf("GET through the plane to the HTTPS port: %d %q", code, body)
		}
	})
}
