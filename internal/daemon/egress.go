package daemon

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"

	"github.com/ember-sandbox/ember/internal/datadir"
	"github.com/ember-sandbox/ember/internal/egress"
	"github.com/ember-sandbox/ember/internal/errdefs"
	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/secret"
)

// EgressRootCAsEnv names a PEM file of CAs the egress proxy trusts for upstream servers besides
// the system's (a private API behind a company CA; the e2e tests' upstream).
const EgressRootCAsEnv = "EMBER_EGRESS_ROOT_CAS"

// EgressDNSEnv names the DNS server (host:port) the egress proxy resolves allowed names with,
// instead of the node's resolver (/etc/resolv.conf): a node whose sandboxes must see a private
// zone, and the e2e tests' resolver in a namespace of their own.
const EgressDNSEnv = "EMBER_EGRESS_DNS"

// egressResolver is the resolver of EgressDNSEnv's server, or nil (the node's).
func egressResolver() (egress.Resolver, error) {
	addr := os.Getenv(EgressDNSEnv)
	if addr == "" {
		return nil, nil
	}
	if _, _, err := net.SplitHostPort(addr); err != nil {
		return nil, fmt.Errorf("%s=%q: host:port needed: %w", EgressDNSEnv, addr, errdefs.ErrInvalid)
	}
	return &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, network, addr)
	}}, nil
}

// startEgressProxy starts the node's egress proxy on a port of its own (any address: only
// redirected slot traffic reaches it through the firewall, and it serves only the guests it
// holds a policy for), with the node's CA under <data-dir>/egress.
func startEgressProxy(cfg Config, node string, secrets *secret.Manager, alwaysDenied func(netip.Addr) bool) (_ *egress.Proxy, _ uint16, caPEM []byte, _ error) {
	ca, caPEM, replaced, err := egress.LoadOrCreateCA(datadir.Egress(cfg.DataDir), node)
	if err != nil {
		return nil, 0, nil, err
	}
	if replaced {
		cfg.Logger.Warn("the egress CA's files did not load: a new CA replaces them (sandboxes made before trust the old one: TLS to their rules' hosts fails until they are made again)")
	}
	var roots []*x509.Certificate
	if f := os.Getenv(EgressRootCAsEnv); f != "" {
		b, err := os.ReadFile(f)
		if err != nil {
			return nil, 0, nil, fmt.Errorf("%s: %w: %w", EgressRootCAsEnv, err, errdefs.ErrInvalid)
		}
		for blk, rest := pem.Decode(b); blk != nil; blk, rest = pem.Decode(rest) {
			c, err := x509.ParseCertificate(blk.Bytes)
			if err != nil {
				return nil, 0, nil, fmt.Errorf("%s: %w: %w", EgressRootCAsEnv, err, errdefs.ErrInvalid)
			}
			roots = append(roots, c)
		}
	}
	res, err := egressResolver()
	if err != nil {
		return nil, 0, nil, err
	}
	px, err := egress.New(egress.Config{CA: ca, ExtraRoots: roots, Secrets: secrets, AlwaysDenied: alwaysDenied, Resolver: res, Logger: cfg.Logger})
	if err != nil {
		return nil, 0, nil, err
	}
	ln, err := net.Listen("tcp4", "0.0.0.0:0")
	if err != nil {
		return nil, 0, nil, fmt.Errorf("egress proxy: %w", err)
	}
	go func() {
		if err := px.Serve(ln); err != nil {
			cfg.Logger.Error("egress proxy stopped", "err", err)
		}
	}()
	return px, uint16(ln.Addr().(*net.TCPAddr).Port), caPEM, nil
}

// egressPolicy is what the proxy enforces for e (nil: the slot is not proxied).
func egressPolicy(e sandbox.Egress) *egress.Policy {
	if !e.Proxied() {
		return nil
	}
	p := &egress.Policy{AllowInternet: e.AllowInternet, AllowOut: e.AllowOut, DenyOut: e.DenyOut,
		AllowHosts: e.AllowHosts, Owner: e.Owner}
	if len(e.Rules) > 0 {
		p.Rules = map[string]http.Header{}
		for d, hs := range e.Rules {
			h := http.Header{}
			for k, v := range hs {
				h.Set(k, v)
			}
			p.Rules[d] = h
		}
	}
	if e.Upstream != nil {
		p.Upstream = &egress.Upstream{Address: e.Upstream.Address, Username: e.Upstream.Username, Password: e.Upstream.Password}
	}
	return p
}
