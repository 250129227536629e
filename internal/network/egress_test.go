package network

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// The egress tests use names of their own (prefix, table, CIDR, upstream namespace), distinct
// from the other network tests and from any daemon's.
const (
	egressPrefix   = "xnt"
	egressTable    = "ember_nettest"
	upstreamNS     = "xnet-up"
	upstreamVeth   = "xnetup0"
	egressRuleTab  = 21213 // policy-routing table and rule priority for the slots' traffic
	upstreamHostIP = "203.0.113.253"
	upstreamNSIP   = "203.0.113.254"
)

var (
	egressCIDR = netip.MustParsePrefix("10.212.0.0/16")
	// Servers in the upstream namespace: "public" documentation addresses, a resolver in a
	// denied range, and stand-ins for the metadata service and a private host.
	pubA, pubB, pubC = "203.0.113.10", "203.0.113.11", "203.0.113.12"
	resolverIP       = "198.18.1.53"
	metadataIP       = "169.254.169.254"
	privateIP        = "10.250.99.1"
)

func egressConfig() Config {
	return Config{CIDR: egressCIDR, NamePrefix: egressPrefix, Table: egressTable,
		Resolvers: []netip.Addr{netip.MustParseAddr(resolverIP)}}
}

// newEgressManager needs root and nft; it installs the firewall and removes every slot and the
// table when the test ends.
func newEgressManager(t *testing.T, pool int) *Manager {
	t.Helper()
	return newEgressManagerWith(t, func(c *Config) { c.PoolSize = pool })
}

// newEgressManagerWith is newEgressManager with a config of the test's.
func newEgressManagerWith(t *testing.T, set func(*Config)) *Manager {
	t.Helper()
	testutil.RequireRoot(t)
	_, err := exec.LookPath("nft")
	testutil.Need(t, err == nil, "nft not installed (apt-get install nftables)")
	wipeEgress := func() {
		m, err := New(egressConfig())
		if err != nil {
			t.Fatal(err)
		}
		if err := m.Reconcile(context.Background(), nil); err != nil {
			t.Errorf("wipe: %v", err)
		}
		_ = exec.Command("nft", "delete", "table", "inet", egressTable).Run()
	}
	wipeEgress()
	t.Cleanup(wipeEgress)
	cfg := egressConfig()
	set(&cfg)
	m, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close(context.Background()) })
	if err := m.Init(context.Background()); err != nil {
		t.Fatal(err)
	}
	return m
}

// upstream is "the internet" of the egress tests: namespace xnet-up behind veth xnetup0
// (203.0.113.253/30 on the host, .254 inside), holding every server address. Only traffic from
// the test's slot CIDR is routed to it (policy routing), so whatever the firewall does, the
// slots' packets never leave the machine, and the host's own routes are untouched.
type upstream struct {
	path string
	port string // TCP port every server address answers on (with the remote address it sees)
	echo string // TCP port every server address echoes lines on
}

