package e2e

import (
	"bufio"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/dns/dnsmessage"

	"github.com/ember-sandbox/ember/internal/layerfs"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// The egress proxy test runs a daemon of its own (node id "egp", CIDR 10.196.0.0/16, both
// moved by EMBER_E2E_NODE_PREFIX/EMBER_E2E_NET_OFFSET) and plays the internet with a namespace
// of its own: packets from that CIDR (the slots', and the node's egress proxy's, which dials
// from the slot's host-side address) are routed there by policy routing, never off the
// machine. Inside: an HTTPS server for api.egress.test and other.egress.test (certificate of a
// CA the test makes and hands the daemon through EMBER_EGRESS_ROOT_CAS), a plain HTTP server,
// a SOCKS5 server, and a DNS server the daemon's egress proxy resolves names with
// (EMBER_EGRESS_DNS): api/other.egress.test are the HTTPS server's address, plain.egress.test
// the plain one's. Names reach the servers by curl --resolve (SNI and Host as a resolver would
// give them), so a sandbox can also send a name to an address the name does not have.
const (
	epNode  = "egp"
	epCIDR  = "10.196.0.0/16"
	epAPI   = "198.51.100.10" // HTTPS :443, api.egress.test and other.egress.test
	epPlain = "198.51.100.11" // HTTP :80
	epSOCKS = "198.51.100.12" // SOCKS5 :1080
	epHost  = "198.51.100.249"
	epNSIP  = "198.51.100.250" // also the DNS server's, :53
)

// epZone is the test's DNS zone.
var epZone = map[string]string{"api.egress.test.": epAPI, "other.egress.test.": epAPI, "plain.egress.test.": epPlain}

type epUpstream struct {
	mu       sync.Mutex
	apiKeys  []string // the X-Api-Key headers the HTTPS server saw
	socksUse atomic.Int32
	socksLn  net.Listener
	caFile   string
}

func (u *epUpstream) seen() []string {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]string(nil), u.apiKeys...)
}

// epCA makes a CA and a server certificate for names, signed by it.
func epCA(t *testing.T, names ...string) (caPEM []byte, leaf tls.Certificate) {
	t.Helper()
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	caT := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "egress e2e CA"}, IsCA: true,
		BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	caDER, err := x509.CreateCertificate(rand.Reader, caT, caT, caKey.Public(), caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, _ := x509.ParseCertificate(caDER)
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	lt := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: names[0]}, DNSNames: names,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, KeyUsage: x509.KeyUsageDigitalSignature,
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, lt, ca, key.Public(), caKey)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}), tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

