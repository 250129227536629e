package network

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"text/template"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// Destinations no slot may reach, internet or not: this-network, private, CGNAT, loopback,
// link-local, IETF protocol assignments, benchmarking, multicast, reserved and broadcast.
var deniedV4 = []string{
	"0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
	"172.16.0.0/12", "192.0.0.0/24", "192.168.0.0/16", "198.18.0.0/15", "224.0.0.0/4", "240.0.0.0/4",
}

// The IPv6 equivalents: unspecified and loopback, IPv4-mapped, NAT64 local use, discard-only,
// unique local, link-local, multicast. (Slots have no IPv6 address today; this is defence in depth.)
var deniedV6 = []string{
	"::/127", "::ffff:0:0/96", "64:ff9b:1::/48", "100::/64", "fc00::/7", "fe80::/10", "ff00::/8",
}

var rulesetTmpl = template.Must(template.New("ruleset").Parse(`table inet {{.Table}} {}
delete table inet {{.Table}}
table inet {{.Table}} {
	set denied4 {
		type ipv4_addr
		flags interval
		elements = { {{.Denied4}} }
	}

	set denied6 {
		type ipv6_addr
		flags interval
		elements = { {{.Denied6}} }
	}
{{if .ProxyPort}}
	# Slots whose outbound TCP goes through the node's egress proxy (SlotOptions.Proxy).
	set proxied {
		type ifname
	}
{{end}}
	# A slot may only send with its own source address (strict reverse path), so it cannot
	# inject packets into the host's connections to other slots.
	chain prerouting {
		type filter hook prerouting priority raw; policy accept;
		iifname "{{.Prefix}}*" fib saddr . iif oif missing drop
	}

	# Nothing from a slot reaches the host, except replies on connections the host opened
	# (the daemon talking to envd).
	chain input {
		type filter hook input priority filter - 10; policy accept;
		iifname "{{.Prefix}}*" ct state established,related accept
{{- if .ProxyPort}}
		iifname @proxied tcp dport {{.ProxyPort}} ct status dnat accept
{{- end}}
		iifname "{{.Prefix}}*" drop
	}
{{if .ProxyPort}}
	# The TCP of the proxied slots (but DNS) goes to the node's egress proxy
	# (internal/egress), which finds where it was going from conntrack.
	chain proxy_redirect {
		type nat hook prerouting priority dstnat; policy accept;
		iifname @proxied meta l4proto tcp tcp dport != 53 redirect to :{{.ProxyPort}}
	}
{{end}}

	# Slots never reach each other; what else a slot reaches is decided by its own chain
	# (egress.go), reached through the slots map; a slot without one reaches nothing. Nothing
	# from outside reaches a slot unasked.
	map slots {
		type ifname : verdict
	}

	chain forward {
		type filter hook forward priority filter - 10; policy accept;
		iifname "{{.Prefix}}*" oifname "{{.Prefix}}*" drop
		iifname "{{.Prefix}}*" iifname vmap @slots
		iifname "{{.Prefix}}*" drop
		oifname "{{.Prefix}}*" ct state established,related accept
		oifname "{{.Prefix}}*" drop
	}

{{if .Mark}}
	# Only the daemon talks to slots from the host: its sockets carry the node's mark (setting
	# SO_MARK takes CAP_NET_ADMIN), so no other host process reaches envd or a guest port.
	chain output {
		type filter hook output priority filter - 10; policy accept;
{{- if .ProxyPort}}
		oifname @proxied tcp sport {{.ProxyPort}} ct status dnat accept
{{- end}}
		oifname "{{.Prefix}}*" meta mark != {{.Mark}} drop
	}
{{end}}
	chain postrouting {
		type nat hook postrouting priority srcnat; policy accept;
		ip saddr {{.CIDR}} oifname != "{{.Prefix}}*" masquerade
	}
}
`))

// Ruleset returns the nftables script Init applies: it creates or atomically replaces this
// manager's table (family inet) and touches nothing else. It holds no slot's egress rules;
// Init adds those of the slots it knows in the same transaction.
func (m *Manager) Ruleset() string {
	var b bytes.Buffer
	_ = rulesetTmpl.Execute(&b, map[string]any{
		"Table":     m.cfg.Table,
		"Prefix":    m.cfg.NamePrefix,
		"CIDR":      m.cfg.CIDR.String(),
		"Denied4":   strings.Join(deniedV4, ", "),
		"Denied6":   strings.Join(deniedV6, ", "),
		"Mark":      m.cfg.HostMark,
		"ProxyPort": m.cfg.ProxyPort,
	})
	return b.String()
}

// Init prepares the host; it is idempotent and safe while slots are in use: it turns on IPv4
// forwarding, makes NetNSDir a shared mount point, checks that no foreign interface carries
// the name prefix (the firewall matches interfaces by it), and installs or replaces the
// nftables table.
func (m *Manager) Init(ctx context.Context) error {
	names, err := m.links.names()
	if err != nil {
		return err
	}
	for _, n := range names {
		if strings.HasPrefix(n, m.cfg.NamePrefix) && !m.vethRe.MatchString(n) {
			return fmt.Errorf("network.name_prefix: %q also matches host interface %q, which the firewall would cut off: %w", m.cfg.NamePrefix, n, errdefs.ErrInvalid)
		}
	}
	if err := os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1"), 0o644); err != nil {
		return fmt.Errorf("enable ip_forward: %w", err)
	}
	if err := prepareNetNSDir(); err != nil {
		return err
	}
	nft, err := exec.LookPath("nft")
	if err != nil {
		return fmt.Errorf("nft not found (apt-get install nftables): %w", errdefs.ErrUnavailable)
	}
	// Replacing the table drops every slot chain: re-add the installed ones in the same
	// transaction, so no slot loses (or gains) anything while Init runs.
	m.fwMu.Lock()
	defer m.fwMu.Unlock()
	m.nft = nft
	rules := map[int]SlotOptions{}
	m.mu.Lock()
	for index, s := range m.active {
		rules[index] = s.Options
	}
	for index, opts := range m.rules { // pooled slots with rules made ahead
		if _, held := rules[index]; !held && m.fwReady {
			rules[index] = opts
		}
	}
	m.mu.Unlock()
	script := m.Ruleset()
	for index, opts := range rules {
		script += m.slotRules(index, opts)
	}
	if err := m.nftApply(ctx, script); err != nil {
		return fmt.Errorf("install nftables table inet %s: %w", m.cfg.Table, err)
	}
	m.rules = rules
	m.fwReady = true
	return nil
}
