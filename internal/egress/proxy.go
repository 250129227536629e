package egress

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/elazarl/goproxy"
	"golang.org/x/net/proxy"
)

// SecretExpander replaces the `${e2b.secrets.<name>}` of s with the owner's secrets
// (internal/secret's Manager).
type SecretExpander interface {
	Expand(ctx context.Context, owner, s string) (string, error)
}

// Config configures a Proxy.
type Config struct {
	// CA signs the certificates shown to sandboxes for the hosts with rules.
	CA tls.Certificate
	// ExtraRoots are trusted for upstream servers besides the system roots.
	ExtraRoots []*x509.Certificate
	// Secrets resolves placeholders in rule headers (nil: a rule naming a secret fails).
	Secrets SecretExpander
	// AlwaysDenied reports destinations no sandbox may reach whatever its rules.
	AlwaysDenied func(netip.Addr) bool
	// OriginalDst returns where a redirected connection was going (nil: SO_ORIGINAL_DST).
	OriginalDst func(net.Conn) (netip.AddrPort, error)
	// Resolver resolves the names that alone allow a connection (nil: net.DefaultResolver,
	// the node's resolver): the dialled address must be among the answers.
	Resolver Resolver
	// SniffTimeout bounds the wait for a client's first bytes when a name is needed (5 s).
	SniffTimeout time.Duration
	Logger       *slog.Logger
}

// Resolver resolves host names (*net.Resolver is one).
type Resolver interface {
	LookupNetIP(ctx context.Context, network, host string) ([]netip.Addr, error)
}

// Proxy is the node's egress proxy. Policies are keyed by the sandbox's guest address.
type Proxy struct {
	cfg   Config
	log   *slog.Logger
	roots *x509.CertPool
	certs certCache
	names nameCache

	mu       sync.Mutex
	policies map[netip.Addr]*Policy
	conns    map[*tracked]struct{}
	lns      []net.Listener
	closed   bool
	wg       sync.WaitGroup
}

// tracked is one proxied connection, closed when an update denies it.
type tracked struct {
	guest netip.Addr
	dst   netip.AddrPort
	name  string
	// bound: name resolved to dst when the connection was let through.
	bound bool
	c     net.Conn
}

// New returns a proxy; Serve it on a listener.
func New(cfg Config) (*Proxy, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.SniffTimeout <= 0 {
		cfg.SniffTimeout = 5 * time.Second
	}
	if cfg.OriginalDst == nil {
		cfg.OriginalDst = originalDst
	}
	if cfg.Resolver == nil {
		cfg.Resolver = net.DefaultResolver
	}
	if cfg.AlwaysDenied == nil {
		cfg.AlwaysDenied = func(netip.Addr) bool { return false }
	}
	roots, err := x509.SystemCertPool()
	if err != nil {
		roots = x509.NewCertPool()
	}
	for _, c := range cfg.ExtraRoots {
		roots.AddCert(c)
	}
	return &Proxy{cfg: cfg, log: cfg.Logger, roots: roots, policies: map[netip.Addr]*Policy{}, conns: map[*tracked]struct{}{}}, nil
}

// Set installs (or, with nil, removes) the policy of the sandbox at guest. Open connections
// the new policy denies are closed (and those only a name now allows, unless that name was
// found to resolve to their address when they were let through).
func (p *Proxy) Set(guest netip.Addr, pol *Policy) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if pol == nil {
		delete(p.policies, guest)
	} else {
		p.policies[guest] = pol
	}
	for t := range p.conns {
		if t.guest != guest {
			continue
		}
		if pol == nil {
			_ = t.c.Close()
			continue
		}
		if ok, byName := pol.verdict(t.dst.Addr(), t.name); !ok || byName && !t.bound {
			_ = t.c.Close()
		}
	}
}

// Policy returns the policy of the sandbox at guest (nil: none).
func (p *Proxy) Policy(guest netip.Addr) *Policy { return p.policy(guest) }

func (p *Proxy) policy(guest netip.Addr) *Policy {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.policies[guest]
}

// Serve accepts redirected connections on ln until Close.
func (p *Proxy) Serve(ln net.Listener) error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return net.ErrClosed
	}
	p.lns = append(p.lns, ln)
	p.mu.Unlock()
	for {
		c, err := ln.Accept()
		if err != nil {
			p.mu.Lock()
			closed := p.closed
			p.mu.Unlock()
			if closed || errors.Is(err, net.ErrClosed) {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return err
		}
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			p.handle(c)
		}()
	}
}

