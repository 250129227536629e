package clustertest

import (
	"io"
	"net"
	"strings"
	"sync"
	"testing"
)

// Proxy forwards TCP connections from its own loopback ports to the members' client ports, so
// that a test can cut one client off the cluster (Cut) while the cluster itself runs on.
type Proxy struct {
	mu    sync.Mutex
	cut   bool
	lns   []net.Listener
	conns map[net.Conn]struct{}
}

// NewProxy listens on one loopback port per member; closed when the test ends.
func (e *Etcd) NewProxy(t testing.TB) *Proxy {
	t.Helper()
	p := &Proxy{conns: map[net.Conn]struct{}{}}
	var eps []string
	for _, ep := range e.Endpoints() {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		p.lns = append(p.lns, ln)
		go p.accept(ln, strings.TrimPrefix(ep, "https://"))
		eps = append(eps, "https://"+ln.Addr().String())
	}
	register(eps, e.tls)
	t.Cleanup(func() { unregister(eps) })
	t.Cleanup(p.close)
	return p
}

// Endpoints are the proxy's URLs, one per member.
func (p *Proxy) Endpoints() []string {
	var out []string
	for _, ln := range p.lns {
		out = append(out, "https://"+ln.Addr().String())
	}
	return out
}

// Cut drops every connection and refuses new ones until Mend.
func (p *Proxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = true
	for c := range p.conns {
		c.Close()
	}
}

// Mend lets connections through again.
func (p *Proxy) Mend() {
	p.mu.Lock()
	p.cut = false
	p.mu.Unlock()
}

func (p *Proxy) accept(ln net.Listener, target string) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		go p.pipe(c, target)
	}
}

func (p *Proxy) pipe(c net.Conn, target string) {
	if !p.track(c) {
		c.Close()
		return
	}
	u, err := net.Dial("tcp", target)
	if err != nil || !p.track(u) {
		c.Close()
		if u != nil {
			u.Close()
		}
		return
	}
	done := make(chan struct{}, 2)
	go func() { io.Copy(u, c); done <- struct{}{} }()
	go func() { io.Copy(c, u); done <- struct{}{} }()
	<-done
	c.Close()
	u.Close()
	p.mu.Lock()
	delete(p.conns, c)
	delete(p.conns, u)
	p.mu.Unlock()
}

func (p *Proxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cut {
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *Proxy) close() {
	for _, ln := range p.lns {
		ln.Close()
	}
	p.Cut()
}
