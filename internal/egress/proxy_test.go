package egress

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// The proxy is tested in-process: a test "redirects" by dialling the proxy and telling it the
// original destination (OriginalDst); the upstreams are httptest servers on loopback, which
// the test's AlwaysDenied lets through. The real redirect (nftables, runsc) is test/e2e's.

type fakeSecrets map[string]string

func (f fakeSecrets) Expand(_ context.Context, owner, s string) (string, error) {
	for k, v := range f {
		s = strings.ReplaceAll(s, "${e2b.secrets."+k+"}", v)
	}
	if strings.Contains(s, "${e2b.secrets.") {
		return "", io.ErrUnexpectedEOF
	}
	return s, nil
}

// fakeResolver answers names from a map (a name it lacks does not exist).
type fakeResolver map[string][]netip.Addr

func (f fakeResolver) LookupNetIP(_ context.Context, _, host string) ([]netip.Addr, error) {
	if a, ok := f[host]; ok {
		return a, nil
	}
	return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
}

// testNames is the test resolver's view: the names the tests allow resolve to the upstreams'
// loopback address, elsewhere.test to another one.
var testNames = fakeResolver{
	"allowed.test":   {netip.MustParseAddr("127.0.0.1")},
	"a.wild.test":    {netip.MustParseAddr("::1"), netip.MustParseAddr("127.0.0.1")},
	"elsewhere.test": {netip.MustParseAddr("127.0.0.2")},
}

type testProxy struct {
	p    *Proxy
	addr string
	ca   *x509.CertPool
	mu   sync.Mutex
	dst  map[string]netip.AddrPort // client local addr -> original dst
}

func newTestProxy(t *testing.T, upstreamRoots ...*x509.Certificate) *testProxy {
	t.Helper()
	ca, _, _, err := LoadOrCreateCA(t.TempDir(), "test")
	if err != nil {
		t.Fatal(err)
	}
	tp := &testProxy{dst: map[string]netip.AddrPort{}, ca: x509.NewCertPool()}
	tp.ca.AddCert(ca.Leaf)
	tp.p, err = New(Config{CA: ca, ExtraRoots: upstreamRoots, Secrets: fakeSecrets{"api-key": "s3cr3t-value"},
		SniffTimeout: 300 * time.Millisecond, Resolver: testNames,
		OriginalDst: func(c net.Conn) (netip.AddrPort, error) {
			for range 200 { // the test records the destination once its dial returned
				tp.mu.Lock()
				d, ok := tp.dst[c.RemoteAddr().String()]
				tp.mu.Unlock()
				if ok {
					return d, nil
				}
				time.Sleep(5 * time.Millisecond)
			}
			return netip.AddrPort{}, io.ErrUnexpectedEOF
		}})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = tp.p.Serve(ln) }()
	t.Cleanup(func() { tp.p.Close() })
	tp.addr = ln.Addr().String()
	return tp
}

// dial connects to the proxy as if the client had dialled dst.
func (tp *testProxy) dial(dst string) (net.Conn, error) {
	var d net.Dialer
	c, err := d.Dial("tcp", tp.addr)
	if err != nil {
		return nil, err
	}
	tp.mu.Lock()
	tp.dst[c.LocalAddr().String()] = netip.MustParseAddrPort(dst)
	tp.mu.Unlock()
	return c, nil
}

// get makes one request for url (its host is the name the client gives) to dst.
func (tp *testProxy) get(dst, rawURL string) (*http.Response, string, error) {
	tr := &http.Transport{
		DialContext:     func(context.Context, string, string) (net.Conn, error) { return tp.dial(dst) },
		TLSClientConfig: &tls.Config{RootCAs: tp.ca},
	}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr, Timeout: 5 * time.Second}
	resp, err := c.Get(rawURL)
	if err != nil {
		return nil, "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b), nil
}

// upstream is an HTTP or HTTPS server answering with the Authorization header it saw.
func upstream(t *testing.T, tlsOn bool) (*httptest.Server, string) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "auth="+r.Header.Get("Authorization")+" host="+r.Host)
	})
	var s *httptest.Server
	if tlsOn {
		s = httptest.NewUnstartedServer(h)
		s.StartTLS()
	} else {
		s = httptest.NewServer(h)
	}
	t.Cleanup(s.Close)
	return s, s.Listener.Addr().String()
}

var guest = netip.MustParseAddr("127.0.0.1")

