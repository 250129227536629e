package network

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// linkOps does host-namespace link work through one netlink socket opened in the host
// namespace at New, so it keeps working from any OS thread; hostNS is that namespace, which
// threads that made a slot's namespace return to.
type linkOps struct {
	h      *netlink.Handle
	hostNS netns.NsHandle
}

func newLinkOps() (linkOps, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	ns, err := netns.Get()
	if err != nil {
		return linkOps{}, fmt.Errorf("open host netns: %w", err)
	}
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		ns.Close()
		return linkOps{}, fmt.Errorf("open netlink socket: %w", err)
	}
	return linkOps{h: h, hostNS: ns}, nil
}

func (l linkOps) exists(name string) bool {
	_, err := l.h.LinkByName(name)
	return err == nil
}

func (l linkOps) names() ([]string, error) { return linkNames(l.h.LinkList) }

// linkNames lists the names of the links list returns; a dump that a link change on the host
// interrupted is made again (retryDump).
func linkNames(list func() ([]netlink.Link, error)) ([]string, error) {
	links, err := retryDump(list)
	if err != nil {
		return nil, fmt.Errorf("list links: %w", err)
	}
	out := make([]string, 0, len(links))
	for _, k := range links {
		out = append(out, k.Attrs().Name)
	}
	return out, nil
}

// del deletes a link by name; a missing link is not an error.
func (l linkOps) del(name string) error {
	link, err := l.h.LinkByName(name)
	if err != nil {
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) {
			return nil
		}
		return fmt.Errorf("look up %s: %w", name, err)
	}
	if err := l.h.LinkDel(link); err != nil && !errors.Is(err, unix.ENODEV) {
		return fmt.Errorf("delete %s: %w", name, err)
	}
	return nil
}

var netnsDirOnce sync.Once
var netnsDirErr error

// prepareNetNSDir makes NetNSDir a shared mount point, as `ip netns add` does, so namespaces
// mounted there later are visible in mount namespaces created before.
func prepareNetNSDir() error {
	netnsDirOnce.Do(func() {
		if err := os.MkdirAll(NetNSDir, 0o755); err != nil {
			netnsDirErr = fmt.Errorf("create %s: %w", NetNSDir, err)
			return
		}
		err := unix.Mount("", NetNSDir, "none", unix.MS_SHARED|unix.MS_REC, "")
		if errors.Is(err, unix.EINVAL) { // not a mount point yet
			if err = unix.Mount(NetNSDir, NetNSDir, "none", unix.MS_BIND|unix.MS_REC, ""); err == nil {
				err = unix.Mount("", NetNSDir, "none", unix.MS_SHARED|unix.MS_REC, "")
			}
		}
		if err != nil {
			netnsDirErr = fmt.Errorf("make %s a shared mount: %w", NetNSDir, err)
		}
	})
	return netnsDirErr
}

// isNetNSMount reports whether path is a mounted network namespace (not a stale empty file).
func isNetNSMount(path string) bool {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return false
	}
	return st.Type == unix.NSFS_MAGIC
}

