package network

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"strings"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// Egress rules, with E2B's semantics (SandboxNetworkConfig / updateNetwork):
//
//  1. always denied, whatever the rules say: the ranges of deniedV4/deniedV6 (loopback,
//     link-local incl. 169.254.169.254, private, CGNAT, multicast, reserved), this manager's
//     own CIDR (other slots), the host itself (input chain) and IPv6 altogether (slots have
//     none);
//  2. AllowOut: accepted; an allowed entry always wins over a denied one;
//  3. DenyOut, plus 0.0.0.0/0 when AllowInternet is false (E2B: "allowInternetAccess: false
//     behaves the same as denyOut: [0.0.0.0/0]"; allowOut still applies): dropped;
//  4. everything else: accepted and masqueraded.
//
// DNS: sandboxes use the resolvers of the template's /etc/resolv.conf, which is the host's
// (Config.Resolvers). Those are often private addresses, so they get one exception to rule 1:
// TCP and UDP port 53 to a resolver is accepted when the user rules (2–4) would accept the
// resolver's address, as if it were public. Internet on means DNS works; internet off means no
// DNS either (no tunnelling out through the resolver), unless allowOut names the resolver.
//
// The rules of slot i live in chain "slot_i" of the manager's table, reached through the verdict
// map "slots" keyed by the slot's host veth. A slot with no chain reaches nothing (the forward
// chain drops it), so a slot is fail-closed until its rules are installed. Update rewrites the
// chain (flush + add) in one nft transaction: packets see the old rules or the new, never none.
// Rules are checked on every forwarded packet, not only new connections, so an update that
// denies a destination also cuts connections already open to it.

// SlotOptions are a slot's egress rules.
type SlotOptions struct {
	// AllowInternet false denies 0.0.0.0/0 (AllowOut still applies).
	AllowInternet bool
	// AllowOut destinations are reachable even when DenyOut (or AllowInternet false) covers them.
	AllowOut []netip.Prefix
	// DenyOut destinations are dropped unless AllowOut covers them.
	DenyOut []netip.Prefix
	// Proxy redirects the slot's outbound TCP (but DNS) to the node's egress proxy
	// (Config.ProxyPort), which applies the address rules above and its own by name.
	Proxy bool
	// ProxyOnly drops whatever the proxy does not carry (UDP, ICMP; DNS to the resolvers
	// stays): set when all traffic must leave through the proxy's SOCKS5 upstream.
	ProxyOnly bool
}

// allTraffic is E2B's ALL_TRAFFIC.
var allTraffic = netip.MustParsePrefix("0.0.0.0/0")

// ParsePrefixes parses egress entries: IPv4 addresses ("8.8.8.8", meaning /32) or IPv4 CIDRs
// ("8.8.8.0/24"; host bits are cleared). Anything else (IPv6, domain names, garbage) is
// errdefs.ErrInvalid naming the entry.
func ParsePrefixes(entries []string) ([]netip.Prefix, error) {
	out := make([]netip.Prefix, 0, len(entries))
	for _, e := range entries {
		p, err := ParsePrefix(e)
		if err != nil {
			return nil, err
		}
		out = append(out, p)
	}
	return out, nil
}

// ParsePrefix parses one egress entry (see ParsePrefixes).
func ParsePrefix(entry string) (netip.Prefix, error) {
	s := strings.TrimSpace(entry)
	var p netip.Prefix
	if strings.Contains(s, "/") {
		pp, err := netip.ParsePrefix(s)
		if err != nil {
			return netip.Prefix{}, fmt.Errorf("%q is not an IP address or CIDR: %w", entry, errdefs.ErrInvalid)
		}
		p = pp
	} else {
		a, err := netip.ParseAddr(s)
		if err != nil {
			return netip.Prefix{}, fmt.Errorf("%q is not an IP address or CIDR: %w", entry, errdefs.ErrInvalid)
		}
		p = netip.PrefixFrom(a, a.BitLen())
	}
	if !p.Addr().Is4() {
		return netip.Prefix{}, fmt.Errorf("%q: only IPv4 addresses and CIDRs are supported (sandboxes have no IPv6 egress): %w", entry, errdefs.ErrInvalid)
	}
	return p.Masked(), nil
}

// normalize sorts the prefixes and drops those contained in another (CIDRs either nest or are
// disjoint, so the rest never overlap, as nft interval sets require).
func normalize(ps []netip.Prefix) []netip.Prefix {
	in := slices.Clone(ps)
	for i := range in {
		in[i] = in[i].Masked()
	}
	slices.SortFunc(in, func(a, b netip.Prefix) int {
		if a.Bits() != b.Bits() {
			return a.Bits() - b.Bits()
		}
		return a.Addr().Compare(b.Addr())
	})
	var out []netip.Prefix
	for _, p := range in {
		covered := false
		for _, q := range out {
			if q.Bits() <= p.Bits() && q.Contains(p.Addr()) {
				covered = true
				break
			}
		}
		if !covered {
			out = append(out, p)
		}
	}
	slices.SortFunc(out, func(a, b netip.Prefix) int { return a.Addr().Compare(b.Addr()) })
	return out
}

