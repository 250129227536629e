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
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// Tests use their own prefix, table and CIDR so they never meet a real daemon's slots.
const (
	testPrefix = "emt"
	testTable  = "ember_test"
)

var testCIDR = netip.MustParsePrefix("10.211.0.0/16")

func testConfig(pool int) Config {
	return Config{CIDR: testCIDR, NamePrefix: testPrefix, Table: testTable, PoolSize: pool}
}

// newTestManager needs root and nft, and removes every slot, netns and the test table when the
// test ends, whatever happened.
func newTestManager(t testing.TB, pool int) *Manager {
	t.Helper()
	testutil.RequireRoot(t)
	_, err := exec.LookPath("nft")
	testutil.Need(t, err == nil, "nft not installed (apt-get install nftables)")
	t.Cleanup(func() { wipe(t) })
	m, err := New(testConfig(pool))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := m.Close(context.Background()); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return m
}

// wipe removes everything a test may have left with the test prefix, and the test table.
func wipe(t testing.TB) {
	t.Helper()
	m, err := New(testConfig(0))
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Reconcile(context.Background(), nil); err != nil {
		t.Errorf("wipe: %v", err)
	}
	_ = exec.Command("nft", "delete", "table", "inet", testTable).Run()
}

func mustAcquire(t testing.TB, m *Manager, opts SlotOptions) *Slot {
	t.Helper()
	s, err := m.Acquire(context.Background(), opts)
	if err != nil {
		t.Fatalf("Acquire: %v", err)
	}
	t.Cleanup(func() {
		if err := m.Release(context.Background(), s); err != nil {
			t.Errorf("Release(%d): %v", s.Index, err)
		}
	})
	return s
}

// inNS runs fn on an OS thread inside the netns at path. Sockets fn creates stay in it.
func inNS(t testing.TB, path string, fn func()) {
	t.Helper()
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			errc <- err
			return
		}
		defer orig.Close()
		target, err := netns.GetFromPath(path)
		if err != nil {
			errc <- err
			return
		}
		defer target.Close()
		if err := netns.Set(target); err != nil {
			errc <- err
			return
		}
		fn()
		if err := netns.Set(orig); err != nil {
			errc <- err // thread stays locked and dies with the goroutine
			return
		}
		runtime.UnlockOSThread()
		errc <- nil
	}()
	if err := <-errc; err != nil {
		t.Fatalf("in netns %s: %v", path, err)
	}
}

// serve listens on addr (in the netns at nsPath, or the host if "") and answers every
// connection with the remote address it sees.
func serve(t testing.TB, nsPath, addr string) string {
	t.Helper()
	var ln net.Listener
	var err error
	listen := func() { ln, err = net.Listen("tcp4", addr) }
	if nsPath == "" {
		listen()
	} else {
		inNS(t, nsPath, listen)
	}
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
			fmt.Fprintln(c, c.RemoteAddr().String())
			c.Close()
		}
	}()
	return ln.Addr().String()
}

// Dial timeouts: a blocked connection is never answered, so a short wait proves it; a
// reachable one gets a few seconds, enough for one SYN retransmission (a first packet on a
// fresh veth was once seen lost under load).
const (
	blockedWait = 500 * time.Millisecond
	openWait    = 3 * time.Second
)

// dial connects to addr from the netns at nsPath (host if "") within timeout and returns the
// remote address the server saw, or an error (blocked connections time out or are refused).
func dial(t testing.TB, nsPath, addr string, timeout time.Duration) (string, error) {
	t.Helper()
	var line string
	var err error
	do := func() {
		var c net.Conn
		c, err = net.DialTimeout("tcp4", addr, timeout)
		if err != nil {
			return
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(2 * time.Second))
		line, err = bufio.NewReader(c).ReadString('\n')
	}
	if nsPath == "" {
		do()
	} else {
		inNS(t, nsPath, do)
	}
	return strings.TrimSpace(line), err
}