func makeUpstream(t *testing.T) *upstream {
	t.Helper()
	path := NetNSDir + "/" + upstreamNS
	rule := netlink.NewRule()
	rule.Src = &net.IPNet{IP: net.IP(egressCIDR.Addr().AsSlice()), Mask: net.CIDRMask(egressCIDR.Bits(), 32)}
	rule.Table, rule.Priority = egressRuleTab, egressRuleTab
	local := netlink.NewRule() // slot to slot stays on the main table (and is firewalled)
	local.Src, local.Dst = rule.Src, rule.Src
	local.Table, local.Priority = unix.RT_TABLE_MAIN, egressRuleTab-1
	cleanup := func() {
		_ = netlink.RuleDel(rule)
		_ = netlink.RuleDel(local)
		if l, err := netlink.LinkByName(upstreamVeth); err == nil {
			_ = netlink.LinkDel(l) // takes the table's gateway routes with it
		}
		routes, _ := netlink.RouteListFiltered(netlink.FAMILY_V4, &netlink.Route{Table: egressRuleTab}, netlink.RT_FILTER_TABLE)
		for _, r := range routes {
			_ = netlink.RouteDel(&r)
		}
		_, _ = removeNetNS(path)
	}
	cleanup()
	t.Cleanup(cleanup)
	inside := []string{upstreamNSIP + "/30", pubA + "/32", pubB + "/32", pubC + "/32", resolverIP + "/32", metadataIP + "/32", privateIP + "/32"}
	if err := newNetNSWithVeth(path, upstreamVeth, inside, upstreamHostIP); err != nil {
		t.Fatalf("make upstream netns: %v", err)
	}
	l, err := netlink.LinkByName(upstreamVeth)
	if err != nil {
		t.Fatal(err)
	}
	addr, _ := netlink.ParseAddr(upstreamHostIP + "/30")
	if err := netlink.AddrAdd(l, addr); err != nil {
		t.Fatal(err)
	}
	gw := net.ParseIP(upstreamNSIP)
	for _, dst := range []string{"203.0.113.8/29", resolverIP + "/32", metadataIP + "/32", privateIP + "/32", "0.0.0.0/0"} {
		_, n, _ := net.ParseCIDR(dst)
		r := &netlink.Route{LinkIndex: l.Attrs().Index, Dst: n, Gw: gw, Table: egressRuleTab}
		if dst == "0.0.0.0/0" { // anything else from the slots goes nowhere
			r = &netlink.Route{Dst: n, Type: unix.RTN_UNREACHABLE, Table: egressRuleTab}
		}
		if err := netlink.RouteAdd(r); err != nil {
			t.Fatalf("route %s: %v", dst, err)
		}
	}
	if err := netlink.RuleAdd(local); err != nil {
		t.Fatal(err)
	}
	if err := netlink.RuleAdd(rule); err != nil {
		t.Fatal(err)
	}
	u := &upstream{path: path}
	u.port = port(t, serve(t, path, "0.0.0.0:0"))
	u.echo = port(t, serveEcho(t, path, "0.0.0.0:0"))
	serve(t, path, resolverIP+":53")
	serveUDPEcho(t, path, resolverIP+":53")
	return u
}

// newNetNSWithVeth creates a named netns linked to the host by veth (host end hostVeth, inner
// end eth0 with addrs and a default route via gw).
func newNetNSWithVeth(path, hostVeth string, addrs []string, gw string) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			errc <- err
			return
		}
		defer orig.Close()
		err = func() error {
			f, err := os.Create(path)
			if err != nil {
				return err
			}
			f.Close()
			if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
				return err
			}
			if err := unix.Mount(fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid()), path, "none", unix.MS_BIND, ""); err != nil {
				return err
			}
			ns, err := netns.Get()
			if err != nil {
				return err
			}
			defer ns.Close()
			if err := hostHandle.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: hostVeth, Flags: net.FlagUp}, PeerName: "eth0", PeerNamespace: netlink.NsFd(int(ns))}); err != nil {
				return err
			}
			lo, err := netlink.LinkByName("lo")
			if err != nil {
				return err
			}
			if err := netlink.LinkSetUp(lo); err != nil {
				return err
			}
			eth, err := netlink.LinkByName("eth0")
			if err != nil {
				return err
			}
			for _, a := range addrs {
				addr, err := netlink.ParseAddr(a)
				if err != nil {
					return err
				}
				if err := netlink.AddrAdd(eth, addr); err != nil {
					return err
				}
			}
			if err := netlink.LinkSetUp(eth); err != nil {
				return err
			}
			return netlink.RouteAdd(&netlink.Route{LinkIndex: eth.Attrs().Index, Gw: net.ParseIP(gw)})
		}()
		if rerr := netns.Set(orig); rerr == nil {
			runtime.UnlockOSThread()
		} else if err == nil {
			err = rerr
		}
		errc <- err
	}()
	return <-errc
}