func TestFilterByName(t *testing.T) {
	tp := newTestProxy(t)
	_, dst := upstream(t, false)
	_, tlsDst := upstream(t, true)
	tp.p.Set(guest, &Policy{AllowInternet: false, AllowHosts: []string{"allowed.test", "*.wild.test"}})
	port := netip.MustParseAddrPort(dst).Port()
	for _, c := range []struct {
		url string
		ok  bool
	}{
		{"http://allowed.test:" + itoa(port) + "/", true},
		{"http://a.wild.test:" + itoa(port) + "/", true},
		{"http://wild.test:" + itoa(port) + "/", false},
		{"http://other.test:" + itoa(port) + "/", false},
	} {
		resp, body, err := tp.get(dst, c.url)
		if c.ok != (err == nil) {
			t.Fatalf("%s: %v %v", c.url, resp, err)
		}
		if c.ok && !strings.Contains(body, "auth= ") {
			t.Fatalf("%s: %q", c.url, body)
		}
	}
	// TLS passes through untouched (the client sees the upstream's own certificate), by SNI.
	c, err := tp.dial(tlsDst)
	if err != nil {
		t.Fatal(err)
	}
	tc := tls.Client(c, &tls.Config{ServerName: "allowed.test", InsecureSkipVerify: true})
	if err := tc.Handshake(); err != nil {
		t.Fatalf("allowed SNI: %v", err)
	}
	if got := tc.ConnectionState().PeerCertificates[0].Subject.Organization; len(got) == 0 || got[0] != "Acme Co" {
		t.Fatalf("not the upstream's certificate: %v", got)
	}
	tc.Close()
	c, _ = tp.dial(tlsDst)
	tc = tls.Client(c, &tls.Config{ServerName: "other.test", InsecureSkipVerify: true})
	if err := tc.Handshake(); err == nil {
		t.Fatal("denied SNI: handshake succeeded")
	}
	// Rules change live: the next connection follows them, an open one they deny is closed.
	keep, _ := tp.dial(dst)
	tp.p.Set(guest, &Policy{AllowInternet: true})
	if _, _, err := tp.get(dst, "http://other.test:"+itoa(port)+"/"); err != nil {
		t.Fatalf("after the update: %v", err)
	}
	tp.p.Set(guest, &Policy{AllowInternet: true, DenyHosts: []string{"other.test"}})
	if _, _, err := tp.get(dst, "http://other.test:"+itoa(port)+"/"); err == nil {
		t.Fatal("denied host reached")
	}
	_ = keep
}

// TestNameBoundToDNSAnswers: an allowed name opens only the addresses it resolves to. Sending
// SNI or Host of an allowed name to another address is refused (it used to pass: a sandbox
// allowed one name could reach any address).
func TestNameBoundToDNSAnswers(t *testing.T) {
	tp := newTestProxy(t)
	_, dst := upstream(t, false)
	_, tlsDst := upstream(t, true)
	tp.p.Set(guest, &Policy{AllowHosts: []string{"allowed.test", "elsewhere.test", "nowhere.test"}})
	port := itoa(netip.MustParseAddrPort(dst).Port())
	if _, body, err := tp.get(dst, "http://allowed.test:"+port+"/"); err != nil || !strings.HasPrefix(body, "auth=") {
		t.Fatalf("a name to its own address: %q %v", body, err)
	}
	for _, name := range []string{"elsewhere.test", "nowhere.test"} { // another address; no address
		if resp, _, err := tp.get(dst, "http://"+name+":"+port+"/"); err == nil {
			t.Fatalf("Host %s reached an address it does not resolve to: %d", name, resp.StatusCode)
		}
		c, err := tp.dial(tlsDst)
		if err != nil {
			t.Fatal(err)
		}
		tc := tls.Client(c, &tls.Config{ServerName: name, InsecureSkipVerify: true})
		if err := tc.Handshake(); err == nil {
			t.Fatalf("SNI %s reached an address it does not resolve to", name)
		}
		tc.Close()
	}
	// The address rules still decide alone: with the internet allowed, the name is not needed.
	tp.p.Set(guest, &Policy{AllowInternet: true, AllowHosts: []string{"elsewhere.test"}})
	if _, _, err := tp.get(dst, "http://elsewhere.test:"+port+"/"); err != nil {
		t.Fatalf("internet allowed: %v", err)
	}
}

