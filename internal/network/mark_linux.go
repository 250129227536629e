package network

import (
	"net"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// MarkedDialer returns a dialer whose sockets carry mark (SO_MARK), the one host traffic to
// slots must have when Config.HostMark is set. Setting the mark needs CAP_NET_ADMIN.
func MarkedDialer(mark uint32) *net.Dialer {
	d := &net.Dialer{Timeout: 3 * time.Second, KeepAlive: 30 * time.Second}
	if mark == 0 {
		return d
	}
	d.Control = func(_, _ string, c syscall.RawConn) error {
		var serr error
		if err := c.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, int(mark))
		}); err != nil {
			return err
		}
		return serr
	}
	return d
}
