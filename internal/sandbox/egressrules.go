package sandbox

import (
	"fmt"
	"maps"
	"net"
	"net/netip"
	"os"
	"regexp"
	"slices"
	"strings"

	"golang.org/x/net/http/httpguts"

	"github.com/ember-sandbox/ember/internal/envdclient"
)

// E2B's egress by name (SandboxNetworkConfig's allowOut host names, rules, egressProxy):
// enforced by the node's egress proxy (internal/egress), which the sandbox's outbound TCP goes
// through when any of them is set. httpsPorts (guest ports serving HTTPS themselves) is the
// sandbox plane's: it reaches those ports over TLS, not verified (GuestURL, guest.go).

// Limits on what one sandbox's rules may hold.
const (
	MaxRuleDomains      = 64
	MaxRulesPerDomain   = 8
	MaxHeadersPerRule   = 32
	MaxHeaderValueBytes = 8 << 10
	MaxHTTPSPorts       = 64
)

// NetworkRule is one of a domain's rules (E2B's SandboxNetworkRule).
type NetworkRule struct {
	Transform *NetworkTransform `json:"transform,omitempty"`
}

// NetworkTransform is what a rule changes in matching requests: headers set (replacing any
// of the same name). Values may hold `${e2b.secrets.<name>}`, resolved by the proxy.
type NetworkTransform struct {
	Headers map[string]string `json:"headers,omitempty"`
}

// EgressProxy is a SOCKS5 upstream every outbound connection goes through (E2B's egressProxy).
type EgressProxy struct {
	Address  string `json:"address"`
	Username string `json:"username,omitempty"`
	Password string `json:"password,omitempty"`
}

// Proxied reports whether the slot's TCP goes through the egress proxy.
func (e Egress) Proxied() bool {
	return len(e.AllowHosts) > 0 || len(e.Rules) > 0 || e.Upstream != nil
}

// hostNameRe is a DNS name, optionally with a leading "*." wildcard label.
var hostNameRe = regexp.MustCompile(`^(\*\.)?([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$`)

// internalNameSuffixes are names that only mean something on the host's side.
var internalNameSuffixes = []string{"localhost", ".local", ".internal", ".localdomain", ".home.arpa", ".in-addr.arpa"}

// hostName is os.Hostname (a variable for tests).
var hostName = os.Hostname

// validHostName checks a host-name entry (allowOut, a rule's domain): a DNS name, not one of
// the host's own or of a private namespace.
func validHostName(kind, name string) error {
	n := strings.ToLower(strings.TrimSuffix(name, "."))
	if len(n) > 253 || !hostNameRe.MatchString(n) {
		return invalidf("invalid %s %s: not a host name", kind, name)
	}
	bare := strings.TrimPrefix(n, "*.")
	for _, s := range internalNameSuffixes {
		if bare == strings.TrimPrefix(s, ".") || strings.HasSuffix(bare, s) {
			return invalidf("invalid %s %s: internal names cannot be reached from a sandbox", kind, name)
		}
	}
	if h, err := hostName(); err == nil && strings.EqualFold(bare, h) {
		return invalidf("invalid %s %s: the host itself cannot be reached from a sandbox", kind, name)
	}
	return nil
}

// internalAddr reports addresses a sandbox's egress never reaches: loopback, private,
// link-local, CGNAT, unspecified, multicast, and the host's own.
func internalAddr(a netip.Addr) bool {
	a = a.Unmap()
	if a.IsLoopback() || a.IsPrivate() || a.IsLinkLocalUnicast() || a.IsLinkLocalMulticast() ||
		a.IsUnspecified() || a.IsMulticast() || a.IsInterfaceLocalMulticast() ||
		netip.MustParsePrefix("100.64.0.0/10").Contains(a) || netip.MustParsePrefix("0.0.0.0/8").Contains(a) {
		return true
	}
	addrs, _ := net.InterfaceAddrs()
	for _, ia := range addrs {
		if n, ok := ia.(*net.IPNet); ok {
			if h, ok := netip.AddrFromSlice(n.IP); ok && h.Unmap() == a {
				return true
			}
		}
	}
	return false
}

var placeholderRe = regexp.MustCompile(`\$\{e2b\.secrets\.([^}]*)\}`)
var secretNameRe = regexp.MustCompile(`^[A-Za-z0-9_-]{1,128}$`)

// hopHeaders may not be set by a rule: they frame the request, not describe it.
var hopHeaders = []string{"host", "content-length", "transfer-encoding", "connection", "upgrade", "te",
	"trailer", "keep-alive", "proxy-connection", "proxy-authorization", "expect"}

