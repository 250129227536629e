package gvisor

import (
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"unsafe"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
	"gvisor.dev/gvisor/pkg/urpc"
)

// A pre-started instance's network, given to its sentry ahead of the restore (issue 18 item 4).
//
// Before the one call that restores a created container, `runsc restore` enters the sandbox's
// network namespace, reads its links, addresses and routes, takes the addresses off the links
// (the sentry's own stack answers for them), opens a packet socket per link and hands all of it
// to the sentry (containerManager.SetNetworkArgs, which stores it for the restore to use;
// runsc/sandbox/network.go). The driver does the same for a pre-started instance at pre-start —
// off the resume's path, the namespace being the instance's own from its create on — so that
// RestoreInto is one containerManager.Restore over the control socket and no process.
//
// What it sends is what runsc sends with the flags the driver gives it (runsc's defaults for
// every network flag: one channel per link, host GSO when the link has it, RX checksum offload,
// a FIFO queue, no PCAP, no NAT scrape). The types mirror runsc/boot's CreateLinksAndRoutesArgs
// (uRPC encodes them as JSON, the files as SCM_RIGHTS); runsc/boot itself is not imported (it
// links the sentry). TestRestoreIntoOverTheSocket compares the sentry's stored copy
// (containerManager.GetNetworkConfig) with what runsc's own restore gives it, field by field.

const (
	ctlSetNetworkArgs = "containerManager.SetNetworkArgs"
	ctlRestore        = "containerManager.Restore"
	ctlNetworkConfig  = "containerManager.GetNetworkConfig"

	qdiscFIFO = 1 // runsc/config QDiscFIFO, runsc's default --qdisc
)

type ipWithPrefix struct {
	Address   net.IP
	PrefixLen int
}

type netRoute struct {
	Destination net.IPNet
	Gateway     net.IP
	MTU         uint32
}

type defaultRoute struct {
	Route netRoute
	Name  string
}

type neighbor struct {
	IP           net.IP
	HardwareAddr net.HardwareAddr
}

type loopbackLink struct {
	Name      string
	Addresses []ipWithPrefix
	Routes    []netRoute
	GVisorGRO bool
}

type fdBasedLink struct {
	Name                 string
	InterfaceIndex       int
	MTU                  int
	Addresses            []ipWithPrefix
	Routes               []netRoute
	GSOMaxSize           uint32
	GVisorGSOEnabled     bool
	GVisorGRO            bool
	TXChecksumOffload    bool
	RXChecksumOffload    bool
	LinkAddress          net.HardwareAddr
	QDisc                int
	TBFRate              uint64
	TBFBurst             uint32
	Neighbors            []neighbor
	NumChannels          int
	ProcessorsPerChannel int
	IsPacket             []bool
	PreConfigured        bool
}

// linksAndRoutesArgs is runsc/boot CreateLinksAndRoutesArgs.
type linksAndRoutesArgs struct {
	urpc.FilePayload
	LoopbackLinks           []loopbackLink
	FDBasedLinks            []fdBasedLink
	Defaultv4Gateway        defaultRoute
	Defaultv6Gateway        defaultRoute
	PCAP                    bool
	LogPackets              bool
	NATBlob                 bool
	PauseExternalNetworking bool
	AllowConnectedOnSave    bool
	IsRestore               bool
}

// restoreOpts is runsc/boot RestoreOpts: the files are the state file and, with HavePagesFile,
// the pages' metadata and the pages.
type restoreOpts struct {
	urpc.FilePayload
	HavePagesFile      bool
	HaveDeviceFile     bool
	Background         bool
	UseCheckpointGofer bool `json:"use_checkpoint_gofer"`
}

// gvisorGSOMaxSize is pkg/tcpip/stack GVisorGSOMaxSize: the sentry segments itself when the
// host link has no GSO (runsc's --software-gso, on by default).
const gvisorGSOMaxSize = 1 << 16

// scrapeNetwork reads the links of the network namespace at nsPath, takes the addresses off its
// non-loopback links and opens a packet socket on each: runsc's setupNetwork for --network=sandbox
// with its default flags. It runs on a thread of its own that enters the namespace.
func scrapeNetwork(nsPath string) (*linksAndRoutesArgs, error) {
	type result struct {
		args *linksAndRoutesArgs
		err  error
	}
	done := make(chan result, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with the goroutine, out of the namespace
		args, err := scrapeIn(nsPath)
		done <- result{args, err}
	}()
	r := <-done
	return r.args, r.err
}