// Close stops the listeners and closes every proxied connection.
func (p *Proxy) Close() error {
	p.mu.Lock()
	p.closed = true
	for _, ln := range p.lns {
		_ = ln.Close()
	}
	for t := range p.conns {
		_ = t.c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
	return nil
}

func (p *Proxy) track(t *tracked) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	p.conns[t] = struct{}{}
	return true
}

func (p *Proxy) untrack(t *tracked) {
	p.mu.Lock()
	delete(p.conns, t)
	p.mu.Unlock()
}

func addrPortOf(a net.Addr) netip.AddrPort {
	if ta, ok := a.(*net.TCPAddr); ok {
		ap := ta.AddrPort()
		return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
	}
	ap, _ := netip.ParseAddrPort(a.String())
	return ap
}

// handle decides one redirected connection.
func (p *Proxy) handle(c net.Conn) {
	guest := addrPortOf(c.RemoteAddr()).Addr()
	local := addrPortOf(c.LocalAddr()).Addr()
	pol := p.policy(guest)
	dst, err := p.cfg.OriginalDst(c)
	if pol == nil || err != nil {
		if err != nil {
			p.log.Warn("egress proxy: no original destination", "from", guest, "err", err)
		}
		_ = c.Close() // not a sandbox with a policy: fail closed
		return
	}
	log := p.log.With("guest", guest, "dst", dst)
	if p.cfg.AlwaysDenied(dst.Addr()) {
		log.Debug("egress denied: always-denied address")
		_ = c.Close()
		return
	}
	var replay []byte
	name, isTLS := "", false
	if pol.needsName(dst.Addr()) {
		replay, name, isTLS = sniff(c, p.cfg.SniffTimeout)
	}
	ok, bound := p.permits(context.Background(), pol, dst.Addr(), name)
	if !ok {
		log.Info("egress denied", "host", name)
		_ = c.Close()
		return
	}
	t := &tracked{guest: guest, dst: dst, name: name, bound: bound, c: c}
	if !p.track(t) {
		_ = c.Close()
		return
	}
	defer p.untrack(t)
	client := &replayConn{Conn: c, r: io.MultiReader(bytes.NewReader(replay), c)}
	if name != "" && isTLS && pol.headersFor(name) != nil {
		p.intercept(client, guest, local, dst, name)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	up, err := p.dial(ctx, pol, local, dst)
	cancel()
	if err != nil {
		log.Info("egress dial failed: connection closed", "host", name, "err", err)
		_ = c.Close()
		return
	}
	splice(client, up)
}

// permits is the policy's verdict, with the name bound to its DNS answers: when only the name
// allows the connection, host must resolve (Config.Resolver) to a. bound reports that it did.
func (p *Proxy) permits(ctx context.Context, pol *Policy, a netip.Addr, host string) (ok, bound bool) {
	ok, byName := pol.verdict(a, host)
	if !ok || !byName {
		return ok, false
	}
	addrs, err := p.resolve(ctx, host)
	if err != nil {
		p.log.Info("egress: an allowed name does not resolve", "host", host, "dst", a, "err", err)
		return false, false
	}
	if !slices.Contains(addrs, a.Unmap()) {
		p.log.Info("egress denied: the name does not resolve to the address dialled", "host", host, "dst", a, "answers", addrs)
		return false, false
	}
	return true, true
}

// resolve returns host's addresses, from a short-lived cache (nameTTL) or the resolver.
func (p *Proxy) resolve(ctx context.Context, host string) ([]netip.Addr, error) {
	if addrs, ok := p.names.get(host); ok {
		return addrs, nil
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	addrs, err := p.cfg.Resolver.LookupNetIP(ctx, "ip", host)
	if err != nil {
		return nil, err
	}
	for i := range addrs {
		addrs[i] = addrs[i].Unmap()
	}
	p.names.put(host, addrs)
	return addrs, nil
}

// nameTTL is how long a name's answers are reused (the resolver gives no TTL; a short one
// keeps a name moved to new addresses usable).
const nameTTL = 10 * time.Second

// nameCache holds recent answers of the resolver.
type nameCache struct {
	mu sync.Mutex
	m  map[string]nameEntry
}

type nameEntry struct {
	addrs []netip.Addr
	until time.Time
}

func (c *nameCache) get(host string) ([]netip.Addr, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.m[host]
	if !ok || time.Now().After(e.until) {
		return nil, false
	}
	return e.addrs, true
}

func (c *nameCache) put(host string, addrs []netip.Addr) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil || len(c.m) >= 4096 {
		c.m = map[string]nameEntry{}
	}
	c.m[host] = nameEntry{addrs: addrs, until: time.Now().Add(nameTTL)}
}

// dial connects to dst, through the policy's SOCKS5 upstream when it has one (never around
// it), from local: the address the sandbox reached the proxy at (its slot's host side), so
// the host routes and masquerades the proxy's connections as it does the slot's own.
func (p *Proxy) dial(ctx context.Context, pol *Policy, local netip.Addr, dst netip.AddrPort) (net.Conn, error) {
	d := &net.Dialer{Timeout: 10 * time.Second}
	if local.IsValid() && !local.IsUnspecified() {
		d.LocalAddr = &net.TCPAddr{IP: local.AsSlice()}
	}
	if pol.Upstream == nil {
		return d.DialContext(ctx, "tcp", dst.String())
	}
	var auth *proxy.Auth
	if pol.Upstream.Username != "" || pol.Upstream.Password != "" {
		auth = &proxy.Auth{User: pol.Upstream.Username, Password: pol.Upstream.Password}
	}
	s, err := proxy.SOCKS5("tcp", pol.Upstream.Address, auth, d)
	if err != nil {
		return nil, err
	}
	cd, ok := s.(proxy.ContextDialer)
	if !ok {
		return nil, fmt.Errorf("socks5 dialer without context")
	}
	conn, err := cd.DialContext(ctx, "tcp", dst.String())
	if err != nil {
		return nil, fmt.Errorf("egress proxy upstream %s: %w", pol.Upstream.Address, err)
	}
	return conn, nil
}

// intercept terminates the TLS connection with goproxy (a certificate of the node's CA for
// name) and forwards each request with the rule's headers.
func (p *Proxy) intercept(client *replayConn, guest, local netip.Addr, dst netip.AddrPort, name string) {
	done := make(chan struct{})
	client.onClose = func() { close(done) }
	client.skipWrites = 1 // goproxy's "200 OK" answer to the CONNECT made up below
	gp := goproxy.NewProxyHttpServer()
	gp.Logger = slogPrinter{p.log}
	gp.CertStore = &p.certs
	tr := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			pol := p.policy(guest)
			if pol == nil {
				return nil, fmt.Errorf("sandbox %s has no egress policy", guest)
			}
			return p.dial(ctx, pol, local, dst)
		},
		TLSClientConfig:       &tls.Config{RootCAs: p.roots, MinVersion: tls.VersionTLS12},
		ForceAttemptHTTP2:     false,
		MaxIdleConnsPerHost:   4,
		IdleConnTimeout:       30 * time.Second,
		ResponseHeaderTimeout: 5 * time.Minute,
	}
	defer tr.CloseIdleConnections()
	gp.Tr = tr
	mitm := &goproxy.ConnectAction{Action: goproxy.ConnectMitm, TLSConfig: goproxy.TLSConfigFromCA(&p.cfg.CA)}
	gp.OnRequest().HandleConnectFunc(func(host string, _ *goproxy.ProxyCtx) (*goproxy.ConnectAction, string) {
		return mitm, host
	})
	gp.OnRequest().DoFunc(func(r *http.Request, _ *goproxy.ProxyCtx) (*http.Request, *http.Response) {
		return p.transform(r, guest, dst)
	})
	hostport := net.JoinHostPort(name, strconv.Itoa(int(dst.Port())))
	req := &http.Request{Method: http.MethodConnect, URL: &url.URL{Host: hostport}, Host: hostport,
		Header: http.Header{}, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1, RemoteAddr: client.RemoteAddr().String()}
	gp.ServeHTTP(&hijacker{c: client}, req)
	<-done
}