func makeEgressProxyUpstream(t *testing.T, cidr string) *epUpstream {
	t.Helper()
	ns, veth, table := "xeg-"+epNode, "xeg"+epNode+"0", "21696"
	if p := os.Getenv("EMBER_E2E_NODE_PREFIX"); p != "" {
		ns, veth = ns+p, "xeg"+p+"0"
	}
	if off := os.Getenv("EMBER_E2E_NET_OFFSET"); off != "" {
		table = fmt.Sprint(21696 + mustAtoi(off))
	}
	cleanup := func() {
		quiet("ip", "rule", "del", "priority", table)
		quiet("ip", "rule", "del", "priority", fmt.Sprint(mustAtoi(table)-1))
		quiet("ip", "route", "flush", "table", table)
		quiet("ip", "link", "del", veth)
		quiet("ip", "netns", "del", ns)
	}
	cleanup()
	t.Cleanup(cleanup)
	sh(t, "ip", "netns", "add", ns)
	sh(t, "ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
	sh(t, "ip", "addr", "add", epHost+"/30", "dev", veth)
	sh(t, "ip", "link", "set", veth, "up")
	in := func(args ...string) { sh(t, append([]string{"ip", "netns", "exec", ns}, args...)...) }
	in("ip", "link", "set", "lo", "up")
	in("ip", "addr", "add", epNSIP+"/30", "dev", "eth0")
	for _, a := range []string{epAPI, epPlain, epSOCKS} {
		in("ip", "addr", "add", a+"/32", "dev", "eth0")
	}
	in("ip", "link", "set", "eth0", "up")
	in("ip", "route", "add", "default", "via", epHost)
	for _, dst := range []string{epAPI, epPlain, epSOCKS} {
		sh(t, "ip", "route", "add", dst+"/32", "via", epNSIP, "table", table)
	}
	sh(t, "ip", "route", "add", "unreachable", "default", "table", table)
	sh(t, "ip", "rule", "add", "from", cidr, "to", cidr, "lookup", "main", "priority", fmt.Sprint(mustAtoi(table)-1))
	sh(t, "ip", "rule", "add", "from", cidr, "lookup", table, "priority", table)

	u := &epUpstream{}
	caPEM, leaf := epCA(t, "api.egress.test", "other.egress.test")
	u.caFile = filepath.Join(t.TempDir(), "upstream-ca.pem")
	if err := os.WriteFile(u.caFile, caPEM, 0o644); err != nil {
		t.Fatal(err)
	}
	var tlsLn, plainLn net.Listener
	var dnsPC net.PacketConn
	var err1, err2, err3, err4 error
	inNetns(t, ns, func() {
		tlsLn, err1 = net.Listen("tcp4", epAPI+":443")
		plainLn, err2 = net.Listen("tcp4", epPlain+":80")
		u.socksLn, err3 = net.Listen("tcp4", epSOCKS+":1080")
		dnsPC, err4 = net.ListenPacket("udp4", epNSIP+":53")
	})
	if err1 != nil || err2 != nil || err3 != nil || err4 != nil {
		t.Fatalf("upstream servers: %v %v %v %v", err1, err2, err3, err4)
	}
	t.Cleanup(func() { tlsLn.Close(); plainLn.Close(); u.socksLn.Close(); dnsPC.Close() })
	go serveDNS(dnsPC, epZone)
	api := &http.Server{TLSConfig: &tls.Config{Certificates: []tls.Certificate{leaf}}, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u.mu.Lock()
		u.apiKeys = append(u.apiKeys, r.Header.Get("X-Api-Key"))
		u.mu.Unlock()
		fmt.Fprintf(w, "hello from %s\n", r.Host) // never the header: the sandbox must not learn it
	})}
	go api.ServeTLS(tlsLn, "", "")
	go (&http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, "plain upstream")
	})}).Serve(plainLn)
	// The SOCKS5 server's own connections are made inside the namespace: never off the machine.
	go serveSOCKS5(u.socksLn, &u.socksUse, func(addr string) (c net.Conn, err error) {
		inNetns(t, ns, func() { c, err = net.Dial("tcp4", addr) })
		return c, err
	})
	return u
}

// serveDNS answers A queries for the names of zone (golang.org/x/net/dns/dnsmessage); any
// other query gets an empty answer, an unknown name NXDOMAIN.
func serveDNS(pc net.PacketConn, zone map[string]string) {
	buf := make([]byte, 1500)
	for {
		n, from, err := pc.ReadFrom(buf)
		if err != nil {
			return
		}
		var p dnsmessage.Parser
		h, err := p.Start(buf[:n])
		if err != nil {
			continue
		}
		q, err := p.Question()
		if err != nil {
			continue
		}
		addr, known := zone[strings.ToLower(q.Name.String())]
		rh := dnsmessage.Header{ID: h.ID, Response: true, Authoritative: true, RecursionDesired: h.RecursionDesired}
		if !known {
			rh.RCode = dnsmessage.RCodeNameError
		}
		b := dnsmessage.NewBuilder(nil, rh)
		b.EnableCompression()
		_ = b.StartQuestions()
		_ = b.Question(q)
		_ = b.StartAnswers()
		if known && q.Type == dnsmessage.TypeA {
			_ = b.AResource(dnsmessage.ResourceHeader{Name: q.Name, Class: dnsmessage.ClassINET, TTL: 60},
				dnsmessage.AResource{A: [4]byte(net.ParseIP(addr).To4())})
		}
		if out, err := b.Finish(); err == nil {
			_, _ = pc.WriteTo(out, from)
		}
	}
}

// serveSOCKS5 is a minimal SOCKS5 server (no auth, CONNECT to IPv4 only): the test's upstream.
func serveSOCKS5(ln net.Listener, used *atomic.Int32, dial func(string) (net.Conn, error)) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			br := bufio.NewReader(c)
			hdr := make([]byte, 2)
			if _, err := io.ReadFull(br, hdr); err != nil || hdr[0] != 5 {
				return
			}
			io.ReadFull(br, make([]byte, hdr[1]))
			c.Write([]byte{5, 0})
			req := make([]byte, 10)
			if _, err := io.ReadFull(br, req); err != nil || req[1] != 1 || req[3] != 1 {
				return
			}
			up, err := dial(net.JoinHostPort(net.IP(req[4:8]).String(), fmt.Sprint(int(req[8])<<8|int(req[9]))))
			if err != nil {
				c.Write([]byte{5, 5, 0, 1, 0, 0, 0, 0, 0, 0})
				return
			}
			defer up.Close()
			used.Add(1)
			c.Write([]byte{5, 0, 0, 1, 0, 0, 0, 0, 0, 0})
			go io.Copy(up, br)
			io.Copy(c, up)
		}()
	}
}