// normalized returns o with both lists normalized, so equal rules compare equal.
func (o SlotOptions) normalized() SlotOptions {
	return SlotOptions{AllowInternet: o.AllowInternet, AllowOut: normalize(o.AllowOut), DenyOut: normalize(o.DenyOut),
		Proxy: o.Proxy, ProxyOnly: o.ProxyOnly}
}

func (o SlotOptions) equal(p SlotOptions) bool {
	a, b := o.normalized(), p.normalized()
	return a.AllowInternet == b.AllowInternet && slices.Equal(a.AllowOut, b.AllowOut) && slices.Equal(a.DenyOut, b.DenyOut) &&
		a.Proxy == b.Proxy && a.ProxyOnly == b.ProxyOnly
}

func covers(ps []netip.Prefix, a netip.Addr) bool {
	for _, p := range ps {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// deniesAll reports whether the deny side covers every address.
func (o SlotOptions) deniesAll() bool {
	return !o.AllowInternet || slices.Contains(normalize(o.DenyOut), allTraffic)
}

// Allows reports whether the user rules (allow over deny, then default allow) let the slot
// reach a; the always-denied set is not considered.
func (o SlotOptions) Allows(a netip.Addr) bool {
	a = a.Unmap()
	if covers(o.AllowOut, a) {
		return true
	}
	if !o.AllowInternet || covers(o.DenyOut, a) {
		return false
	}
	return true
}

// IsAlwaysDenied reports whether a is in the ranges no slot may reach whatever its rules
// (this manager's CIDR included).
func (m *Manager) IsAlwaysDenied(a netip.Addr) bool {
	a = a.Unmap()
	if !a.Is4() {
		return true
	}
	if m.cfg.CIDR.Contains(a) {
		return true
	}
	for _, s := range deniedV4 {
		if netip.MustParsePrefix(s).Contains(a) {
			return true
		}
	}
	return false
}

func joinPrefixes(ps []netip.Prefix) string {
	s := make([]string, len(ps))
	for i, p := range ps {
		if p.IsSingleIP() {
			s[i] = p.Addr().String()
		} else {
			s[i] = p.String()
		}
	}
	return strings.Join(s, ", ")
}

func chainName(index int) string { return fmt.Sprintf("slot_%d", index) }

// slotRules returns the nft commands that (re)install slot index's chain with opts and map its
// host veth to it. They are meant to run inside one transaction.
func (m *Manager) slotRules(index int, opts SlotOptions) string {
	opts = opts.normalized()
	t, c := m.cfg.Table, chainName(index)
	veth := m.slotFor(index).HostVeth
	var b strings.Builder
	rule := func(format string, args ...any) {
		fmt.Fprintf(&b, "add rule inet %s %s %s\n", t, c, fmt.Sprintf(format, args...))
	}
	fmt.Fprintf(&b, "add chain inet %s %s\n", t, c)
	fmt.Fprintf(&b, "flush chain inet %s %s\n", t, c)
	var dns []netip.Prefix
	for _, r := range m.cfg.Resolvers {
		if opts.Allows(r) {
			dns = append(dns, netip.PrefixFrom(r, 32))
		}
	}
	if len(dns) > 0 {
		rule("ip daddr { %s } meta l4proto { tcp, udp } th dport 53 accept", joinPrefixes(dns))
	}
	rule("meta nfproto ipv6 drop")
	if opts.ProxyOnly && m.cfg.ProxyPort != 0 {
		rule("drop")
	}
	rule("ip daddr @denied4 drop")
	rule("ip daddr %s drop", m.cfg.CIDR)
	if len(opts.AllowOut) > 0 {
		rule("ip daddr { %s } accept", joinPrefixes(opts.AllowOut))
	}
	switch {
	case opts.deniesAll():
		rule("drop")
	case len(opts.DenyOut) > 0:
		rule("ip daddr { %s } drop", joinPrefixes(opts.DenyOut))
		rule("accept")
	default:
		rule("accept")
	}
	fmt.Fprintf(&b, "add element inet %s slots { %q : jump %s }\n", t, veth, c)
	if m.cfg.ProxyPort != 0 {
		fmt.Fprintf(&b, "add element inet %s proxied { %q }\n", t, veth) // add is idempotent
		if !opts.Proxy {
			fmt.Fprintf(&b, "delete element inet %s proxied { %q }\n", t, veth)
		}
	}
	return b.String()
}

// removeSlotRules returns the nft commands that remove slot index's map entry and chain,
// whether or not they exist.
func (m *Manager) removeSlotRules(index int) string {
	t, c := m.cfg.Table, chainName(index)
	veth := m.slotFor(index).HostVeth
	out := fmt.Sprintf("add chain inet %[1]s %[2]s\nadd element inet %[1]s slots { %[3]q : jump %[2]s }\n"+
		"delete element inet %[1]s slots { %[3]q }\nflush chain inet %[1]s %[2]s\ndelete chain inet %[1]s %[2]s\n", t, c, veth)
	if m.cfg.ProxyPort != 0 {
		out += fmt.Sprintf("add element inet %[1]s proxied { %[2]q }\ndelete element inet %[1]s proxied { %[2]q }\n", t, veth)
	}
	return out
}

// nftApply runs script as one nft transaction.
func (m *Manager) nftApply(ctx context.Context, script string) error {
	nft := m.nft
	if nft == "" {
		p, err := exec.LookPath("nft")
		if err != nil {
			return fmt.Errorf("nft not found (apt-get install nftables): %w", errdefs.ErrUnavailable)
		}
		nft = p
	}
	m.nftRuns.Add(1)
	cmd := exec.CommandContext(ctx, nft, "-f", "-")
	cmd.Stdin = strings.NewReader(script)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("nft (table inet %s): %w: %s", m.cfg.Table, err, bytes.TrimSpace(out))
	}
	return nil
}

// installRules makes slot index's installed rules opts (no-op if they already are, or if Init
// never installed the firewall).
func (m *Manager) installRules(ctx context.Context, index int, opts SlotOptions) error {
	m.fwMu.Lock()
	defer m.fwMu.Unlock()
	return m.installRulesLocked(ctx, index, opts)
}

func (m *Manager) installRulesLocked(ctx context.Context, index int, opts SlotOptions) error {
	if !m.fwReady {
		return nil
	}
	if cur, ok := m.rules[index]; ok && cur.equal(opts) {
		return nil
	}
	if err := m.nftApply(ctx, m.slotRules(index, opts)); err != nil {
		return fmt.Errorf("egress rules of slot %d: %w", index, err)
	}
	m.rules[index] = opts.normalized()
	return nil
}

// uninstallRules removes slot index's rules, if any were installed.
func (m *Manager) uninstallRules(ctx context.Context, index int) error {
	m.fwMu.Lock()
	defer m.fwMu.Unlock()
	if _, ok := m.rules[index]; !ok || !m.fwReady {
		return nil
	}
	if err := m.nftApply(ctx, m.removeSlotRules(index)); err != nil {
		return fmt.Errorf("remove egress rules of slot %d: %w", index, err)
	}
	delete(m.rules, index)
	return nil
}

// Update replaces the egress rules of a held slot atomically (see the package's egress notes):
// connections the new rules deny stop at their next packet, new ones follow the new rules. On
// error the old rules stay in force.
func (m *Manager) Update(ctx context.Context, s *Slot, opts SlotOptions) error {
	m.fwMu.Lock() // Init reads s.Options under it: the record and the kernel move together
	defer m.fwMu.Unlock()
	m.mu.Lock()
	ok := m.active[s.Index] == s
	m.mu.Unlock()
	if !ok {
		return fmt.Errorf("slot %d is not held: %w", s.Index, errdefs.ErrNotFound)
	}
	if err := m.installRulesLocked(ctx, s.Index, opts); err != nil {
		return err
	}
	m.mu.Lock()
	s.Options = opts.normalized()
	m.mu.Unlock()
	return nil
}

// Rules returns the egress rules a held slot has now.
func (m *Manager) Rules(s *Slot) SlotOptions {
	m.mu.Lock()
	defer m.mu.Unlock()
	return s.Options
}

// SetAllowInternet switches a slot's internet access, keeping its allow and deny lists.
func (m *Manager) SetAllowInternet(s *Slot, allow bool) error {
	m.mu.Lock()
	opts := s.Options
	m.mu.Unlock()
	opts.AllowInternet = allow
	return m.Update(context.Background(), s, opts)
}

// hostResolvers returns the IPv4 nameservers of /etc/resolv.conf, which templates copy into
// their rootfs. Loopback resolvers are left out: a sandbox's loopback is its own.
func hostResolvers(path string) []netip.Addr {
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []netip.Addr
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 2 || fields[0] != "nameserver" {
			continue
		}
		a, err := netip.ParseAddr(fields[1])
		if err != nil || !a.Unmap().Is4() || a.IsLoopback() || a.IsUnspecified() {
			continue
		}
		out = append(out, a.Unmap())
	}
	return out
}

// defaultOptions are E2B's defaults (internet on, no lists); pooled slots get them ahead.
var defaultOptions = SlotOptions{AllowInternet: true}
