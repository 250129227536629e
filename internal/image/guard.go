package image

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"syscall"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/remote"
)

// Registry addresses. A pull runs on the host's network, past every sandbox egress rule, so a
// registry a build request names may not be on the host's own or a private network (loopback,
// RFC 1918 and ULA, link-local with the cloud metadata service, CGNAT, unspecified,
// multicast) unless the operator allows it (Resolver.Allow, the daemon's --registry-allow).
// The check is on the address each connection dials, after DNS resolution, so a name that
// resolves there and a redirect there are refused alike.

var (
	cgnat  = netip.MustParsePrefix("100.64.0.0/10") // carrier-grade NAT; Alibaba's metadata service
	nat64  = netip.MustParsePrefix("64:ff9b::/96")
	thisV4 = netip.MustParsePrefix("0.0.0.0/8")
)

// publicAddr returns an error saying why a is not a public unicast address.
func publicAddr(a netip.Addr) error {
	a = a.Unmap()
	if nat64.Contains(a) {
		b := a.As16()
		a = netip.AddrFrom4([4]byte{b[12], b[13], b[14], b[15]})
	}
	switch {
	case !a.IsValid() || a.IsUnspecified() || thisV4.Contains(a):
		return fmt.Errorf("%s is an unspecified address", a)
	case a.IsLoopback():
		return fmt.Errorf("%s is a loopback address", a)
	case a.IsPrivate():
		return fmt.Errorf("%s is a private address", a)
	case a.IsLinkLocalUnicast() || a.IsLinkLocalMulticast():
		return fmt.Errorf("%s is a link-local address (the cloud metadata service's)", a)
	case cgnat.Contains(a):
		return fmt.Errorf("%s is a shared (CGNAT) address", a)
	case a.IsMulticast() || a.IsInterfaceLocalMulticast():
		return fmt.Errorf("%s is a multicast address", a)
	}
	return nil
}

// refusedError is a connection the address check refused.
type refusedError struct {
	dial string // the address as dialled (host:port)
	why  error
}

func (e *refusedError) Error() string {
	return fmt.Sprintf("registry %s refused: %v; the operator allows a registry on such an address with --registry-allow %s", e.dial, e.why, e.dial)
}

// allowed reports whether the operator allows dial (host:port) on any address: it is listed in
// Allow, or is one of the operator's mirrors.
func (r *Resolver) allowed(dial string) bool {
	host, _, err := net.SplitHostPort(dial)
	if err != nil {
		host = dial
	}
	allow := r.Allow
	for _, m := range r.Mirrors {
		allow = append(allow, m) // the operator's own mirrors
	}
	for _, a := range allow {
		a = strings.ToLower(strings.TrimSpace(a))
		if a == strings.ToLower(dial) || a == strings.ToLower(host) || a == "["+strings.ToLower(host)+"]" {
			return true
		}
	}
	return false
}

// guardedTransport is remote's default transport with a dialer that refuses the addresses
// publicAddr refuses, unless the registry as dialled is allowed.
func (r *Resolver) guardedTransport() http.RoundTripper {
	base := remote.DefaultTransport.(*http.Transport).Clone()
	d := &net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}
	base.DialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
		if r.allowed(addr) {
			return d.DialContext(ctx, network, addr)
		}
		gd := *d
		gd.Control = func(_, address string, _ syscall.RawConn) error {
			ap, err := netip.ParseAddrPort(address)
			if err != nil {
				return &refusedError{dial: addr, why: err}
			}
			if err := publicAddr(ap.Addr()); err != nil {
				return &refusedError{dial: addr, why: err}
			}
			return nil
		}
		return gd.DialContext(ctx, network, addr)
	}
	return base
}

// credGuard carries the operator's credentials for one registry: a request that would take
// them (an Authorization header, a token request's form) to a host that is neither the
// registry nor of its domain (Docker Hub's token service is auth.docker.io) is refused.
type credGuard struct {
	base     http.RoundTripper
	registry string // host[:port] as the reference names it
}

// credError is a request the credential guard refused.
type credError struct{ registry, host string }

func (e *credError) Error() string {
	return fmt.Sprintf("registry %s sent its credentials' request to %s, another host: the operator's credentials for %s are not sent there", e.registry, e.host, e.registry)
}

func (g *credGuard) RoundTrip(req *http.Request) (*http.Response, error) {
	carries := req.Header.Get("Authorization") != "" || req.Method == http.MethodPost
	if carries && !sameRegistry(g.registry, req.URL.Host) {
		if req.Body != nil {
			req.Body.Close()
		}
		return nil, &credError{registry: g.registry, host: req.URL.Host}
	}
	return g.base.RoundTrip(req)
}

// sameRegistry reports whether host (of a request) is registry's host, or a host of the same
// domain (the last two labels of a DNS name; an address or a port must match exactly).
func sameRegistry(registry, host string) bool {
	norm := func(h string) string {
		h = strings.ToLower(h)
		for _, p := range []string{":443", ":80"} {
			h = strings.TrimSuffix(h, p)
		}
		return h
	}
	r, h := norm(registry), norm(host)
	if r == "index.docker.io" || r == "docker.io" {
		r = "registry-1.docker.io"
	}
	if r == h {
		return true
	}
	if strings.Contains(r, ":") || strings.Contains(h, ":") {
		return false // a port, or an IPv6 address
	}
	if _, err := netip.ParseAddr(r); err == nil {
		return false
	}
	domain := func(s string) string {
		parts := strings.Split(s, ".")
		if len(parts) < 2 {
			return s
		}
		return strings.Join(parts[len(parts)-2:], ".")
	}
	return domain(r) == domain(h) && strings.Contains(r, ".")
}