func serveEcho(t *testing.T, nsPath, addr string) string {
	t.Helper()
	var ln net.Listener
	var err error
	inNS(t, nsPath, func() { ln, err = net.Listen("tcp4", addr) })
	if err != nil {
		t.Fatalf("listen %s: %v", addr, err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					if _, err := c.Write([]byte(line)); err != nil {
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().String()
}

func serveUDPEcho(t *testing.T, nsPath, addr string) {
	t.Helper()
	var pc net.PacketConn
	var err error
	inNS(t, nsPath, func() { pc, err = net.ListenPacket("udp4", addr) })
	if err != nil {
		t.Fatalf("listen udp %s: %v", addr, err)
	}
	t.Cleanup(func() { pc.Close() })
	go func() {
		buf := make([]byte, 512)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			_, _ = pc.WriteTo(buf[:n], from)
		}
	}()
}

// udpRoundTrip sends one datagram from the netns at nsPath and waits for the echo.
func udpRoundTrip(t *testing.T, nsPath, addr string, timeout time.Duration) error {
	t.Helper()
	var err error
	inNS(t, nsPath, func() {
		var c net.Conn
		c, err = net.Dial("udp4", addr)
		if err != nil {
			return
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(timeout))
		if _, err = c.Write([]byte("q")); err != nil {
			return
		}
		buf := make([]byte, 16)
		_, err = c.Read(buf)
	})
	return err
}

// hostAddr is a non-loopback IPv4 address of the host outside the slot CIDRs.
func hostAddr(t *testing.T) netip.Addr {
	t.Helper()
	addrs, err := netlink.AddrList(nil, netlink.FAMILY_V4)
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range addrs {
		ip, _ := netip.AddrFromSlice(a.IP.To4())
		if ip.IsValid() && !ip.IsLoopback() && !egressCIDR.Contains(ip) && !testCIDR.Contains(ip) && ip.String() != upstreamHostIP {
			return ip
		}
	}
	testutil.Need(t, false, "host has no IPv4 address besides loopback")
	return netip.Addr{}
}

func pfx(t *testing.T, entries ...string) []netip.Prefix {
	t.Helper()
	ps, err := ParsePrefixes(entries)
	if err != nil {
		t.Fatal(err)
	}
	return ps
}

func TestParsePrefixes(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want string // "" = ErrInvalid
	}{
		{"8.8.8.8", "8.8.8.8/32"},
		{"8.8.8.0/24", "8.8.8.0/24"},
		{"8.8.8.8/24", "8.8.8.0/24"},
		{"0.0.0.0/0", "0.0.0.0/0"},
		{" 1.2.3.4 ", "1.2.3.4/32"},
		{"example.com", ""},
		{"*.example.com", ""},
		{"1.2.3.4/33", ""},
		{"2001:db8::/32", ""},
		{"::ffff:1.2.3.4", ""},
		{"", ""},
		{"1.2.3", ""},
	} {
		t.Run(tc.in, func(t *testing.T) {
			p, err := ParsePrefix(tc.in)
			if tc.want == "" {
				if !errors.Is(err, errdefs.ErrInvalid) {
					t.Fatalf("ParsePrefix(%q) = %v, %v; want ErrInvalid", tc.in, p, err)
				}
				return
			}
			if err != nil || p.String() != tc.want {
				t.Fatalf("ParsePrefix(%q) = %v, %v; want %s", tc.in, p, err, tc.want)
			}
		})
	}
}

func TestAllows(t *testing.T) {
	a := func(s string) netip.Addr { return netip.MustParseAddr(s) }
	for _, tc := range []struct {
		name string
		opts SlotOptions
		addr string
		want bool
	}{
		{"default allows", SlotOptions{AllowInternet: true}, "1.1.1.1", true},
		{"internet off denies", SlotOptions{}, "1.1.1.1", false},
		{"internet off, allowOut wins", SlotOptions{AllowOut: pfx(t, "1.1.1.0/24")}, "1.1.1.1", true},
		{"internet off, allowOut elsewhere", SlotOptions{AllowOut: pfx(t, "1.1.1.0/24")}, "1.1.2.1", false},
		{"denyOut", SlotOptions{AllowInternet: true, DenyOut: pfx(t, "1.1.1.1")}, "1.1.1.1", false},
		{"denyOut elsewhere", SlotOptions{AllowInternet: true, DenyOut: pfx(t, "1.1.1.1")}, "1.1.1.2", true},
		{"allow beats deny", SlotOptions{AllowInternet: true, AllowOut: pfx(t, "1.1.1.1"), DenyOut: pfx(t, "0.0.0.0/0")}, "1.1.1.1", true},
		{"deny all but allowed", SlotOptions{AllowInternet: true, AllowOut: pfx(t, "1.1.1.1"), DenyOut: pfx(t, "0.0.0.0/0")}, "8.8.8.8", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.opts.Allows(a(tc.addr)); got != tc.want {
				t.Fatalf("Allows(%s) = %v, want %v", tc.addr, got, tc.want)
			}
		})
	}
}