func port(t testing.TB, hostport string) string {
	t.Helper()
	_, p, err := net.SplitHostPort(hostport)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func at(a netip.Addr, p string) string { return net.JoinHostPort(a.String(), p) }

func ipNetns() string {
	out, _ := exec.Command("ip", "netns", "list").Output()
	return string(out)
}

func nsListed(name string) bool {
	for _, l := range strings.Split(ipNetns(), "\n") {
		if f := strings.Fields(l); len(f) > 0 && f[0] == name {
			return true
		}
	}
	return false
}

func TestNewValidates(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
	}{
		{"ipv6 cidr", Config{CIDR: netip.MustParsePrefix("fd00::/64")}},
		{"cidr too small", Config{CIDR: netip.MustParsePrefix("10.0.0.0/31")}},
		{"prefix with dash", Config{NamePrefix: "em-b"}},
		{"prefix too long for 15-char names", Config{NamePrefix: "abcdefghijk", CIDR: netip.MustParsePrefix("10.0.0.0/16")}},
		{"table with space", Config{Table: "a b"}},
		{"negative pool", Config{PoolSize: -1}},
		{"pool larger than cidr", Config{CIDR: netip.MustParsePrefix("10.0.0.0/29"), PoolSize: 3}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := New(tc.cfg)
			if !errors.Is(err, errdefs.ErrInvalid) {
				t.Fatalf("New(%+v) = %v, want ErrInvalid", tc.cfg, err)
			}
		})
	}
}

func TestSlotAddressing(t *testing.T) {
	m, err := New(Config{})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		index               int
		ns, veth            string
		subnet, host, guest string
	}{
		{0, "emb-0", "emb0h", "10.11.0.0/30", "10.11.0.1", "10.11.0.2"},
		{1, "emb-1", "emb1h", "10.11.0.4/30", "10.11.0.5", "10.11.0.6"},
		{64, "emb-64", "emb64h", "10.11.1.0/30", "10.11.1.1", "10.11.1.2"},
		{16383, "emb-16383", "emb16383h", "10.11.255.252/30", "10.11.255.253", "10.11.255.254"},
	} {
		t.Run(fmt.Sprint(tc.index), func(t *testing.T) {
			s := m.slotFor(tc.index)
			got := []string{s.NetNS, s.NetNSPath, s.HostVeth, s.Subnet.String(), s.HostIP.String(), s.GuestIP.String()}
			want := []string{tc.ns, "/run/netns/" + tc.ns, tc.veth, tc.subnet, tc.host, tc.guest}
			if !slices.Equal(got, want) {
				t.Fatalf("got %v, want %v", got, want)
			}
		})
	}
	if m.MaxSlots() != 16384 {
		t.Fatalf("MaxSlots = %d", m.MaxSlots())
	}
}

func TestRuleset(t *testing.T) {
	m, err := New(Config{NamePrefix: "sbx", Table: "mine", CIDR: netip.MustParsePrefix("10.50.0.0/20"), InternetGroup: 77})
	if err != nil {
		t.Fatal(err)
	}
	rs := m.Ruleset()
	for _, want := range []string{
		"table inet mine {}\ndelete table inet mine\ntable inet mine {", // create-or-replace, atomically
		`iifname "sbx*" fib saddr . iif oif missing drop`,
		`iifname "sbx*" ct state established,related accept`,
		`iifname "sbx*" oifname "sbx*" drop`,
		`iifname "sbx*" iifname vmap @slots`,
		"iifname \"sbx*\" iifname vmap @slots\n\t\tiifname \"sbx*\" drop", // no rules, no egress
		`ip saddr 10.50.0.0/20 oifname != "sbx*" masquerade`,
		"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16", "100.64.0.0/10", "224.0.0.0/4",
		"fc00::/7", "fe80::/10",
	} {
		if !strings.Contains(rs, want) {
			t.Errorf("ruleset lacks %q:\n%s", want, rs)
		}
	}
	if n := strings.Count(rs, "table "); n != 3 {
		t.Errorf("ruleset names %d tables, want only its own (3 mentions)", n)
	}
}

func TestInitRefusesPrefixOfForeignInterface(t *testing.T) {
	m, err := New(Config{NamePrefix: "lo"}) // "lo" exists everywhere and is not ours
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Init(context.Background()); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("Init = %v, want ErrInvalid", err)
	}
}

