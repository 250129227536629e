package sandbox

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"regexp"
	"slices"
	"strings"

	"github.com/ember-sandbox/ember/internal/envdclient"
	"github.com/ember-sandbox/ember/internal/errdefs"
)

// E2B's network configuration of a sandbox (SandboxNetworkConfig): egress rules, enforced by the
// node's network slots, and the guest-port controls the API edge enforces.

// AllTraffic is E2B's ALL_TRAFFIC: every IPv4 address.
const AllTraffic = "0.0.0.0/0"

// TrafficAccessTokenHeader carries a sandbox's traffic access token on guest-port requests.
const TrafficAccessTokenHeader = "e2b-traffic-access-token"

// MaskRequestHostPort is replaced by the guest port in MaskRequestHost.
const MaskRequestHostPort = "${PORT}"

// MaxEgressEntries bounds allowOut and denyOut (each slot's rules are one nft transaction).
const MaxEgressEntries = 1024

// ErrMsgDomainsRequireBlockAll is E2B's answer to domains in allowOut without ALL_TRAFFIC denied.
const ErrMsgDomainsRequireBlockAll = "When specifying allowed domains in allow out, you must include 'ALL_TRAFFIC' in deny out to block all other traffic."

// NetworkConfig is the part of E2B's network config a sandbox keeps (persisted with it; fork
// children inherit it, with a traffic token of their own).
type NetworkConfig struct {
	// AllowOut: IPv4 addresses or CIDRs reachable whatever DenyOut (or AllowInternet false) says.
	AllowOut []string `json:"allowOut,omitempty"`
	// DenyOut: IPv4 addresses or CIDRs the sandbox may not reach (AllTraffic = everything).
	DenyOut []string `json:"denyOut,omitempty"`
	// AllowPublicTraffic false: requests to guest ports (not envd's) need TrafficAccessToken in
	// header e2b-traffic-access-token. Nil means true.
	AllowPublicTraffic *bool `json:"allowPublicTraffic,omitempty"`
	// TrafficAccessToken is set when AllowPublicTraffic is false.
	TrafficAccessToken string `json:"trafficAccessToken,omitempty"`
	// MaskRequestHost replaces the Host header of guest-port requests ("${PORT}" = the port).
	MaskRequestHost string `json:"maskRequestHost,omitempty"`
	// Rules are per-domain transforms applied by the egress proxy (egressrules.go).
	Rules map[string][]NetworkRule `json:"rules,omitempty"`
	// EgressProxy is a SOCKS5 upstream all outbound TCP goes through.
	EgressProxy *EgressProxy `json:"egressProxy,omitempty"`
	// HTTPSPorts: guest ports serving HTTPS (E2B's httpsPorts): the sandbox plane reaches them
	// over TLS (certificates not verified, as E2B's proxy), not plain HTTP.
	HTTPSPorts []int `json:"httpsPorts,omitempty"`
	// SecretsOwner is whose secrets the rules' placeholders name (set by the API edge).
	SecretsOwner string `json:"secretsOwner,omitempty"`
}

// Egress is what a network slot enforces: E2B's rule order is always-denied ranges (the
// network's business), then AllowOut (accept), then DenyOut plus, without AllowInternet,
// everything (drop), then accept.
type Egress struct {
	AllowInternet bool
	AllowOut      []netip.Prefix
	DenyOut       []netip.Prefix
	// What the egress proxy enforces (Proxied): host names of allowOut, rules (domain ->
	// header -> value), SOCKS5 upstream, and whose secrets the rules name.
	AllowHosts []string
	Rules      map[string]map[string]string
	Upstream   *EgressProxy
	Owner      string
}

// IsDefault reports E2B's default egress: internet on, no lists.
func (e Egress) IsDefault() bool {
	return e.AllowInternet && len(e.AllowOut) == 0 && len(e.DenyOut) == 0 && !e.Proxied()
}

// Egress returns the rules sb's slot enforces. Entries are validated when stored; one that no
// longer parses makes the egress deny everything rather than open anything.
func (sb *Sandbox) Egress() Egress {
	e := Egress{AllowInternet: sb.AllowInternet}
	if sb.Network == nil {
		return e
	}
	hosts, addrs := egressHosts(sb.Network.AllowOut)
	var err error
	if e.AllowOut, err = parseCIDRs(addrs); err == nil {
		e.DenyOut, err = parseCIDRs(sb.Network.DenyOut)
	}
	if err != nil {
		return Egress{}
	}
	e.AllowHosts = hosts
	e.Rules = ruleHeaders(sb.Network.Rules)
	e.Upstream = sb.Network.EgressProxy.clone()
	e.Owner = sb.Network.SecretsOwner
	return e
}

// IsDefaultEgress reports whether a create request keeps the default egress (internet on, no
// lists), the one pooled sandboxes are started with.
func (r CreateRequest) IsDefaultEgress() bool {
	if r.AllowInternet != nil && !*r.AllowInternet {
		return false
	}
	return r.Network == nil || len(r.Network.AllowOut) == 0 && len(r.Network.DenyOut) == 0 &&
		len(r.Network.Rules) == 0 && r.Network.EgressProxy == nil
}

