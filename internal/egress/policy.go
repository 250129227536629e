// Package egress is the node's egress proxy: the outbound TCP of sandboxes that have host-name
// filters, per-domain rules or a SOCKS5 upstream is redirected to it by their slot's nftables
// rules (internal/network), and it decides, per connection, from the original destination and
// the name the client gives (TLS SNI, HTTP Host):
//
//   - the always-denied ranges (private, loopback, link-local, the slots' CIDR...) stay denied;
//   - a name matching AllowHosts is allowed, else one matching DenyHosts is denied, else the
//     address rules decide (AllowOut, then DenyOut / no internet, then allow) as the firewall
//     does for sandboxes without the proxy;
//   - for a name with Rules, TLS (any port) is terminated with a certificate the node's CA
//     signs for the name (the sandbox trusts that CA), then each request whose Host matches
//     gets the rule's headers, with
//     `${e2b.secrets.<name>}` replaced by the owner's secret, and goes to the real server over
//     TLS verified against the system roots (plus Config.RootCAs): a secret is only ever sent to
//     a server that proves the name. Plain HTTP is never given a rule's headers (a secret
//     would cross the network in clear); it and every other connection pass through untouched.
//   - with an Upstream, every connection leaves through that SOCKS5 proxy; when it cannot be
//     reached the connection is closed (fail closed, never direct).
//
// The connection always goes to the address the sandbox dialled: a name only widens or
// narrows what that address may do, and it widens it only to the addresses the name really
// has: when only an allowed name would let a connection through, the proxy resolves that name
// itself (Config.Resolver, the node's resolver) and refuses the connection unless the dialled
// address is among the answers. A sandbox allowed x.com cannot reach any address by sending
// SNI or Host x.com to it. The TLS interception and HTTP forwarding are
// github.com/elazarl/goproxy's; SOCKS5 is golang.org/x/net/proxy's.
package egress

import (
	"net/http"
	"net/netip"
	"slices"
	"strings"
)

// Policy is one sandbox's egress as the proxy applies it.
type Policy struct {
	AllowInternet bool
	AllowOut      []netip.Prefix
	DenyOut       []netip.Prefix
	// AllowHosts and DenyHosts are host-name patterns: "example.com" (that name) or
	// "*.example.com" (any name below it).
	AllowHosts []string
	DenyHosts  []string
	// Rules maps host-name patterns to the headers set on matching HTTPS requests (values may
	// hold `${e2b.secrets.<name>}`). An exact name wins over wildcards, a longer wildcard
	// over a shorter one; rule sets are not merged.
	Rules map[string]http.Header
	// Upstream, when set, carries every connection (SOCKS5).
	Upstream *Upstream
	// Owner is whose secrets the placeholders name.
	Owner string
}

// Upstream is a SOCKS5 proxy (E2B's egressProxy).
type Upstream struct {
	Address  string
	Username string
	Password string
}

// MatchHost reports whether host matches pattern ("example.com" or "*.example.com").
func MatchHost(pattern, host string) bool {
	host = strings.TrimSuffix(strings.ToLower(host), ".")
	pattern = strings.ToLower(pattern)
	if suffix, ok := strings.CutPrefix(pattern, "*."); ok {
		return strings.HasSuffix(host, "."+suffix)
	}
	return host == pattern
}

func matchAny(patterns []string, host string) bool {
	return slices.ContainsFunc(patterns, func(p string) bool { return MatchHost(p, host) })
}

// headersFor returns the rule headers for host (nil when no rule matches): the exact name's,
// else the longest matching wildcard's.
func (p *Policy) headersFor(host string) http.Header {
	host = strings.TrimSuffix(strings.ToLower(host), ".")
	if h, ok := p.Rules[host]; ok {
		return h
	}
	best := ""
	for k := range p.Rules {
		if strings.HasPrefix(k, "*.") && MatchHost(k, host) && len(k) > len(best) {
			best = k
		}
	}
	if best == "" {
		return nil
	}
	return p.Rules[best]
}

func covers(ps []netip.Prefix, a netip.Addr) bool {
	return slices.ContainsFunc(ps, func(p netip.Prefix) bool { return p.Contains(a) })
}

// allowsAddr is the address rules' verdict (allow over deny, then default).
func (p *Policy) allowsAddr(a netip.Addr) bool {
	if covers(p.AllowOut, a) {
		return true
	}
	return p.AllowInternet && !covers(p.DenyOut, a)
}

// needsName reports whether a name could change the address rules' verdict for a, or whether
// the connection may need terminating: only then does the proxy wait for the client's first
// bytes.
func (p *Policy) needsName(a netip.Addr) bool {
	if len(p.Rules) > 0 {
		return true
	}
	if p.allowsAddr(a) {
		return len(p.DenyHosts) > 0
	}
	return len(p.AllowHosts) > 0
}

// verdict is the policy's answer for a connection to a with name host ("" = none seen):
// allowed, and whether only the name allows it (byName: the address rules alone would deny a),
// in which case the proxy lets it through only if host resolves to a (Proxy.permits).
func (p *Policy) verdict(a netip.Addr, host string) (ok, byName bool) {
	if host != "" {
		if matchAny(p.AllowHosts, host) {
			return true, !p.allowsAddr(a)
		}
		if matchAny(p.DenyHosts, host) {
			return false, false
		}
	}
	return p.allowsAddr(a), false
}