// create builds slot index: named netns, veth pair, addresses, default route. On error nothing
// of the slot is left. A leftover at the same index (a crash's, since indexes are ours) is
// removed first.
func (m *Manager) create(index int) (*Slot, error) {
	s := m.slotFor(index)
	err := m.build(s)
	if errors.Is(err, unix.EEXIST) {
		m.log.Info("replacing leftover network slot", "index", index)
		if err = m.destroy(context.Background(), index); err == nil {
			err = m.build(s)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("create network slot %d: %w", index, err)
	}
	return s, nil
}

func (m *Manager) build(s *Slot) (err error) {
	if err := prepareNetNSDir(); err != nil {
		return err
	}
	defer func() {
		// Undo what this call made; a leftover (EEXIST) is for create to remove.
		if err != nil && !errors.Is(err, errNetNSExists) {
			_, _ = removeNetNS(s.NetNSPath)
		}
		if err != nil && !errors.Is(err, unix.EEXIST) {
			_ = m.links.del(s.HostVeth)
		}
	}()
	type result struct {
		host *netlink.Veth
		err  error
	}
	done := make(chan result, 1)
	go func() {
		// The thread enters the new namespace, then returns to the host's. If it cannot, it
		// stays locked, so the runtime never reuses it in the wrong namespace.
		runtime.LockOSThread()
		h, err := m.buildInNewNS(s)
		if rerr := netns.Set(m.links.hostNS); rerr != nil {
			m.log.Error("thread could not return to the host netns; it is discarded", "err", rerr)
		} else {
			runtime.UnlockOSThread()
		}
		done <- result{h, err}
	}()
	r := <-done
	if r.err != nil {
		return r.err
	}
	host := r.host
	disableIPv6(s.HostVeth) // host namespace: this goroutine's thread
	if err := m.links.h.AddrAdd(host, &netlink.Addr{IPNet: ipNet(s.HostIP, 30)}); err != nil {
		return fmt.Errorf("address %s on %s: %w", s.HostIP, s.HostVeth, err)
	}
	return nil
}

// errNetNSExists: a netns of the slot's name is already mounted (it matches unix.EEXIST).
var errNetNSExists = fmt.Errorf("netns exists: %w", unix.EEXIST)

// buildInNewNS runs on a locked thread that it moves into a fresh network namespace.
func (m *Manager) buildInNewNS(s *Slot) (*netlink.Veth, error) {
	f, err := os.OpenFile(s.NetNSPath, os.O_RDONLY|os.O_CREATE|os.O_EXCL, 0o444)
	if err != nil {
		if errors.Is(err, os.ErrExist) {
			return nil, fmt.Errorf("%s: %w", s.NetNSPath, errNetNSExists)
		}
		return nil, err
	}
	f.Close()
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		return nil, fmt.Errorf("unshare netns: %w", err)
	}
	self := fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid())
	if err := unix.Mount(self, s.NetNSPath, "none", unix.MS_BIND, ""); err != nil {
		return nil, fmt.Errorf("bind-mount netns at %s: %w", s.NetNSPath, err)
	}
	// Kernel IPv6 is of no use to the guest (runsc brings its own stack); without it no
	// link-local addresses or DAD appear on the guest end.
	disableIPv6("default")
	ns, err := netns.Get()
	if err != nil {
		return nil, err
	}
	defer ns.Close()
	in, err := netlink.NewHandle(unix.NETLINK_ROUTE) // socket in the new namespace
	if err != nil {
		return nil, err
	}
	defer in.Close()

	host := &netlink.Veth{
		LinkAttrs:     netlink.LinkAttrs{Name: s.HostVeth, Flags: net.FlagUp},
		PeerName:      GuestIfName,
		PeerNamespace: netlink.NsFd(int(ns)),
	}
	if err := m.links.h.LinkAdd(host); err != nil {
		if errors.Is(err, unix.EEXIST) {
			return nil, fmt.Errorf("veth %s: %w", s.HostVeth, err)
		}
		return nil, fmt.Errorf("create veth %s: %w", s.HostVeth, err)
	}
	lo, err := in.LinkByName("lo")
	if err == nil {
		err = in.LinkSetUp(lo)
	}
	if err != nil {
		return nil, fmt.Errorf("lo up: %w", err)
	}
	guest, err := in.LinkByName(GuestIfName)
	if err != nil {
		return nil, fmt.Errorf("find %s in netns: %w", GuestIfName, err)
	}
	if err := in.AddrAdd(guest, &netlink.Addr{IPNet: ipNet(s.GuestIP, 30)}); err != nil {
		return nil, fmt.Errorf("address %s on %s: %w", s.GuestIP, GuestIfName, err)
	}
	if err := in.LinkSetUp(guest); err != nil {
		return nil, fmt.Errorf("%s up: %w", GuestIfName, err)
	}
	route := &netlink.Route{LinkIndex: guest.Attrs().Index, Gw: net.IP(s.HostIP.AsSlice())}
	if err := in.RouteAdd(route); err != nil {
		return nil, fmt.Errorf("default route via %s: %w", s.HostIP, err)
	}
	return host, nil
}

// vethGoneTimeout bounds how long destroy waits for the kernel to take the host veth away
// with the namespace before deleting it itself.
const vethGoneTimeout = 2 * time.Second

// destroy removes whatever exists of slot index: the named netns and the host veth.
// Idempotent.
//
// Unmounting the namespace first lets the kernel delete the veth pair in its batched namespace
// teardown: 16 slots released at once take about 50 ms this way, against 600 ms when each veth
// is deleted by netlink (every deletion waits for its own RCU grace period under the RTNL lock).
// If something still holds the namespace (a runtime process that has not exited), the veth
// is deleted explicitly after vethGoneTimeout or when ctx ends.
func (m *Manager) destroy(ctx context.Context, index int) error {
	s := m.slotFor(index)
	mounted, err := removeNetNS(s.NetNSPath)
	if err != nil {
		return errors.Join(err, m.links.del(s.HostVeth))
	}
	if mounted {
		deadline := time.Now().Add(vethGoneTimeout)
		for wait := time.Millisecond; m.links.exists(s.HostVeth); wait = min(2*wait, 20*time.Millisecond) {
			if time.Now().After(deadline) || ctx.Err() != nil {
				m.log.Warn("host veth outlived its netns; deleting it", "veth", s.HostVeth)
				break
			}
			time.Sleep(wait)
		}
	}
	return m.links.del(s.HostVeth)
}

// removeNetNS unmounts and removes a named netns; mounted reports whether one was mounted.
func removeNetNS(path string) (mounted bool, err error) {
	err = unix.Unmount(path, unix.MNT_DETACH)
	mounted = err == nil
	if err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return false, fmt.Errorf("unmount %s: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return mounted, fmt.Errorf("remove %s: %w", path, err)
	}
	return mounted, nil
}

// disableIPv6 turns IPv6 off on an interface ("default" for interfaces made later) in the
// calling thread's namespace. Kernels without IPv6 have nothing to turn off.
func disableIPv6(ifname string) {
	_ = os.WriteFile(filepath.Join("/proc/sys/net/ipv6/conf", ifname, "disable_ipv6"), []byte("1"), 0o644)
}

func ipNet(a interface{ AsSlice() []byte }, bits int) *net.IPNet {
	return &net.IPNet{IP: net.IP(a.AsSlice()), Mask: net.CIDRMask(bits, 32)}
}