func TestSlotRulesText(t *testing.T) {
	m, err := New(egressConfig())
	if err != nil {
		t.Fatal(err)
	}
	rules := m.slotRules(3, SlotOptions{AllowInternet: true, AllowOut: pfx(t, "1.1.1.1", "1.1.0.0/16"), DenyOut: pfx(t, "8.8.8.0/24")})
	for _, want := range []string{
		"add chain inet ember_nettest slot_3\nflush chain inet ember_nettest slot_3\n", // replaced in place
		"ip daddr { 198.18.1.53 } meta l4proto { tcp, udp } th dport 53 accept",
		"ip daddr @denied4 drop",
		"ip daddr 10.212.0.0/16 drop",
		"ip daddr { 1.1.0.0/16 } accept", // 1.1.1.1 is inside 1.1.0.0/16: merged
		"ip daddr { 8.8.8.0/24 } drop",
		`add element inet ember_nettest slots { "xnt3h" : jump slot_3 }`,
	} {
		if !strings.Contains(rules, want) {
			t.Errorf("slot rules lack %q:\n%s", want, rules)
		}
	}
	if strings.Index(rules, "@denied4") > strings.Index(rules, "1.1.0.0/16") {
		t.Errorf("always-denied ranges must come before the allow list:\n%s", rules)
	}
	off := m.slotRules(3, SlotOptions{})
	if strings.Contains(off, "dport 53") || !strings.HasSuffix(strings.TrimSpace(strings.Split(off, "add element")[0]), "slot_3 drop") {
		t.Errorf("internet off: no DNS, everything dropped:\n%s", off)
	}
}