func TestAcquireCreatesSlot(t *testing.T) {
	m := newTestManager(t, 0)
	s := mustAcquire(t, m, SlotOptions{})
	if s.Index != 0 || s.GuestIP.String() != "10.211.0.2" || s.HostIP.String() != "10.211.0.1" {
		t.Fatalf("slot = %+v", s)
	}
	if !nsListed(s.NetNS) {
		t.Fatalf("ip netns list does not show %s:\n%s", s.NetNS, ipNetns())
	}
	link, err := netlink.LinkByName(s.HostVeth)
	if err != nil {
		t.Fatalf("host veth: %v", err)
	}
	if link.Attrs().Flags&net.FlagUp == 0 {
		t.Errorf("host veth is down")
	}
	addrs, _ := netlink.AddrList(link, netlink.FAMILY_ALL)
	if len(addrs) != 1 || addrs[0].IPNet.String() != "10.211.0.1/30" {
		t.Errorf("host veth addresses = %v, want only 10.211.0.1/30", addrs)
	}
	inNS(t, s.NetNSPath, func() {
		g, err := netlink.LinkByName(GuestIfName)
		if err != nil {
			t.Errorf("guest eth0: %v", err)
			return
		}
		addrs, _ := netlink.AddrList(g, netlink.FAMILY_ALL)
		if len(addrs) != 1 || addrs[0].IPNet.String() != "10.211.0.2/30" {
			t.Errorf("guest addresses = %v, want only 10.211.0.2/30", addrs)
		}
		routes, _ := netlink.RouteList(g, netlink.FAMILY_V4)
		var def bool
		for _, r := range routes {
			if (r.Dst == nil || r.Dst.String() == "0.0.0.0/0") && r.Gw.String() == "10.211.0.1" {
				def = true
			}
		}
		if !def {
			t.Errorf("no default route via 10.211.0.1 in %v", routes)
		}
	})
}

func TestFirewall(t *testing.T) {
	m := newTestManager(t, 0)
	ctx := context.Background()
	if err := m.Init(ctx); err != nil {
		t.Fatal(err)
	}
	a := mustAcquire(t, m, SlotOptions{})
	b := mustAcquire(t, m, SlotOptions{})
	inet := mustAcquire(t, m, SlotOptions{AllowInternet: true})
	hostPort := port(t, serve(t, "", "0.0.0.0:0"))
	aPort := port(t, serve(t, a.NetNSPath, at(a.GuestIP, "0")))
	bPort := port(t, serve(t, b.NetNSPath, at(b.GuestIP, "0")))

	type check struct {
		name     string
		from, to string
		open     bool // reachable with our table in place
	}
	checks := []check{
		{"host to slot guest ip", "", at(a.GuestIP, aPort), true},
		{"slot to its host veth ip", a.NetNSPath, at(a.HostIP, hostPort), false},
		{"slot to another slot's host veth ip", a.NetNSPath, at(b.HostIP, hostPort), false},
		{"slot to another slot", a.NetNSPath, at(b.GuestIP, bPort), false},
		{"internet slot to another slot", inet.NetNSPath, at(b.GuestIP, bPort), false},
		{"internet slot to host", inet.NetNSPath, at(inet.HostIP, hostPort), false},
	}
	run := func(t *testing.T, firewalled bool) {
		for _, c := range checks {
			t.Run(c.name, func(t *testing.T) {
				want := c.open || !firewalled
				wait := blockedWait
				if want {
					wait = openWait
				}
				_, err := dial(t, c.from, c.to, wait)
				if (err == nil) != want {
					t.Fatalf("dial %s: err = %v, want reachable = %v", c.to, err, want)
				}
			})
		}
	}
	t.Run("with table", func(t *testing.T) { run(t, true) })
	// Control: the same connections work without our table, so it is the firewall that blocks.
	if out, err := exec.Command("nft", "delete", "table", "inet", testTable).CombinedOutput(); err != nil {
		t.Fatalf("delete table: %v: %s", err, out)
	}
	t.Run("without table", func(t *testing.T) { run(t, false) })
	if err := m.Init(ctx); err != nil {
		t.Fatal(err)
	}
	if err := m.Init(ctx); err != nil { // idempotent
		t.Fatal(err)
	}
	t.Run("after Init again", func(t *testing.T) { run(t, true) })
}