// transform applies the current policy to one intercepted request: a host the policy denies
// gets 403, a host with a rule gets its headers (secrets resolved now).
func (p *Proxy) transform(r *http.Request, guest netip.Addr, dst netip.AddrPort) (*http.Request, *http.Response) {
	pol := p.policy(guest)
	host := hostOnly(r.Host)
	if pol == nil {
		return r, goproxy.NewResponse(r, goproxy.ContentTypeText, http.StatusForbidden, "egress to "+host+" is denied by the sandbox's network rules\n")
	}
	if ok, _ := p.permits(r.Context(), pol, dst.Addr(), host); !ok {
		p.log.Info("egress denied", "guest", guest, "dst", dst, "host", host)
		return r, goproxy.NewResponse(r, goproxy.ContentTypeText, http.StatusForbidden, "egress to "+host+" is denied by the sandbox's network rules\n")
	}
	for k, vs := range pol.headersFor(host) {
		v := strings.Join(vs, ", ")
		if p.cfg.Secrets != nil {
			var err error
			if v, err = p.cfg.Secrets.Expand(r.Context(), pol.Owner, v); err != nil {
				p.log.Warn("egress rule: secret not resolved", "guest", guest, "host", host, "header", k, "err", err)
				return r, goproxy.NewResponse(r, goproxy.ContentTypeText, http.StatusBadGateway, "egress rule for "+host+": "+err.Error()+"\n")
			}
		}
		r.Header.Set(k, v)
	}
	return r, nil
}