// TestEgressRules checks every rule shape against servers in the upstream namespace, from real
// slots, with a control run without the table proving the firewall is what blocks.
func TestEgressRules(t *testing.T) {
	m := newEgressManager(t, 0)
	up := makeUpstream(t)
	at := func(ip string) string { return net.JoinHostPort(ip, up.port) }
	dns := resolverIP + ":53"
	other := mustAcquire(t, m, SlotOptions{AllowInternet: true})
	otherPort := port(t, serve(t, other.NetNSPath, net.JoinHostPort(other.GuestIP.String(), "0")))
	hostPort := port(t, serve(t, "", "0.0.0.0:0"))
	host := hostAddr(t)

	everything := []string{"0.0.0.0/0", "10.0.0.0/8", "169.254.0.0/16", "198.18.0.0/15", "127.0.0.0/8", egressCIDR.String(), host.String()}
	alwaysDenied := []struct{ name, addr string }{
		{"metadata address", at(metadataIP)},
		{"private 10.x address", at(privateIP)},
		{"resolver on a non-DNS port", at(resolverIP)},
		{"host's own address", net.JoinHostPort(host.String(), hostPort)},
		{"another slot's guest", net.JoinHostPort(other.GuestIP.String(), otherPort)},
	}

	type want struct {
		addr string
		open bool
	}
	cases := []struct {
		name  string
		opts  SlotOptions
		wants []want
		dns   bool
	}{
		{"default: internet on", SlotOptions{AllowInternet: true}, []want{{at(pubA), true}, {at(pubB), true}}, true},
		{"internet off", SlotOptions{}, []want{{at(pubA), false}, {at(pubB), false}}, false},
		{"internet off, allowOut one address", SlotOptions{AllowOut: pfx(t, pubA)}, []want{{at(pubA), true}, {at(pubB), false}}, false},
		{"internet off, allowOut the resolver", SlotOptions{AllowOut: pfx(t, resolverIP)}, []want{{at(pubA), false}}, true},
		{"denyOut one address", SlotOptions{AllowInternet: true, DenyOut: pfx(t, pubA)}, []want{{at(pubA), false}, {at(pubB), true}}, true},
		{"allowOut beats denyOut", SlotOptions{AllowInternet: true, AllowOut: pfx(t, pubB), DenyOut: pfx(t, "203.0.113.0/24")}, []want{{at(pubA), false}, {at(pubB), true}, {at(pubC), false}}, true},
		{"allowOut beats ALL_TRAFFIC", SlotOptions{AllowInternet: true, AllowOut: pfx(t, "203.0.113.8/30"), DenyOut: pfx(t, "0.0.0.0/0")}, []want{{at(pubA), true}, {at(pubC), false}}, false},
		{"allowOut everything, internet off", SlotOptions{AllowOut: pfx(t, everything...)}, []want{{at(pubA), true}}, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := mustAcquire(t, m, tc.opts)
			for _, w := range tc.wants {
				wait := blockedWait
				if w.open {
					wait = openWait
				}
				seen, err := dial(t, s.NetNSPath, w.addr, wait)
				if (err == nil) != w.open {
					t.Errorf("dial %s: err = %v, want open = %v", w.addr, err, w.open)
				}
				if err == nil && !strings.HasPrefix(seen, upstreamHostIP+":") {
					t.Errorf("server saw %s, want the masqueraded %s", seen, upstreamHostIP)
				}
			}
			_, tcpErr := dial(t, s.NetNSPath, dns, map[bool]time.Duration{true: openWait, false: blockedWait}[tc.dns])
			udpErr := udpRoundTrip(t, s.NetNSPath, dns, map[bool]time.Duration{true: openWait, false: blockedWait}[tc.dns])
			if (tcpErr == nil) != tc.dns || (udpErr == nil) != tc.dns {
				t.Errorf("DNS to %s: tcp err = %v, udp err = %v; want open = %v", dns, tcpErr, udpErr, tc.dns)
			}
			for _, d := range alwaysDenied {
				if _, err := dial(t, s.NetNSPath, d.addr, blockedWait); err == nil {
					t.Errorf("%s (%s) reachable with rules %+v", d.name, d.addr, tc.opts)
				}
			}
		})
	}

	// Control: without the table, the same slots reach every always-denied upstream address,
	// so the tests above measure the firewall, not the test network.
	t.Run("control without table", func(t *testing.T) {
		s := mustAcquire(t, m, SlotOptions{})
		if out, err := exec.Command("nft", "delete", "table", "inet", egressTable).CombinedOutput(); err != nil {
			t.Fatalf("delete table: %v: %s", err, out)
		}
		defer func() {
			if err := m.Init(context.Background()); err != nil {
				t.Fatal(err)
			}
		}()
		for _, addr := range []string{at(pubA), at(metadataIP), at(privateIP), at(resolverIP), net.JoinHostPort(other.GuestIP.String(), otherPort)} {
			if _, err := dial(t, s.NetNSPath, addr, openWait); err != nil {
				t.Errorf("without the table %s is unreachable: %v (the test network is broken)", addr, err)
			}
		}
	})
	t.Run("Init keeps every slot's rules", func(t *testing.T) {
		s := mustAcquire(t, m, SlotOptions{AllowOut: pfx(t, pubA)})
		if err := m.Init(context.Background()); err != nil {
			t.Fatal(err)
		}
		if _, err := dial(t, s.NetNSPath, at(pubA), openWait); err != nil {
			t.Errorf("allowed address lost after Init: %v", err)
		}
		if _, err := dial(t, s.NetNSPath, at(pubB), blockedWait); err == nil {
			t.Errorf("denied address open after Init")
		}
	})
}