// ValidateRules checks a network's rules, egress proxy and HTTPS ports. Errors wrap
// errdefs.ErrInvalid.
func ValidateRules(rules map[string][]NetworkRule, px *EgressProxy, httpsPorts []int) error {
	if len(rules) > MaxRuleDomains {
		return invalidf("network rules may name at most %d domains", MaxRuleDomains)
	}
	for _, domain := range slices.Sorted(maps.Keys(rules)) {
		if a, err := netip.ParseAddr(domain); err == nil {
			if internalAddr(a) {
				return invalidf("invalid rule domain %s: internal, loopback and link-local addresses cannot be reached from a sandbox", domain)
			}
			return invalidf("invalid rule domain %s: rules apply to host names, not addresses", domain)
		}
		if err := validHostName("rule domain", domain); err != nil {
			return err
		}
		if _, dup := rules[strings.ToLower(domain)]; dup && domain != strings.ToLower(domain) {
			return invalidf("rule domain %s is given twice (names are case-insensitive)", domain)
		}
		rs := rules[domain]
		if len(rs) > MaxRulesPerDomain {
			return invalidf("rules for %s: at most %d", domain, MaxRulesPerDomain)
		}
		for _, r := range rs {
			if r.Transform == nil {
				continue
			}
			if len(r.Transform.Headers) > MaxHeadersPerRule {
				return invalidf("rule for %s: at most %d headers", domain, MaxHeadersPerRule)
			}
			for k, v := range r.Transform.Headers {
				if !httpguts.ValidHeaderFieldName(k) {
					return invalidf("rule for %s: invalid header name %q", domain, k)
				}
				if slices.Contains(hopHeaders, strings.ToLower(k)) {
					return invalidf("rule for %s: header %s cannot be set by a rule", domain, k)
				}
				if len(v) > MaxHeaderValueBytes || !httpguts.ValidHeaderFieldValue(v) {
					return invalidf("rule for %s: invalid value of header %s (at most %d bytes, no CR, LF or other control characters)", domain, k, MaxHeaderValueBytes)
				}
				for _, m := range placeholderRe.FindAllStringSubmatch(v, -1) {
					if !secretNameRe.MatchString(m[1]) {
						return invalidf("rule for %s: header %s names an invalid secret %q", domain, k, m[1])
					}
				}
			}
		}
	}
	if len(httpsPorts) > MaxHTTPSPorts {
		return invalidf("network httpsPorts: at most %d ports", MaxHTTPSPorts)
	}
	for _, p := range httpsPorts {
		if p <= 0 || p > 65535 {
			return invalidf("network httpsPorts: invalid port %d", p)
		}
		if p == envdclient.Port {
			return invalidf("network httpsPorts: the envd port (%d) cannot be listed", envdclient.Port)
		}
	}
	if px != nil {
		if err := validateEgressProxy(px); err != nil {
			return err
		}
	}
	return nil
}

// egressProxyAddr returns host:port of an egressProxy address ("h:1080" or
// "socks5://h:1080").
func egressProxyAddr(addr string) string {
	for _, p := range []string{"socks5://", "socks5h://"} {
		if rest, ok := strings.CutPrefix(addr, p); ok {
			return rest
		}
	}
	return addr
}

func validateEgressProxy(px *EgressProxy) error {
	hp := egressProxyAddr(px.Address)
	host, port, err := net.SplitHostPort(hp)
	if err != nil || host == "" || port == "" {
		return invalidf("invalid egress proxy address %q: want host:port of a SOCKS5 proxy", px.Address)
	}
	if n, err := net.LookupPort("tcp", port); err != nil || n < 1 {
		return invalidf("invalid egress proxy address %q: bad port", px.Address)
	}
	if a, err := netip.ParseAddr(host); err == nil {
		if internalAddr(a) {
			return invalidf("invalid egress proxy address %s: internal, loopback and link-local addresses cannot be reached from a sandbox", px.Address)
		}
	} else if err := validHostName("egress proxy address", host); err != nil {
		return err
	}
	if len(px.Username) > 255 || len(px.Password) > 255 {
		return invalidf("egress proxy username and password: at most 255 bytes each")
	}
	if strings.ContainsAny(px.Username+px.Password, "\x00\r\n") {
		return invalidf("egress proxy username and password must not contain control characters")
	}
	return nil
}

// egressHosts splits allowOut into its host names (lower case) for the proxy.
func egressHosts(entries []string) (hosts []string, addrs []string) {
	for _, e := range entries {
		if isIPOrCIDR(e) {
			addrs = append(addrs, e)
		} else {
			hosts = append(hosts, strings.ToLower(strings.TrimSuffix(e, ".")))
		}
	}
	return hosts, addrs
}

// lowerRules returns rules with their domains in lower case (E2B normalizes them on write).
func lowerRules(rules map[string][]NetworkRule) map[string][]NetworkRule {
	if rules == nil {
		return nil
	}
	out := make(map[string][]NetworkRule, len(rules))
	for d, rs := range rules {
		out[strings.TrimSuffix(strings.ToLower(d), ".")] = rs
	}
	return out
}

// ruleHeaders flattens a network's rules to the headers set per domain (later rules of a
// domain override earlier ones).
func ruleHeaders(rules map[string][]NetworkRule) map[string]map[string]string {
	if len(rules) == 0 {
		return nil
	}
	out := map[string]map[string]string{}
	for d, rs := range rules {
		h := map[string]string{}
		for _, r := range rs {
			if r.Transform != nil {
				maps.Copy(h, r.Transform.Headers)
			}
		}
		out[strings.ToLower(d)] = h
	}
	return out
}

func (p *EgressProxy) clone() *EgressProxy {
	if p == nil {
		return nil
	}
	c := *p
	c.Address = egressProxyAddr(c.Address)
	return &c
}

// String never shows the password.
func (p *EgressProxy) String() string {
	if p == nil {
		return "<none>"
	}
	return fmt.Sprintf("socks5://%s", p.Address)
}