// ForNew returns the network config of a new sandbox created with n: a copy, with a fresh
// traffic access token when public traffic is off. Nil stays nil.
func (n *NetworkConfig) ForNew() *NetworkConfig {
	if n == nil {
		return nil
	}
	c := *n
	c.AllowOut = slices.Clone(n.AllowOut)
	c.DenyOut = slices.Clone(n.DenyOut)
	c.Rules = lowerRules(n.Rules)
	c.HTTPSPorts = slices.Clone(n.HTTPSPorts)
	if n.EgressProxy != nil {
		px := *n.EgressProxy
		c.EgressProxy = &px
	}
	c.TrafficAccessToken = ""
	if n.AllowPublicTraffic != nil && !*n.AllowPublicTraffic {
		c.TrafficAccessToken = randomHex(16)
	}
	return &c
}

// GuestHost returns the Host header a request to guest port should carry ("" = keep the
// client's): MaskRequestHost with ${PORT} substituted. envd's port is never masked.
func (n *NetworkConfig) GuestHost(port int) string {
	if n == nil || n.MaskRequestHost == "" || port == envdclient.Port {
		return ""
	}
	return strings.ReplaceAll(n.MaskRequestHost, MaskRequestHostPort, fmt.Sprint(port))
}

// GuestToken returns the traffic access token requests to guest port must carry ("" = none
// needed). envd's port has its own access token and is never gated by this one.
func (n *NetworkConfig) GuestToken(port int) string {
	if n == nil || port == envdclient.Port || n.AllowPublicTraffic == nil || *n.AllowPublicTraffic {
		return ""
	}
	return n.TrafficAccessToken
}

// e2bError is an error of category kind whose text is E2B's message, without the category's
// suffix.
type e2bError struct {
	msg  string
	kind error
}

func (e *e2bError) Error() string { return e.msg }
func (e *e2bError) Unwrap() error { return e.kind }

func invalidf(format string, args ...any) error {
	return &e2bError{msg: fmt.Sprintf(format, args...), kind: errdefs.ErrInvalid}
}

// parseCIDR parses an IPv4 address or CIDR (host bits cleared).
func parseCIDR(s string) (netip.Prefix, bool) {
	if strings.Contains(s, "/") {
		p, err := netip.ParsePrefix(s)
		if err != nil || !p.Addr().Is4() {
			return netip.Prefix{}, false
		}
		return p.Masked(), true
	}
	a, err := netip.ParseAddr(s)
	if err != nil || !a.Is4() {
		return netip.Prefix{}, false
	}
	return netip.PrefixFrom(a, 32), true
}

func parseCIDRs(entries []string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, e := range entries {
		p, ok := parseCIDR(e)
		if !ok {
			return nil, invalidf("invalid CIDR %s", e)
		}
		out = append(out, p)
	}
	return out, nil
}

// isIPOrCIDR is E2B's test for "not a domain" (IPv6 included, which ember then refuses).
func isIPOrCIDR(s string) bool {
	if _, err := netip.ParseAddr(s); err == nil {
		return true
	}
	_, _, err := net.ParseCIDR(s)
	return err == nil
}

// ValidateEgress checks allowOut and denyOut as E2B does, with E2B's messages, and refuses what
// ember cannot enforce: domain names in allowOut (ember filters by address only; E2B itself
// accepts them only when denyOut holds ALL_TRAFFIC, so that check comes first) and IPv6
// entries (sandboxes have no IPv6 egress). Errors wrap errdefs.ErrInvalid.
func ValidateEgress(allowOut, denyOut []string) error {
	if len(allowOut) > MaxEgressEntries || len(denyOut) > MaxEgressEntries {
		return invalidf("allow out and deny out may hold at most %d entries each", MaxEgressEntries)
	}
	for _, e := range slices.Concat(allowOut, denyOut) {
		if h, p, err := net.SplitHostPort(e); err == nil && p != "" && isIPOrCIDR(h) {
			return invalidf("invalid entry %s: port-specific rules are not supported by this server; give an IP address or CIDR", e)
		}
	}
	for _, d := range denyOut {
		if !isIPOrCIDR(d) {
			return invalidf("invalid denied CIDR %s", d)
		}
		if _, ok := parseCIDR(d); !ok {
			return invalidf("invalid denied CIDR %s: only IPv4 addresses and CIDRs are supported", d)
		}
	}
	var domains []string
	for _, a := range allowOut {
		if !isIPOrCIDR(a) {
			domains = append(domains, a)
			continue
		}
		p, ok := parseCIDR(a)
		if !ok {
			return invalidf("invalid allowed address %s: only IPv4 addresses and CIDRs are supported", a)
		}
		if p.Addr().IsUnspecified() && a != AllTraffic {
			return invalidf("invalid allowed address %s", a)
		}
	}
	if len(domains) > 0 && !slices.Contains(denyOut, AllTraffic) {
		return invalidf("%s", ErrMsgDomainsRequireBlockAll)
	}
	for _, d := range domains {
		if err := validHostName("allowed address", d); err != nil {
			return err
		}
	}
	return nil
}

