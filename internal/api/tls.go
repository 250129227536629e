package api

import (
	"bufio"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// Mode B (E2B-PROTOCOL §1.3): the SDK builds https://<port>-<id>.<domain> for getHost(), MCP
// URLs and old SDKs' envd URLs. TLSConfig gives the edge a certificate for <domain> and
// *.<domain>: the operator's (CertFile/KeyFile), or one issued by ember's own local CA, kept in
// CADir so clients can trust it once (NODE_EXTRA_CA_CERTS=<CADir>/ca.pem, or the system store).
// ServeBoth then serves TLS and plain HTTP on the one port: Mode A stays http://.

// TLSOptions chooses the edge's certificate. Either CertFile and KeyFile (PEM) or CADir.
type TLSOptions struct {
	CertFile, KeyFile string
	// CADir holds ca.pem and ca-key.pem; they are made on first use.
	CADir string
	// Domain is the sandbox domain (Config.Domain; a port is ignored). The local CA's leaf
	// certificate covers it, *.<it>, localhost and the loopback addresses.
	Domain string
}

// CAFile is the CA certificate clients must trust when ember issues its own certificate.
func (o TLSOptions) CAFile() string { return filepath.Join(o.CADir, "ca.pem") }

// TLSConfig returns the server TLS configuration for o.
func TLSConfig(o TLSOptions) (*tls.Config, error) {
	var cert tls.Certificate
	var err error
	switch {
	case o.CertFile != "" || o.KeyFile != "":
		if o.CertFile == "" || o.KeyFile == "" {
			return nil, errors.New("tls: both a certificate and a key file are needed")
		}
		cert, err = tls.LoadX509KeyPair(o.CertFile, o.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("tls: load certificate: %w", err)
		}
	case o.CADir != "":
		cert, err = localCACert(o.CADir, o.Domain)
		if err != nil {
			return nil, err
		}
	default:
		return nil, errors.New("tls: no certificate and no CA directory")
	}
	return &tls.Config{
		Certificates: []tls.Certificate{cert},
		MinVersion:   tls.VersionTLS12,
		NextProtos:   []string{"http/1.1"},
	}, nil
}

// localCACert loads (or makes) the CA in dir and issues a fresh leaf for domain.
func localCACert(dir, domain string) (tls.Certificate, error) {
	ca, caKey, err := loadOrMakeCA(dir)
	if err != nil {
		return tls.Certificate{}, err
	}
	host := strings.ToLower(domain)
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	if host == "" {
		host = DefaultDomain
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("tls: leaf key: %w", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: randomSerial(),
		Subject:      pkix.Name{CommonName: "*." + host},
		DNSNames:     []string{host, "*." + host, "localhost", "*.localhost"},
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(397 * 24 * time.Hour), // within what clients accept for leaves
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("tls: issue certificate: %w", err)
	}
	return tls.Certificate{Certificate: [][]byte{der, ca.Raw}, PrivateKey: key}, nil
}

func loadOrMakeCA(dir string) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	certPath, keyPath := filepath.Join(dir, "ca.pem"), filepath.Join(dir, "ca-key.pem")
	if certPEM, err := os.ReadFile(certPath); err == nil {
		keyPEM, err := os.ReadFile(keyPath)
		if err != nil {
			return nil, nil, fmt.Errorf("tls: CA key: %w", err)
		}
		pair, err := tls.X509KeyPair(certPEM, keyPEM)
		if err != nil {
			return nil, nil, fmt.Errorf("tls: CA in %s: %w", dir, err)
		}
		ca, err := x509.ParseCertificate(pair.Certificate[0])
		if err != nil {
			return nil, nil, fmt.Errorf("tls: CA in %s: %w", dir, err)
		}
		key, ok := pair.PrivateKey.(*ecdsa.PrivateKey)
		if !ok {
			return nil, nil, fmt.Errorf("tls: CA key in %s is not ECDSA", dir)
		}
		return ca, key, nil
	} else if !errors.Is(err, os.ErrNotExist) {
		return nil, nil, fmt.Errorf("tls: CA: %w", err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, nil, fmt.Errorf("tls: CA dir: %w", err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("tls: CA key: %w", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          randomSerial(),
		Subject:               pkix.Name{CommonName: "ember local CA", Organization: []string{"ember"}},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(10 * 365 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, nil, fmt.Errorf("tls: CA certificate: %w", err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	// The key first (0600): a certificate without its key is never left behind as "the CA".
	if err := writeFileAtomic(keyPath, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
		return nil, nil, err
	}
	if err := writeFileAtomic(certPath, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644); err != nil {
		return nil, nil, err
	}
	ca, err := x509.ParseCertificate(der)
	return ca, key, err
}

func randomSerial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return big.NewInt(time.Now().UnixNano())
	}
	return n
}

func writeFileAtomic(path string, data []byte, mode os.FileMode) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, mode); err != nil {
		return fmt.Errorf("tls: write %s: %w", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("tls: write %s: %w", path, err)
	}
	return nil
}

// ServeBoth wraps ln so that connections starting with a TLS handshake are served over TLS
// with cfg and all others as plain HTTP: one port for Mode A (http://, E2B_SANDBOX_URL) and
// Mode B (https://<port>-<id>.<domain>). TLS connections are returned as *tls.Conn, so net/http
// sees them as TLS (r.TLS, handshake timeouts). The first byte is read off the accept loop, so
// a silent client delays nobody; one that sends nothing in sniffTimeout is dropped.
func ServeBoth(ln net.Listener, cfg *tls.Config) net.Listener {
	l := &sniffListener{Listener: ln, cfg: cfg, conns: make(chan net.Conn), done: make(chan struct{})}
	go l.acceptLoop()
	return l
}

const sniffTimeout = 10 * time.Second

type sniffListener struct {
	net.Listener
	cfg   *tls.Config
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
	mu    sync.Mutex
	err   error
}

func (l *sniffListener) acceptLoop() {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			l.mu.Lock()
			l.err = err
			l.mu.Unlock()
			l.once.Do(func() { close(l.done) })
			return
		}
		go l.sniff(c)
	}
}

func (l *sniffListener) sniff(c net.Conn) {
	_ = c.SetReadDeadline(time.Now().Add(sniffTimeout))
	br := bufio.NewReaderSize(c, 1)
	b, err := br.Peek(1)
	_ = c.SetReadDeadline(time.Time{})
	if err != nil {
		c.Close()
		return
	}
	var out net.Conn = &bufferedConn{Conn: c, r: br}
	if b[0] == 0x16 { // TLS record type: handshake
		out = tls.Server(out, l.cfg)
	}
	select {
	case l.conns <- out:
	case <-l.done:
		c.Close()
	}
}

func (l *sniffListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		l.mu.Lock()
		defer l.mu.Unlock()
		return nil, l.err
	}
}

func (l *sniffListener) Close() error {
	err := l.Listener.Close()
	l.once.Do(func() {
		l.mu.Lock()
		l.err = net.ErrClosed
		l.mu.Unlock()
		close(l.done)
	})
	return err
}

// bufferedConn replays what was peeked.
type bufferedConn struct {
	net.Conn
	r *bufio.Reader
}

func (c *bufferedConn) Read(p []byte) (int, error) { return c.r.Read(p) }