// TestEgress plays "the internet" with a namespace of the test's own behind a veth whose host
// end is outside the slot prefix, holding a public test address (203.0.113.1) and a denied one
// (198.18.0.1).
func TestEgress(t *testing.T) {
	m := newTestManager(t, 0)
	if err := m.Init(context.Background()); err != nil {
		t.Fatal(err)
	}
	outside := makeOutside(t)
	p := port(t, serve(t, outside, "0.0.0.0:0"))
	public, denied := "203.0.113.1:"+p, "198.18.0.1:"+p
	if _, err := dial(t, "", denied, openWait); err != nil {
		t.Fatalf("host cannot reach %s, the test network is broken: %v", denied, err)
	}
	off := mustAcquire(t, m, SlotOptions{})
	on := mustAcquire(t, m, SlotOptions{AllowInternet: true})
	if !on.Options.AllowInternet || off.Options.AllowInternet {
		t.Fatalf("AllowInternet not recorded: on=%v off=%v", on.Options.AllowInternet, off.Options.AllowInternet)
	}

	t.Run("internet slot reaches public address, masqueraded", func(t *testing.T) {
		seen, err := dial(t, on.NetNSPath, public, openWait)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(seen, "203.0.113.2:") {
			t.Fatalf("server saw %s, want the host's address 203.0.113.2 (masquerade)", seen)
		}
	})
	t.Run("internet slot denied private range", func(t *testing.T) {
		if _, err := dial(t, on.NetNSPath, denied, blockedWait); err == nil {
			t.Fatal("reached a denied range")
		}
	})
	t.Run("slot without internet blocked", func(t *testing.T) {
		if _, err := dial(t, off.NetNSPath, public, blockedWait); err == nil {
			t.Fatal("slot without internet reached a public address")
		}
	})
	t.Run("SetAllowInternet toggles", func(t *testing.T) {
		if err := m.SetAllowInternet(off, true); err != nil {
			t.Fatal(err)
		}
		if _, err := dial(t, off.NetNSPath, public, openWait); err != nil {
			t.Fatalf("after allow: %v", err)
		}
		if err := m.SetAllowInternet(off, false); err != nil {
			t.Fatal(err)
		}
		if _, err := dial(t, off.NetNSPath, public, blockedWait); err == nil {
			t.Fatal("after deny: still reachable")
		}
	})
}

// makeOutside creates netns "emtest-outside" linked to the host by veth "xemout0"
// (203.0.113.2/30 host side, 203.0.113.1/30 + 198.18.0.1/30 inside) and returns its path.
func makeOutside(t *testing.T) string {
	t.Helper()
	const name, veth = "emtest-outside", "xemout0"
	path := NetNSDir + "/" + name
	cleanup := func() {
		if l, err := netlink.LinkByName(veth); err == nil {
			netlink.LinkDel(l)
		}
		_, _ = removeNetNS(path)
	}
	cleanup()
	t.Cleanup(cleanup)
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
			if err := hostHandle.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: veth, Flags: net.FlagUp}, PeerName: "eth0", PeerNamespace: netlink.NsFd(int(ns))}); err != nil {
				return err
			}
			eth, err := netlink.LinkByName("eth0")
			if err != nil {
				return err
			}
			for _, a := range []string{"203.0.113.1/30", "198.18.0.1/30"} {
				addr, _ := netlink.ParseAddr(a)
				if err := netlink.AddrAdd(eth, addr); err != nil {
					return err
				}
			}
			return netlink.LinkSetUp(eth)
		}()
		if rerr := netns.Set(orig); rerr == nil {
			runtime.UnlockOSThread() // else the thread stays locked and is discarded
		} else if err == nil {
			err = rerr
		}
		errc <- err
	}()
	if err := <-errc; err != nil {
		t.Fatalf("make outside netns: %v", err)
	}
	l, err := netlink.LinkByName(veth)
	if err != nil {
		t.Fatal(err)
	}
	addr, _ := netlink.ParseAddr("203.0.113.2/30")
	if err := netlink.AddrAdd(l, addr); err != nil {
		t.Fatal(err)
	}
	_, dst, _ := net.ParseCIDR("198.18.0.0/30")
	if err := netlink.RouteAdd(&netlink.Route{LinkIndex: l.Attrs().Index, Dst: dst, Gw: net.ParseIP("203.0.113.1")}); err != nil {
		t.Fatal(err)
	}
	return path
}