func scrapeIn(nsPath string) (*linksAndRoutesArgs, error) {
	ns, err := netns.GetFromPath(nsPath)
	if err != nil {
		return nil, err
	}
	defer ns.Close()
	if err := netns.Set(ns); err != nil {
		return nil, fmt.Errorf("enter %s: %w", nsPath, err)
	}
	// Never the host's namespace (runsc refuses it too): its addresses would be taken away.
	// As runsc tells it: this file is only in the initial namespace's /proc/sys/net.
	switch err := unix.Access("/proc/sys/net/core/dev_weight", unix.F_OK); {
	case err == nil:
		return nil, fmt.Errorf("%s is the host's network namespace", nsPath)
	case !errors.Is(err, unix.ENOENT):
		return nil, fmt.Errorf("is %s the host's network namespace: %w", nsPath, err)
	}
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return nil, err
	}
	defer h.Close()
	links, err := h.LinkList()
	if err != nil {
		return nil, err
	}
	args := &linksAndRoutesArgs{IsRestore: true}
	ok := false
	defer func() {
		if !ok {
			for _, f := range args.FilePayload.Files {
				f.Close()
			}
		}
	}()
	for _, l := range links {
		a := l.Attrs()
		if a.Flags&net.FlagUp == 0 {
			continue
		}
		addrs, err := h.AddrList(l, netlink.FAMILY_ALL)
		if err != nil {
			return nil, fmt.Errorf("addresses of %s: %w", a.Name, err)
		}
		routes, defv4, defv6, err := linkRoutes(h, l)
		if err != nil {
			return nil, err
		}
		if a.Flags&net.FlagLoopback != 0 {
			lo := loopbackLink{Name: a.Name}
			for _, ad := range addrs {
				lo.Addresses = append(lo.Addresses, ipWithPrefix{Address: ad.IP, PrefixLen: prefixLen(ad.IPNet)})
				dst := *ad.IPNet
				dst.IP = dst.IP.Mask(dst.Mask)
				lo.Routes = append(lo.Routes, netRoute{Destination: dst})
			}
			lo.Routes = append(lo.Routes, routes...)
			args.LoopbackLinks = append(args.LoopbackLinks, lo)
			continue
		}
		if len(addrs) == 0 {
			continue // runsc skips a link without addresses
		}
		neighs, err := h.NeighList(a.Index, 0)
		if err != nil {
			return nil, fmt.Errorf("neighbours of %s: %w", a.Name, err)
		}
		link := fdBasedLink{
			Name: a.Name, MTU: a.MTU, Routes: routes, RXChecksumOffload: true, LinkAddress: a.HardwareAddr,
			QDisc: qdiscFIFO, NumChannels: 1,
		}
		for _, n := range neighs {
			if n.State == netlink.NUD_PERMANENT {
				link.Neighbors = append(link.Neighbors, neighbor{IP: n.IP, HardwareAddr: n.HardwareAddr})
			}
		}
		for _, ad := range addrs {
			link.Addresses = append(link.Addresses, ipWithPrefix{Address: ad.IP, PrefixLen: prefixLen(ad.IPNet)})
		}
		if defv4 != nil {
			if !emptyRoute(args.Defaultv4Gateway.Route) {
				return nil, fmt.Errorf("more than one default IPv4 route (%s)", a.Name)
			}
			args.Defaultv4Gateway = defaultRoute{Route: *defv4, Name: a.Name}
		}
		if defv6 != nil {
			if !emptyRoute(args.Defaultv6Gateway.Route) {
				return nil, fmt.Errorf("more than one default IPv6 route (%s)", a.Name)
			}
			args.Defaultv6Gateway = defaultRoute{Route: *defv6, Name: a.Name}
		}
		// The sentry's stack answers for the addresses from now on, not the namespace's.
		for _, ad := range addrs {
			if err := h.AddrDel(l, &ad); err != nil && !errors.Is(err, unix.EADDRNOTAVAIL) {
				return nil, fmt.Errorf("take %s off %s: %w", ad.IPNet, a.Name, err)
			}
		}
		f, gso, err := packetSocket(a.Name, a.Index)
		if err != nil {
			return nil, err
		}
		args.FilePayload.Files = append(args.FilePayload.Files, f)
		if gso {
			link.GSOMaxSize = a.GSOMaxSize
		} else {
			link.GSOMaxSize, link.GVisorGSOEnabled = gvisorGSOMaxSize, true
		}
		args.FDBasedLinks = append(args.FDBasedLinks, link)
	}
	ok = true
	return args, nil
}