// TestEgressUpdate flips rules under a client that keeps trying, and cuts a live connection.
func TestEgressUpdate(t *testing.T) {
	m := newEgressManager(t, 0)
	up := makeUpstream(t)
	target := net.JoinHostPort(pubA, up.port)
	s := mustAcquire(t, m, SlotOptions{AllowInternet: true})
	ctx := context.Background()

	// A client dialing every 50 ms records the outcome of each attempt.
	var open atomic.Int32 // 1 reachable, 2 blocked
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		runtime.LockOSThread() // stays locked: the thread dies with the goroutine
		ns, err := netns.GetFromPath(s.NetNSPath)
		if err != nil {
			return
		}
		if err := netns.Set(ns); err != nil {
			return
		}
		for {
			select {
			case <-stop:
				return
			default:
			}
			c, err := net.DialTimeout("tcp4", target, 300*time.Millisecond)
			if err == nil {
				c.Close()
				open.Store(1)
			} else {
				open.Store(2)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}()
	var stopOnce sync.Once
	stopClient := func() { stopOnce.Do(func() { close(stop); <-done }) }
	t.Cleanup(stopClient)
	await := func(want int32, what string) {
		t.Helper()
		open.Store(0)
		testutil.EventuallyOr(t, 5*time.Second, func() bool { return open.Load() == want }, func() string {
			return fmt.Sprintf("%s: client sees %d, want %d", what, open.Load(), want)
		})
	}
	await(1, "default rules")

	// A connection open before the update is cut by it (rules apply to every packet).
	var conn net.Conn
	var err error
	inNS(t, s.NetNSPath, func() { conn, err = net.DialTimeout("tcp4", net.JoinHostPort(pubB, up.echo), openWait) })
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	r := bufio.NewReader(conn)
	echo := func(msg string, wait time.Duration) error {
		conn.SetDeadline(time.Now().Add(wait))
		if _, err := conn.Write([]byte(msg + "\n")); err != nil {
			return err
		}
		line, err := r.ReadString('\n')
		if err == nil && line != msg+"\n" {
			err = fmt.Errorf("echo %q, want %q", line, msg)
		}
		return err
	}
	if err := echo("before", openWait); err != nil {
		t.Fatal(err)
	}

	denied := SlotOptions{AllowInternet: true, DenyOut: pfx(t, "203.0.113.0/24")}
	start := time.Now()
	if err := m.Update(ctx, s, denied); err != nil {
		t.Fatal(err)
	}
	t.Logf("Update (one nft transaction): %v", time.Since(start))
	await(2, "after denyOut")
	if err := echo("after", blockedWait); err == nil {
		t.Fatal("an open connection to a newly denied address still works")
	}
	if got := m.Rules(s); !got.equal(denied) {
		t.Fatalf("Rules = %+v, want %+v", got, denied)
	}

	if err := m.Update(ctx, s, SlotOptions{AllowInternet: true, DenyOut: pfx(t, "203.0.113.0/24"), AllowOut: pfx(t, pubA)}); err != nil {
		t.Fatal(err)
	}
	await(1, "after allowOut")
	if err := m.SetAllowInternet(s, false); err != nil {
		t.Fatal(err)
	}
	await(1, "internet off keeps allowOut")
	if err := m.Update(ctx, s, SlotOptions{}); err != nil {
		t.Fatal(err)
	}
	await(2, "internet off")
	if err := m.Update(ctx, s, SlotOptions{AllowInternet: true}); err != nil {
		t.Fatal(err)
	}
	await(1, "back to default")

	stopClient() // its thread holds the slot's netns until it exits
	if err := m.Release(ctx, s); err != nil {
		t.Fatal(err)
	}
	if err := m.Update(ctx, s, SlotOptions{}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("Update of a released slot: %v, want ErrNotFound", err)
	}
	out, _ := exec.Command("nft", "list", "table", "inet", egressTable).CombinedOutput()
	if strings.Contains(string(out), chainName(s.Index)) || strings.Contains(string(out), s.HostVeth) {
		t.Fatalf("released slot's chain or map entry left:\n%s", out)
	}
}

// TestEgressAdopt: after a restart (new manager, Init replaces the table) a slot nobody adopted
// reaches nothing, and Adopt reinstalls the rules it is given.
func TestEgressAdopt(t *testing.T) {
	m := newEgressManager(t, 0)
	up := makeUpstream(t)
	ctx := context.Background()
	target := net.JoinHostPort(pubA, up.port)
	s, err := m.Acquire(ctx, SlotOptions{AllowInternet: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := dial(t, s.NetNSPath, target, openWait); err != nil {
		t.Fatal(err)
	}
	m2, err := New(egressConfig())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m2.Close(ctx) })
	if err := m2.Init(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := dial(t, s.NetNSPath, target, blockedWait); err == nil {
		t.Fatal("a slot nobody adopted reaches the internet after Init (must fail closed)")
	}
	a, err := m2.Adopt(s.Index, SlotOptions{AllowInternet: true, AllowOut: pfx(t, pubA), DenyOut: pfx(t, "0.0.0.0/0")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m2.Release(ctx, a) })
	if _, err := dial(t, a.NetNSPath, target, openWait); err != nil {
		t.Fatalf("adopted slot: allowed address: %v", err)
	}
	if _, err := dial(t, a.NetNSPath, net.JoinHostPort(pubB, up.port), blockedWait); err == nil {
		t.Fatal("adopted slot: denied address reachable")
	}
}

// TestEgressPool: pooled slots come with the default rules installed, so Acquire with them runs
// no nft; a pooled slot taken with other rules gets those.
func TestEgressPool(t *testing.T) {
	m := newEgressManager(t, 2)
	up := makeUpstream(t)
	ctx := context.Background()
	target := net.JoinHostPort(pubA, up.port)
	if err := m.Reconcile(ctx, nil); err != nil { // starts the pool
		t.Fatal(err)
	}
	waitPool(t, m)
	runs := m.nftRuns.Load()
	start := time.Now()
	def := mustAcquire(t, m, defaultOptions)
	took := time.Since(start)
	if n := m.nftRuns.Load() - runs; n != 0 {
		t.Errorf("Acquire from the pool with default rules ran nft %d times", n)
	}
	t.Logf("Acquire from the pool with default rules: %v", took)
	if _, err := dial(t, def.NetNSPath, target, openWait); err != nil {
		t.Fatalf("pooled slot with default rules: %v", err)
	}
	waitPool(t, m)
	off := mustAcquire(t, m, SlotOptions{})
	if _, err := dial(t, off.NetNSPath, target, blockedWait); err == nil {
		t.Fatal("pooled slot taken with internet off reaches the internet")
	}
}

// TestEgressUpdateIsAtomic flips between two rule sets that both allow one address while a
// client keeps connecting to it: with a window between removing the old rules and adding the
// new ones, some connections would be dropped.
func TestEgressUpdateIsAtomic(t *testing.T) {
	m := newEgressManager(t, 0)
	up := makeUpstream(t)
	ctx := context.Background()
	a := SlotOptions{AllowOut: pfx(t, pubA, pubB)}
	b := SlotOptions{AllowOut: pfx(t, pubA, pubC), DenyOut: pfx(t, pubB)}
	s := mustAcquire(t, m, a)
	target := net.JoinHostPort(pubA, up.port)
	// Warm up first (neighbour resolution, a loaded machine): the test is about the updates.
	if _, err := dial(t, s.NetNSPath, target, openWait); err != nil {
		t.Fatalf("target not reachable before any update: %v", err)
	}

	stop := make(chan struct{})
	type tally struct{ ok, failed int }
	res := make(chan tally, 1)
	go func() {
		runtime.LockOSThread() // stays locked: the thread dies with the goroutine
		var n tally
		defer func() { res <- n }()
		ns, err := netns.GetFromPath(s.NetNSPath)
		if err != nil {
			n.failed = -1
			return
		}
		if err := netns.Set(ns); err != nil {
			n.failed = -1
			return
		}
		for {
			select {
			case <-stop:
				return
			default:
			}
			// Under the 1 s SYN retransmit: a SYN dropped in a window with no rules fails.
			c, err := net.DialTimeout("tcp4", target, 900*time.Millisecond)
			if err != nil {
				n.failed++
				continue
			}
			c.Close()
			n.ok++
		}
	}()
	const flips = 40
	for i := range flips {
		opts := a
		if i%2 == 0 {
			opts = b
		}
		if err := m.Update(ctx, s, opts); err != nil {
			close(stop)
			t.Fatal(err)
		}
	}
	close(stop)
	n := <-res
	t.Logf("%d updates; client connections: %d ok, %d failed", flips, n.ok, n.failed)
	if n.failed != 0 || n.ok == 0 {
		t.Fatalf("connections to an address every rule set allows failed during updates: %d ok, %d failed", n.ok, n.failed)
	}
	if _, err := dial(t, s.NetNSPath, net.JoinHostPort(pubB, up.port), openWait); err != nil {
		t.Fatalf("final rules (a) do not allow %s: %v", pubB, err)
	}
}
