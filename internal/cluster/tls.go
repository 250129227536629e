package cluster

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// etcd is the cluster's trust root: whoever writes to it routes clients' requests, and whoever
// reads it reads what it holds. So a node talks to it only over TLS, proving itself with a
// client certificate and checking etcd's against the cluster CA (`ember cluster certs`); a node
// told nothing else refuses a plain http endpoint, a missing certificate, and an etcd that
// lets clients in without a certificate (one that anyone on the network can write to).

// TLSFiles are a node's etcd credentials (PEM files).
type TLSFiles struct {
	CA, Cert, Key string
	// Insecure allows plain http endpoints and an etcd without client certificate auth.
	Insecure bool
}

// ClientTLS checks endpoints against f and returns the TLS configuration of the node's etcd
// client (nil: plain text, only with Insecure).
func ClientTLS(endpoints []string, f TLSFiles) (*tls.Config, error) {
	plain, secure := 0, 0
	for _, ep := range endpoints {
		u, err := url.Parse(ep)
		if err != nil || u.Host == "" || (u.Scheme != "http" && u.Scheme != "https") {
			return nil, fmt.Errorf("etcd-endpoints: %q is not an http:// or https:// URL: %w", ep, errdefs.ErrInvalid)
		}
		if u.Scheme == "http" {
			plain++
		} else {
			secure++
		}
	}
	if plain > 0 && secure > 0 {
		return nil, fmt.Errorf("etcd-endpoints: mixes http:// and https:// endpoints: %w", errdefs.ErrInvalid)
	}
	if plain > 0 {
		if !f.Insecure {
			return nil, fmt.Errorf("etcd-endpoints: %s is plain http: anyone on the network could read and rewrite the cluster's state; use https:// endpoints with --etcd-ca, --etcd-cert and --etcd-key (ember cluster certs makes them), or --etcd-insecure to join it anyway: %w", strings.Join(endpoints, ","), errdefs.ErrInvalid)
		}
		return nil, nil
	}
	if f.CA == "" || f.Cert == "" || f.Key == "" {
		if !f.Insecure || f.Cert != "" || f.Key != "" {
			return nil, fmt.Errorf("etcd: an https endpoint needs --etcd-ca (the CA that signed etcd's certificate), --etcd-cert and --etcd-key (this node's client certificate; ember cluster certs makes them), or --etcd-insecure: %w", errdefs.ErrInvalid)
		}
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if f.CA != "" {
		pem, err := os.ReadFile(f.CA)
		if err != nil {
			return nil, fmt.Errorf("etcd-ca: %w: %w", err, errdefs.ErrInvalid)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("etcd-ca: %s holds no PEM certificate: %w", f.CA, errdefs.ErrInvalid)
		}
		cfg.RootCAs = pool
	}
	if f.Cert != "" || f.Key != "" {
		pair, err := tls.LoadX509KeyPair(f.Cert, f.Key)
		if err != nil {
			return nil, fmt.Errorf("etcd-cert/etcd-key: %w: %w", err, errdefs.ErrInvalid)
		}
		if pair.Leaf != nil && time.Now().After(pair.Leaf.NotAfter) {
			return nil, fmt.Errorf("etcd-cert: %s expired on %s: %w", f.Cert, pair.Leaf.NotAfter.UTC().Format(time.DateOnly), errdefs.ErrInvalid)
		}
		cfg.Certificates = []tls.Certificate{pair}
	}
	return cfg, nil
}

// CheckTLS connects to each endpoint once and reports, in words an operator can act on, why a
// node with cfg cannot use it: etcd's certificate not signed by the CA (or not for its name),
// the node's certificate refused, or (unless insecure) an etcd that lets clients in without a
// certificate. nil when one endpoint accepted the node. Plain-text configurations (cfg nil)
// are not checked.
func CheckTLS(ctx context.Context, endpoints []string, cfg *tls.Config, insecure bool) error {
	if cfg == nil {
		return nil
	}
	var errs []error
	for _, ep := range endpoints {
		u, _ := url.Parse(ep)
		err := checkOne(ctx, u.Host, cfg, insecure)
		if err == nil {
			return nil
		}
		errs = append(errs, fmt.Errorf("%s: %w", ep, err))
	}
	return fmt.Errorf("etcd: cannot authenticate with any endpoint: %w: %w", errors.Join(errs...), errdefs.ErrInvalid)
}

// probeWait is how long a probe waits for etcd's verdict on the node's certificate.
const probeWait = 2 * time.Second

func checkOne(ctx context.Context, host string, cfg *tls.Config, insecure bool) error {
	name, _, _ := net.SplitHostPort(host)
	c := cfg.Clone()
	c.ServerName = name
	c.NextProtos = []string{"h2"}
	err := tryHandshake(ctx, host, c)
	if err != nil {
		return err
	}
	if insecure {
		return nil
	}
	// Does etcd let a client without a certificate in? Then anyone on its network can write
	// the cluster's state, and this node would trust it.
	anon := c.Clone()
	anon.Certificates = nil
	if tryHandshake(ctx, host, anon) == nil {
		return errors.New("etcd accepts clients without a certificate: run it with --client-cert-auth and --trusted-ca-file (or join it anyway with --etcd-insecure)")
	}
	return nil
}

// tryHandshake dials host and reads until etcd either refuses the client's certificate (TLS
// 1.3 says so only after the handshake, in an alert) or starts speaking HTTP/2 (it sends its
// settings first), which means it accepted it.
func tryHandshake(ctx context.Context, host string, cfg *tls.Config) error {
	d := tls.Dialer{NetDialer: &net.Dialer{Timeout: probeWait}, Config: cfg}
	dctx, cancel := context.WithTimeout(ctx, probeWait)
	defer cancel()
	conn, err := d.DialContext(dctx, "tcp", host)
	if err != nil {
		return explainTLS(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(probeWait))
	// A client preface makes the server answer with its settings frame.
	if _, err := conn.Write([]byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")); err != nil {
		return explainTLS(err)
	}
	buf := make([]byte, 9)
	if _, err := conn.Read(buf); err != nil {
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return nil // silent but not refused
		}
		return explainTLS(err)
	}
	return nil
}

func explainTLS(err error) error {
	var unknown x509.UnknownAuthorityError
	var host x509.HostnameError
	var inv x509.CertificateInvalidError
	msg := err.Error()
	switch {
	case errors.As(err, &unknown):
		return fmt.Errorf("etcd's certificate is not signed by --etcd-ca (%v)", err)
	case errors.As(err, &host):
		return fmt.Errorf("etcd's certificate is not for this address (%v): issue it for the name or IP in --etcd-endpoints (ember cluster certs --hosts)", err)
	case errors.As(err, &inv):
		return fmt.Errorf("etcd's certificate is not valid (%v)", err)
	case strings.Contains(msg, "certificate required"):
		return fmt.Errorf("etcd requires a client certificate and this node gave none (--etcd-cert, --etcd-key)")
	case strings.Contains(msg, "bad certificate") || strings.Contains(msg, "unknown certificate authority") || strings.Contains(msg, "certificate unknown") || strings.Contains(msg, "expired certificate"):
		return fmt.Errorf("etcd refused this node's client certificate (%v): it must be issued by the CA etcd trusts (--trusted-ca-file)", err)
	case strings.Contains(msg, "first record does not look like a TLS handshake"):
		return fmt.Errorf("etcd does not speak TLS on this endpoint (use http:// with --etcd-insecure, or run etcd with --cert-file and --key-file)")
	}
	return err
}