func hostOnly(hostport string) string {
	if h, _, err := net.SplitHostPort(hostport); err == nil {
		return strings.ToLower(h)
	}
	return strings.ToLower(strings.Trim(hostport, "[]"))
}

// errSniffed stops the TLS handshake once the ClientHello was read.
var errSniffed = errors.New("sniffed")

// sniff reads the client's first bytes (up to timeout) and returns them with the name they
// carry: the SNI of a TLS ClientHello or the Host of an HTTP request.
func sniff(c net.Conn, timeout time.Duration) (replay []byte, name string, isTLS bool) {
	var rec bytes.Buffer
	_ = c.SetReadDeadline(time.Now().Add(timeout))
	defer func() { _ = c.SetReadDeadline(time.Time{}) }()
	src := io.TeeReader(c, &rec)
	first := make([]byte, 1)
	if _, err := io.ReadFull(src, first); err != nil {
		return rec.Bytes(), "", false
	}
	rest := io.MultiReader(bytes.NewReader(first), src)
	switch {
	case first[0] == 0x16: // TLS handshake record
		isTLS = true
		hs := tls.Server(&replayConn{Conn: c, r: rest, discardWrites: true}, &tls.Config{
			GetConfigForClient: func(h *tls.ClientHelloInfo) (*tls.Config, error) {
				name = h.ServerName
				return nil, errSniffed
			},
		})
		_ = hs.Handshake()
	case first[0] >= 'A' && first[0] <= 'Z': // an HTTP method
		if req, err := http.ReadRequest(bufio.NewReader(rest)); err == nil {
			name = hostOnly(req.Host)
		}
	}
	if _, err := netip.ParseAddr(name); err == nil {
		name = "" // an address is not a name
	}
	return rec.Bytes(), strings.TrimSuffix(strings.ToLower(name), "."), isTLS
}

// replayConn reads r (the sniffed bytes, then the connection) and can drop its first writes.
type replayConn struct {
	net.Conn
	r             io.Reader
	discardWrites bool
	skipWrites    int
	once          sync.Once
	onClose       func()
}

func (c *replayConn) Read(b []byte) (int, error) { return c.r.Read(b) }

func (c *replayConn) Write(b []byte) (int, error) {
	if c.discardWrites {
		return len(b), nil
	}
	if c.skipWrites > 0 {
		c.skipWrites--
		return len(b), nil
	}
	return c.Conn.Write(b)
}

func (c *replayConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() {
		if c.onClose != nil {
			c.onClose()
		}
	})
	return err
}

// hijacker is the ResponseWriter goproxy's CONNECT handling hijacks the client from.
type hijacker struct {
	c net.Conn
	h http.Header
}

func (h *hijacker) Header() http.Header {
	if h.h == nil {
		h.h = http.Header{}
	}
	return h.h
}
func (h *hijacker) Write(b []byte) (int, error) { return len(b), nil }
func (h *hijacker) WriteHeader(int)             {}
func (h *hijacker) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	return h.c, bufio.NewReadWriter(bufio.NewReader(strings.NewReader("")), bufio.NewWriter(h.c)), nil
}

// splice copies both ways until both sides are done.
func splice(client, up net.Conn) {
	var wg sync.WaitGroup
	wg.Add(2)
	half := func(dst, src net.Conn) {
		defer wg.Done()
		_, _ = io.Copy(dst, src)
		if cw, ok := dst.(interface{ CloseWrite() error }); ok {
			_ = cw.CloseWrite()
		} else {
			_ = dst.Close()
		}
	}
	go half(up, client)
	go half(client, up)
	wg.Wait()
	_ = up.Close()
	_ = client.Close()
}

// certCache keeps the leaf certificates signed for intercepted hosts (goproxy.CertStorage).
type certCache struct{ m sync.Map }

func (s *certCache) Fetch(host string, gen func() (*tls.Certificate, error)) (*tls.Certificate, error) {
	if c, ok := s.m.Load(host); ok {
		return c.(*tls.Certificate), nil
	}
	c, err := gen()
	if err != nil {
		return nil, err
	}
	s.m.Store(host, c)
	return c, nil
}

// slogPrinter is goproxy's logger on slog (debug level).
type slogPrinter struct{ l *slog.Logger }

func (s slogPrinter) Printf(format string, v ...any) {
	s.l.Debug("egress proxy: " + fmt.Sprintf(format, v...))
}
