package network

import (
	"context"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/egress"
)

// TestEgressProxyRedirect: a slot with Proxy has its outbound TCP redirected to the node's
// egress proxy, which finds the original destination and decides by its policy; a slot
// without it is not redirected. Real slots, nftables and the upstream namespace.
func TestEgressProxyRedirect(t *testing.T) {
	ln, err := net.Listen("tcp4", "0.0.0.0:0")
	if err != nil {
		t.Fatal(err)
	}
	var m *Manager
	px, err := egress.New(egress.Config{SniffTimeout: 300 * time.Millisecond,
		AlwaysDenied: func(a netip.Addr) bool { return m.IsAlwaysDenied(a) }})
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = px.Serve(ln) }()
	t.Cleanup(func() { px.Close() })
	proxyPort := uint16(ln.Addr().(*net.TCPAddr).Port)

	m = newEgressManagerWith(t, func(c *Config) { c.ProxyPort = proxyPort })
	up := makeUpstream(t)
	target := net.JoinHostPort(pubA, up.port)

	s := mustAcquire(t, m, SlotOptions{AllowInternet: true, Proxy: true})
	if _, err := dial(t, s.NetNSPath, target, blockedWait); err == nil {
		t.Fatal("proxied slot without a policy reached the upstream (the proxy must fail closed)")
	}
	px.Set(s.GuestIP, &egress.Policy{AllowInternet: true})
	seen, err := dial(t, s.NetNSPath, target, openWait)
	if err != nil || !strings.HasPrefix(seen, upstreamHostIP+":") {
		t.Fatalf("through the proxy: seen %q, err %v (want the masqueraded %s)", seen, err, upstreamHostIP)
	}
	px.Set(s.GuestIP, &egress.Policy{AllowInternet: false, AllowHosts: []string{"allowed.test"}})
	if _, err := dial(t, s.NetNSPath, target, blockedWait); err == nil {
		t.Fatal("denied by the proxy's policy, yet reached")
	}
	// The proxy refuses the always-denied ranges whatever the policy says.
	px.Set(s.GuestIP, &egress.Policy{AllowInternet: true, AllowOut: []netip.Prefix{netip.MustParsePrefix("0.0.0.0/0")}})
	for _, ip := range []string{metadataIP, privateIP} {
		if _, err := dial(t, s.NetNSPath, net.JoinHostPort(ip, up.port), blockedWait); err == nil {
			t.Fatalf("%s reached through the proxy", ip)
		}
	}
	// Back to no proxy: the firewall alone decides again.
	if err := m.Update(context.Background(), s, SlotOptions{AllowInternet: true}); err != nil {
		t.Fatal(err)
	}
	px.Set(s.GuestIP, nil)
	if _, err := dial(t, s.NetNSPath, target, openWait); err != nil {
		t.Fatalf("unproxied slot: %v", err)
	}
}