// linkRoutes is runsc's routesForIface: the main table's routes through l, a default route
// (no destination) returned apart.
func linkRoutes(h *netlink.Handle, l netlink.Link) (routes []netRoute, defv4, defv6 *netRoute, err error) {
	rs, err := h.RouteList(l, netlink.FAMILY_ALL)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("routes of %s: %w", l.Attrs().Name, err)
	}
	for _, r := range rs {
		mtu := uint32(r.MTU)
		if r.Dst == nil {
			switch len(r.Gw) {
			case net.IPv4len:
				defv4 = &netRoute{Destination: net.IPNet{IP: net.IPv4zero, Mask: net.IPMask(net.IPv4zero)}, Gateway: r.Gw, MTU: mtu}
			case net.IPv6len:
				defv6 = &netRoute{Destination: net.IPNet{IP: net.IPv6zero, Mask: net.IPMask(net.IPv6zero)}, Gateway: r.Gw, MTU: mtu}
			default:
				return nil, nil, nil, fmt.Errorf("default route of %s without a gateway", l.Attrs().Name)
			}
			continue
		}
		dst := *r.Dst
		dst.IP = dst.IP.Mask(dst.Mask)
		routes = append(routes, netRoute{Destination: dst, Gateway: r.Gw, MTU: mtu})
	}
	return routes, defv4, defv6, nil
}

func emptyRoute(r netRoute) bool {
	return r.Destination.IP == nil && r.Destination.Mask == nil && r.Gateway == nil
}

func prefixLen(n *net.IPNet) int {
	ones, _ := n.Mask.Size()
	return ones
}

// packetSocket opens the link's packet socket as runsc's createSocket does: bound to every
// protocol on the link, with virtio-net headers when the link offloads segmentation, and 4 MiB
// buffers.
func packetSocket(name string, index int) (*os.File, bool, error) {
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, false, fmt.Errorf("packet socket for %s: %w", name, err)
	}
	f := os.NewFile(uintptr(fd), "raw-device-fd")
	if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: index}); err != nil {
		f.Close()
		return nil, false, fmt.Errorf("bind packet socket to %s: %w", name, err)
	}
	gso, err := linkGSO(fd, name)
	if err != nil {
		f.Close()
		return nil, false, fmt.Errorf("GSO of %s: %w", name, err)
	}
	if gso {
		if err := unix.SetsockoptInt(fd, unix.SOL_PACKET, unix.PACKET_VNET_HDR, 1); err != nil {
			f.Close()
			return nil, false, fmt.Errorf("PACKET_VNET_HDR on %s: %w", name, err)
		}
	}
	const bufSize = 4 << 20
	if unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, bufSize) != nil {
		_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUF, bufSize)
	}
	if unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_SNDBUFFORCE, bufSize) != nil {
		_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_SNDBUF, bufSize)
	}
	return f, gso, nil
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// linkGSO asks the link whether it offloads generic segmentation (SIOCETHTOOL ETHTOOL_GGSO).
func linkGSO(fd int, name string) (bool, error) {
	const ethtoolGGSO = 0x23
	val := struct{ cmd, data uint32 }{cmd: ethtoolGGSO}
	var ifr struct {
		name [unix.IFNAMSIZ]byte
		data unsafe.Pointer
		_    [16]byte // the rest of struct ifreq
	}
	copy(ifr.name[:], name)
	ifr.data = unsafe.Pointer(&val)
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.SIOCETHTOOL, uintptr(unsafe.Pointer(&ifr))); errno != 0 {
		return false, errno
	}
	return val.data != 0, nil
}