var maskHostRe = regexp.MustCompile(`^[A-Za-z0-9._\-\[\]:]+$`)

// ValidateNetwork checks a create request's network config (E2B's messages).
func ValidateNetwork(n *NetworkConfig) error {
	if n == nil {
		return nil
	}
	if h := n.MaskRequestHost; h != "" {
		probe := strings.ReplaceAll(h, MaskRequestHostPort, "1")
		for _, r := range probe {
			if r > 127 {
				return invalidf("mask request host '%s' is not ASCII. Please use ASCII characters only.", h)
			}
		}
		host := probe
		if hh, _, err := net.SplitHostPort(probe); err == nil {
			host = hh
		} else if strings.Contains(err.Error(), "missing port") {
			host = probe
		} else {
			return invalidf("mask request host is not valid: %s", h)
		}
		if host == "" || !maskHostRe.MatchString(probe) {
			return invalidf("mask request host is not valid: %s", h)
		}
	}
	if err := ValidateEgress(n.AllowOut, n.DenyOut); err != nil {
		return err
	}
	return ValidateRules(n.Rules, n.EgressProxy, n.HTTPSPorts)
}

// NetworkUpdate is PUT /sandboxes/{id}/network: it replaces the egress lists (an omitted list is
// cleared, as E2B does). AllowInternet nil keeps the sandbox's current setting.
type NetworkUpdate struct {
	AllowInternet *bool
	AllowOut      []string
	DenyOut       []string
	Rules         map[string][]NetworkRule
	EgressProxy   *EgressProxy
	// SecretsOwner is whose secrets the new rules' placeholders name (the caller's team, set by
	// the API edge); "" keeps the sandbox's.
	SecretsOwner string
}

// egressUpdater is implemented by networks that can change a held slot's rules in place.
type egressUpdater interface {
	Update(ctx context.Context, index int, e Egress) error
}

// UpdateNetwork replaces a running sandbox's egress rules at once (no window without rules).
// Unknown sandboxes are ErrNotFound, paused ones ErrConflict (E2B: 404 and 409).
func (m *Manager) UpdateNetwork(ctx context.Context, id string, u NetworkUpdate) error {
	if err := ValidateEgress(u.AllowOut, u.DenyOut); err != nil {
		return err
	}
	if err := ValidateRules(u.Rules, u.EgressProxy, nil); err != nil {
		return err
	}
	notFound := &e2bError{msg: fmt.Sprintf("Sandbox %q doesn't exist or you don't have access to it", id), kind: errdefs.ErrNotFound}
	e, err := m.entry(id)
	if err != nil {
		return notFound
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	switch e.sb.State {
	case StateKilled:
		return notFound
	case StatePaused:
		return &e2bError{msg: fmt.Sprintf("Sandbox %q is paused", id), kind: errdefs.ErrConflict}
	}
	up, ok := m.cfg.Network.(egressUpdater)
	if !ok {
		return fmt.Errorf("this node's network cannot change egress rules at runtime: %w", errdefs.ErrUnavailable)
	}
	next := *e.sb
	if u.AllowInternet != nil {
		next.AllowInternet = *u.AllowInternet
	}
	var nc NetworkConfig
	if e.sb.Network != nil {
		nc = *e.sb.Network
	}
	nc.AllowOut, nc.DenyOut = slices.Clone(u.AllowOut), slices.Clone(u.DenyOut)
	nc.Rules, nc.EgressProxy = lowerRules(u.Rules), u.EgressProxy
	if u.SecretsOwner != "" {
		nc.SecretsOwner = u.SecretsOwner
	}
	next.Network = &nc
	if err := up.Update(ctx, e.sb.Runtime.SlotIndex, next.Egress()); err != nil {
		return fmt.Errorf("update network of sandbox %q: %w", id, err)
	}
	if len(nc.Rules) > 0 && e.sb.Runtime.GuestIP != "" {
		if err := m.trustEgressCA(ctx, m.guest, envdBase(e.sb.Runtime.GuestIP), &next); err != nil { // egressca.go
			m.logger(id).Warn("egress CA not installed; TLS to the rules' hosts will not verify", "err", err)
		}
	}
	e.sb.AllowInternet, e.sb.Network = next.AllowInternet, next.Network
	if err := m.cfg.Store.PutSandbox(ctx, e.sb); err != nil {
		return err
	}
	m.logger(id).Info("egress rules updated", "allow_internet", next.AllowInternet, "allow_out", len(nc.AllowOut), "deny_out", len(nc.DenyOut),
		"rules", len(nc.Rules), "egress_proxy", nc.EgressProxy.String())
	return nil
}