// hostHandle is a netlink handle opened in the host namespace at package init, used from threads that
// have left it.
var hostHandle = func() *netlink.Handle {
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return nil
	}
	return h
}()

func TestReleaseReusesIndex(t *testing.T) {
	m := newTestManager(t, 0)
	ctx := context.Background()
	var slots []*Slot
	for range 3 {
		slots = append(slots, mustAcquire(t, m, SlotOptions{}))
	}
	mid := slots[1]
	if err := m.Release(ctx, mid); err != nil {
		t.Fatal(err)
	}
	if nsListed(mid.NetNS) {
		t.Errorf("netns %s still listed after Release", mid.NetNS)
	}
	if _, err := netlink.LinkByName(mid.HostVeth); err == nil {
		t.Errorf("host veth %s still exists after Release", mid.HostVeth)
	}
	again := mustAcquire(t, m, SlotOptions{})
	if again.Index != mid.Index || again.GuestIP != mid.GuestIP {
		t.Fatalf("Acquire after Release got index %d (%s), want the freed %d", again.Index, again.GuestIP, mid.Index)
	}
	// A stale second Release of the old slot must not destroy the new holder of the index.
	if err := m.Release(ctx, mid); err != nil {
		t.Fatal(err)
	}
	if !nsListed(again.NetNS) {
		t.Fatalf("double Release of a stale slot deleted the index's new netns")
	}
	if _, err := dial(t, "", at(again.GuestIP, "1"), openWait); err == nil || !errors.Is(err, unix.ECONNREFUSED) {
		t.Fatalf("new slot should answer (RST) on a closed port, got %v", err)
	}
}

// Indexes belong to the manager: something left at a free index (by a crashed daemon, before
// Reconcile ran) is replaced, not an error.
func TestAcquireReplacesLeftover(t *testing.T) {
	for _, tc := range []struct {
		name  string
		leave func(t *testing.T)
	}{
		{"whole slot", func(t *testing.T) {
			other, err := New(testConfig(0))
			if err != nil {
				t.Fatal(err)
			}
			if _, err := other.Acquire(context.Background(), SlotOptions{}); err != nil {
				t.Fatal(err)
			}
		}},
		{"empty netns file", func(t *testing.T) {
			if err := os.WriteFile(NetNSDir+"/"+testPrefix+"-0", nil, 0o444); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := newTestManager(t, 0)
			tc.leave(t)
			s := mustAcquire(t, m, SlotOptions{})
			if s.Index != 0 || !isNetNSMount(s.NetNSPath) {
				t.Fatalf("got slot %d, mounted=%v; want a fresh slot 0", s.Index, isNetNSMount(s.NetNSPath))
			}
			if _, err := dial(t, "", at(s.GuestIP, "1"), openWait); !errors.Is(err, unix.ECONNREFUSED) {
				t.Fatalf("replaced slot does not answer: %v", err)
			}
		})
	}
}

func TestExhausted(t *testing.T) {
	newTestManager(t, 0) // root check and clean-up
	cfg := testConfig(0)
	cfg.CIDR = netip.MustParsePrefix("10.211.0.0/29") // two slots
	m, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close(context.Background()) })
	a := mustAcquire(t, m, SlotOptions{})
	mustAcquire(t, m, SlotOptions{})
	if _, err := m.Acquire(context.Background(), SlotOptions{}); !errors.Is(err, errdefs.ErrExhausted) {
		t.Fatalf("third Acquire of a /29: %v, want ErrExhausted", err)
	}
	if err := m.Release(context.Background(), a); err != nil {
		t.Fatal(err)
	}
	mustAcquire(t, m, SlotOptions{})
}