// TestEgressProxy: names allowed and denied by SNI/Host, a rule adding a secret's value to an
// HTTPS request (TLS terminated with the node's CA, which the sandbox trusts), the value
// nowhere in the sandbox, its checkpoint, the data dir or the logs, updateNetwork live, and a
// SOCKS5 upstream that carries the traffic and whose absence fails closed.
func TestEgressProxy(t *testing.T) {
	testutil.SkipShort(t, "a daemon of its own with runsc")
	testutil.RequireRoot(t)
	runsc := testutil.Runsc(t)
	node, cidr := isolate(epNode, epCIDR)
	up := makeEgressProxyUpstream(t, cidr)
	t.Setenv("EMBER_EGRESS_ROOT_CAS", up.caFile)
	t.Setenv("EMBER_EGRESS_DNS", epNSIP+":53")
	dir, err := os.MkdirTemp("/tmp", "egress-e2e-")
	if err != nil {
		t.Fatal(err)
	}
	d, err := newDaemonOpts(runsc, daemonOpts{NodeID: epNode, CIDR: epCIDR, DataDir: filepath.Join(dir, "data"),
		Flags: []string{"--pause-mode", "checkpoint", "--pool-size", "0"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		d.stop()
		quiet("umount", filepath.Join(d.dataDir, "runsc", "null-netns"))
		quiet("nft", "delete", "table", "inet", "ember_"+node)
		_ = layerfs.Unmount(d.dataDir, 10*time.Second) // the btrfs image over the data dir, if any
		os.RemoveAll(dir)
	})
	if err := d.start(); err != nil {
		t.Fatalf("starting ember: %v\n%s", err, d.logs())
	}

	b := make([]byte, 12)
	rand.Read(b)
	value := "sk-e2e-" + hex.EncodeToString(b)
	if code, body := d.apiBody(t, "POST", "/secrets", map[string]any{"name": "api-key", "value": value}, nil); code != 201 {
		t.Fatalf("create secret: %d %s", code, body)
	}
	rules := map[string]any{"api.egress.test": []any{map[string]any{"transform": map[string]any{"headers": map[string]string{"X-Api-Key": "${e2b.secrets.api-key}"}}}}}
	s := d.create(t, map[string]any{"network": map[string]any{"allowOut": []string{"api.egress.test", "plain.egress.test"}, "denyOut": []string{"0.0.0.0/0"}, "rules": rules}})

	https := func(name string, insecure bool) string {
		k := ""
		if insecure {
			k = "-k "
		}
		r := d.run(t, s, fmt.Sprintf("curl -sS %s-m 10 --resolve %s:443:%s https://%s/ 2>&1 || echo FAIL", k, name, epAPI, name))
		return strings.TrimSpace(r.stdout)
	}
	plain := func() string {
		return strings.TrimSpace(d.run(t, s, "curl -sS -m 10 http://"+epPlain+"/ 2>&1 || echo FAIL").stdout)
	}
	// curlAt sends url's name (SNI or Host) to addr, whether or not the name has that address.
	curlAt := func(url, name, port, addr string) string {
		return strings.TrimSpace(d.run(t, s, fmt.Sprintf("curl -sS -k -m 10 --resolve %s:%s:%s %s 2>&1 || echo FAIL", name, port, addr, url)).stdout)
	}

	// The rule's header, with the secret's value, reaches the upstream over verified TLS.
	if out := https("api.egress.test", false); out != "hello from api.egress.test" {
		t.Fatalf("curl https://api.egress.test: %q\n%s", out, d.logs())
	}
	if seen := up.seen(); len(seen) != 1 || seen[0] != value {
		t.Fatalf("upstream saw X-Api-Key %q, want the secret's value", seen)
	}
	// Python's TLS, pointed at the bundle with the node's CA by the sandbox's env
	// (SSL_CERT_FILE, REQUESTS_CA_BUNDLE, NODE_EXTRA_CA_CERTS), verifies the intercepted name.
	if r, err := d.runCtx(t.Context(), s, "grep -q api.egress.test /etc/hosts || echo '"+epAPI+" api.egress.test' >> /etc/hosts", "root"); err != nil || r.exitCode != 0 {
		t.Fatalf("/etc/hosts: %v %+v", err, r)
	}
	py := `import os, urllib.request; print(*[os.environ.get(k) for k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS")]); print(urllib.request.urlopen("https://api.egress.test/", timeout=10).read().decode().strip())`
	const bundle = "/etc/ssl/certs/ca-certificates.crt"
	if out := strings.TrimSpace(d.run(t, s, "python3 -c '"+py+"' 2>&1").stdout); out != bundle+" "+bundle+" "+bundle+"\nhello from api.egress.test" {
		t.Errorf("python3 urllib over the egress CA: %q", out)
	}
	// A name opens only its own addresses: plain.egress.test reaches its server; the names
	// sent (Host, SNI) to an address they do not resolve to are refused.
	if out := curlAt("http://plain.egress.test/", "plain.egress.test", "80", epPlain); out != "plain upstream" {
		t.Errorf("plain.egress.test at its address: %q", out)
	}
	if out := curlAt("http://api.egress.test/", "api.egress.test", "80", epPlain); !strings.Contains(out, "FAIL") {
		t.Errorf("Host api.egress.test reached %s, which the name does not resolve to: %q", epPlain, out)
	}
	if out := curlAt("https://plain.egress.test/", "plain.egress.test", "443", epAPI); !strings.Contains(out, "FAIL") {
		t.Errorf("SNI plain.egress.test reached %s, which the name does not resolve to: %q", epAPI, out)
	}
	// Another name, and addresses, are denied (denyOut 0.0.0.0/0).
	if out := https("other.egress.test", true); !strings.Contains(out, "FAIL") {
		t.Errorf("other.egress.test reached: %q", out)
	}
	if out := plain(); !strings.Contains(out, "FAIL") {
		t.Errorf("%s reached: %q", epPlain, out)
	}
	// The value is not in the sandbox's environment nor its processes' (the command does not
	// carry the value: the sandbox must never see it, not even from this test; its files and
	// memory are searched from the host below, in the pause's checkpoint and the data dir).
	r, err := d.runCtx(t.Context(), s, "env; cat /proc/*/environ; echo done", "root")
	if err != nil || !strings.Contains(r.stdout, "done") {
		t.Fatalf("leak check: %v %q", err, r.stderr)
	}
	if strings.Contains(r.stdout, value) {
		t.Fatalf("the sandbox sees the secret's value:\n%s", r.stdout)
	}

	// updateNetwork: the other name now, the first one no longer.
	if code, body := d.apiBody(t, "PUT", "/sandboxes/"+s.SandboxID+"/network", map[string]any{"allowOut": []string{"other.egress.test"}, "denyOut": []string{"0.0.0.0/0"}}, nil); code != 204 {
		t.Fatalf("updateNetwork: %d %s", code, body)
	}
	if out := https("other.egress.test", true); out != "hello from other.egress.test" {
		t.Errorf("after the update, other.egress.test: %q", out)
	}
	if out := https("api.egress.test", true); !strings.Contains(out, "FAIL") {
		t.Errorf("after the update, api.egress.test reached: %q", out)
	}

	// A SOCKS5 upstream carries the traffic; without it nothing leaves.
	if code, body := d.apiBody(t, "PUT", "/sandboxes/"+s.SandboxID+"/network", map[string]any{"egressProxy": map[string]any{"address": epSOCKS + ":1080"}}, nil); code != 204 {
		t.Fatalf("updateNetwork egressProxy: %d %s", code, body)
	}
	if out := plain(); out != "plain upstream" || up.socksUse.Load() == 0 {
		t.Fatalf("through the SOCKS5 upstream: %q (upstream used %d times)", out, up.socksUse.Load())
	}
	up.socksLn.Close()
	if out := plain(); !strings.Contains(out, "FAIL") {
		t.Errorf("SOCKS5 upstream gone, yet %s reached: %q", epPlain, out)
	}
	var info map[string]any
	d.api(t, "GET", "/sandboxes/"+s.SandboxID, nil, &info)
	if px, _ := info["network"].(map[string]any)["egressProxy"].(map[string]any); px["address"] != epSOCKS+":1080" {
		t.Errorf("getInfo network: %v", info["network"])
	}

	// A memory dump: the pause's checkpoint, with the store, the layers and the logs, holds no
	// copy of the value.
	if code := d.api(t, "POST", "/sandboxes/"+s.SandboxID+"/pause", map[string]any{}, nil); code != 204 {
		t.Fatalf("pause: %d", code)
	}
	out, _ := exec.Command("grep", "-rlsF", "--exclude-dir=cache", "--exclude=null-netns", value, d.dataDir).Output()
	if strings.TrimSpace(string(out)) != "" {
		t.Errorf("the value is in clear under the data dir: %s", out)
	}
	if strings.Contains(d.logs(), value) {
		t.Error("the value is in the daemon's log")
	}
}