func TestTransformHTTPS(t *testing.T) {
	up, dst := upstream(t, true)
	tp := newTestProxy(t, up.Certificate())
	tp.p.Set(guest, &Policy{AllowInternet: true, Rules: map[string]http.Header{
		"example.com":   {"Authorization": {"Bearer ${e2b.secrets.api-key}"}},
		"*.com":         {"Authorization": {"wrong: a wildcard"}},
		"*.example.com": {"Authorization": {"wrong: not the apex"}}}})
	// httptest's certificate names example.com: the upstream is verified for the name.
	u := "https://example.com:" + itoa(netip.MustParseAddrPort(dst).Port()) + "/"
	resp, body, err := tp.get(dst, u)
	if err != nil {
		t.Fatal(err)
	}
	if body != "auth=Bearer s3cr3t-value host=example.com:"+itoa(netip.MustParseAddrPort(dst).Port()) {
		t.Fatalf("upstream saw %q (%d)", body, resp.StatusCode)
	}
	// Plain HTTP to a host with rules passes untouched: a secret never crosses in clear.
	_, hdst := upstream(t, false)
	tp.p.Set(guest, &Policy{AllowInternet: true, Rules: map[string]http.Header{"example.com": {"Authorization": {"k ${e2b.secrets.api-key}"}}}})
	if _, body, err := tp.get(hdst, "http://example.com:"+itoa(netip.MustParseAddrPort(hdst).Port())+"/"); err != nil || !strings.HasPrefix(body, "auth= ") {
		t.Fatalf("http: %q %v", body, err)
	}
	// An unknown secret: the request is not sent.
	tp.p.Set(guest, &Policy{AllowInternet: true, Rules: map[string]http.Header{"example.com": {"Authorization": {"${e2b.secrets.nope}"}}}})
	if resp, body, err := tp.get(dst, u); err != nil || resp.StatusCode != http.StatusBadGateway {
		t.Fatalf("unknown secret: %v %q %v", resp, body, err)
	}
}

// TestTransformRefusesUnverifiedUpstream: a server that cannot prove the name never gets the
// secret.
func TestTransformRefusesUnverifiedUpstream(t *testing.T) {
	_, dst := upstream(t, true)
	tp := newTestProxy(t) // the upstream's certificate is not trusted
	tp.p.Set(guest, &Policy{AllowInternet: true, Rules: map[string]http.Header{"example.com": {"Authorization": {"${e2b.secrets.api-key}"}}}})
	resp, body, err := tp.get(dst, "https://example.com:"+itoa(netip.MustParseAddrPort(dst).Port())+"/")
	if err == nil && resp.StatusCode == http.StatusOK {
		t.Fatalf("unverified upstream answered: %q", body)
	}
}

func TestSOCKS5Upstream(t *testing.T) {
	_, dst := upstream(t, false)
	tp := newTestProxy(t)
	// A minimal SOCKS5 server, by x/net's dialer's protocol: no auth, CONNECT.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var used sync.WaitGroup
	used.Add(1)
	var once sync.Once
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				br := bufio.NewReader(c)
				hdr := make([]byte, 2)
				io.ReadFull(br, hdr)
				io.ReadFull(br, make([]byte, hdr[1]))
				c.Write([]byte{5, 0})
				req := make([]byte, 4)
				io.ReadFull(br, req)
				addr := make([]byte, 6)
				io.ReadFull(br, addr)
				target := net.JoinHostPort(net.IP(addr[:4]).String(), itoa(uint16(addr[4])<<8|uint16(addr[5])))
				up, err := net.Dial("tcp", target)
				if err != nil {
					c.Write([]byte{5, 1, 0, 1, 0, 0, 0, 0, 0, 0})
					return
				}
				once.Do(used.Done)
				c.Write([]byte{5, 0, 0, 1, 0, 0, 0, 0, 0, 0})
				go io.Copy(up, br)
				io.Copy(c, up)
			}()
		}
	}()
	tp.p.Set(guest, &Policy{AllowInternet: true, Upstream: &Upstream{Address: ln.Addr().String()}})
	if _, body, err := tp.get(dst, "http://x.test/"); err != nil || !strings.HasPrefix(body, "auth=") {
		t.Fatalf("through socks: %q %v", body, err)
	}
	used.Wait()
	ln.Close()
	if _, _, err := tp.get(dst, "http://x.test/"); err == nil {
		t.Fatal("upstream gone: the request went out anyway")
	}
}

func itoa(p uint16) string { return strconv.Itoa(int(p)) }