func TestAdoptAndReconcile(t *testing.T) {
	crashed := newTestManager(t, 0) // plays the daemon that died
	ctx := context.Background()
	for range 4 {
		if _, err := crashed.Acquire(ctx, SlotOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	m, err := New(testConfig(0))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close(ctx) })

	s1, err := m.Adopt(1, SlotOptions{AllowInternet: true})
	if err != nil {
		t.Fatalf("Adopt(1): %v", err)
	}
	if !s1.Options.AllowInternet || s1.GuestIP.String() != "10.211.0.6" {
		t.Fatalf("adopted slot = %+v", s1)
	}
	if _, err := m.Adopt(1, SlotOptions{}); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("Adopt twice: %v, want ErrConflict", err)
	}
	if _, err := m.Adopt(7, SlotOptions{}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("Adopt of a missing slot: %v, want ErrNotFound", err)
	}
	if err := m.Reconcile(ctx, []int{3}); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		index int
		kept  bool
	}{{0, false}, {1, true}, {2, false}, {3, true}} {
		s := m.slotFor(tc.index)
		_, linkErr := netlink.LinkByName(s.HostVeth)
		if nsListed(s.NetNS) != tc.kept || (linkErr == nil) != tc.kept {
			t.Errorf("slot %d: netns listed=%v veth=%v, want kept=%v", tc.index, nsListed(s.NetNS), linkErr == nil, tc.kept)
		}
	}
	// Freed leftovers are reused lowest first; the kept-but-not-adopted 3 is created over
	// only after 0 and 2.
	got := mustAcquire(t, m, SlotOptions{})
	if got.Index != 0 {
		t.Fatalf("Acquire after Reconcile got %d, want 0", got.Index)
	}
	if err := m.Release(ctx, s1); err != nil {
		t.Fatal(err)
	}
	if nsListed(s1.NetNS) {
		t.Fatalf("released adopted slot still listed")
	}
}

func TestConcurrentAcquire(t *testing.T) {
	m := newTestManager(t, 0)
	ctx := context.Background()
	const n = 16
	slots := make([]*Slot, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	start := time.Now()
	for i := range n {
		wg.Go(func() { slots[i], errs[i] = m.Acquire(ctx, SlotOptions{AllowInternet: i%2 == 0}) })
	}
	wg.Wait()
	t.Logf("%d concurrent Acquire: %v", n, time.Since(start))
	seen := map[int]bool{}
	ips := map[netip.Addr]bool{}
	for i, s := range slots {
		if errs[i] != nil {
			t.Fatalf("Acquire %d: %v", i, errs[i])
		}
		if seen[s.Index] || ips[s.GuestIP] || ips[s.HostIP] {
			t.Fatalf("duplicate slot %+v", s)
		}
		seen[s.Index], ips[s.GuestIP], ips[s.HostIP] = true, true, true
		if !isNetNSMount(s.NetNSPath) {
			t.Fatalf("slot %d netns missing", s.Index)
		}
	}
	for i := range n {
		if !seen[i] {
			t.Fatalf("indexes not 0..%d: %v", n-1, seen)
		}
	}
	start = time.Now()
	for _, s := range slots {
		wg.Go(func() {
			if err := m.Release(ctx, s); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	t.Logf("%d concurrent Release: %v", n, time.Since(start))
	if out := ipNetns(); strings.Contains(out, testPrefix+"-") {
		t.Fatalf("netns left after Release:\n%s", out)
	}
}

func TestPool(t *testing.T) {
	ctx := context.Background()
	measure := func(t *testing.T, m *Manager, rounds int) time.Duration {
		var d []time.Duration
		for range rounds {
			if m.Config().PoolSize > 0 {
				waitPool(t, m)
			}
			start := time.Now()
			s, err := m.Acquire(ctx, SlotOptions{})
			d = append(d, time.Since(start))
			if err != nil {
				t.Fatal(err)
			}
			if !isNetNSMount(s.NetNSPath) {
				t.Fatalf("pooled slot %d has no netns", s.Index)
			}
			if err := m.Release(ctx, s); err != nil {
				t.Fatal(err)
			}
		}
		slices.Sort(d)
		return d[len(d)/2]
	}
	const rounds = 15
	cold := measure(t, newTestManager(t, 0), rounds)
	pm := newTestManager(t, 4)
	if err := pm.Reconcile(ctx, nil); err != nil { // starts the pool
		t.Fatal(err)
	}
	warm := measure(t, pm, rounds)
	t.Logf("Acquire median over %d: without pool %v, from pool %v", rounds, cold, warm)

	if err := pm.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if out := ipNetns(); strings.Contains(out, testPrefix+"-") {
		t.Fatalf("Close left pooled netns:\n%s", out)
	}
	if _, err := pm.Acquire(ctx, SlotOptions{}); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("Acquire after Close: %v, want ErrUnavailable", err)
	}
}

func waitPool(t testing.TB, m *Manager) {
	t.Helper()
	testutil.EventuallyOr(t, 10*time.Second, func() bool { return m.PoolLen() >= m.Config().PoolSize }, func() string {
		return fmt.Sprintf("pool has %d of %d slots", m.PoolLen(), m.Config().PoolSize)
	})
}

// BenchmarkAcquireRelease runs Acquire then Release back to back and reports each part. The
// pool's gain shows in acquire-ns/op as long as it keeps up; Release waits for the kernel to
// tear the namespace down.
func BenchmarkAcquireRelease(b *testing.B) {
	ctx := context.Background()
	for _, pool := range []int{0, 8} {
		b.Run(fmt.Sprintf("pool=%d", pool), func(b *testing.B) {
			m := newTestManager(b, pool)
			if err := m.Reconcile(ctx, nil); err != nil {
				b.Fatal(err)
			}
			if pool > 0 {
				waitPool(b, m)
			}
			var acquire, release time.Duration
			n := 0
			for b.Loop() {
				t0 := time.Now()
				s, err := m.Acquire(ctx, SlotOptions{})
				t1 := time.Now()
				if err != nil {
					b.Fatal(err)
				}
				if err := m.Release(ctx, s); err != nil {
					b.Fatal(err)
				}
				acquire += t1.Sub(t0)
				release += time.Since(t1)
				n++
			}
			b.ReportMetric(float64(acquire.Nanoseconds())/float64(n), "acquire-ns/op")
			b.ReportMetric(float64(release.Nanoseconds())/float64(n), "release-ns/op")
		})
	}
}

// With HostMark set, only host sockets that carry the mark reach a slot: the daemon's (it dials
// with MarkedDialer); a local process without it, root or not, is cut off (issue 8 finding 5:
// nothing but the daemon may call envd in a pooled or template instance).
func TestOnlyMarkedHostSocketsReachSlots(t *testing.T) {
	cfg := testConfig(0)
	cfg.HostMark = 0x454d5401
	m, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	testutil.RequireRoot(t)
	t.Cleanup(func() { wipe(t) })
	if err := m.Init(ctx); err != nil {
		t.Fatal(err)
	}
	a := mustAcquire(t, m, SlotOptions{})
	aPort := port(t, serve(t, a.NetNSPath, at(a.GuestIP, "0")))
	if _, err := dial(t, "", at(a.GuestIP, aPort), blockedWait); err == nil {
		t.Fatal("an unmarked host socket reached the slot")
	}
	c, err := MarkedDialer(cfg.HostMark).Dial("tcp4", at(a.GuestIP, aPort))
	if err != nil {
		t.Fatalf("the daemon's marked socket did not reach the slot: %v", err)
	}
	c.Close()
	other := MarkedDialer(cfg.HostMark + 1)
	other.Timeout = blockedWait
	if _, err := other.Dial("tcp4", at(a.GuestIP, aPort)); err == nil {
		t.Fatal("a socket with another mark reached the slot")
	}
}
