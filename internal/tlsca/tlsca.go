// Package tlsca gives the sandbox plane its TLS certificate for `*.<domain>` (E2B's Mode B: the
// SDK always builds https://<port>-<id>.<domain> URLs). The certificate is either one the
// operator supplies (Files; reloaded when its files change) or one issued by a small local
// certificate authority that ember makes under its data directory (Local; clients trust the
// CA's ca.pem). The CA is name-constrained to the sandbox domain and the listen addresses, so
// trusting it does not let it vouch for any other name.
//
// It owns the files in its directory and nothing else: it does not listen, route or log.
package tlsca

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// File names inside Options.Dir.
const (
	CAFile    = "ca.pem"     // the CA certificate clients trust (NODE_EXTRA_CA_CERTS, SSL_CERT_FILE)
	CAKeyFile = "ca-key.pem" // the CA's private key (0600)
	CertFile  = "cert.pem"   // the leaf certificate the server presents
	KeyFile   = "key.pem"    // the leaf's private key (0600)
)

// Lifetimes. A leaf is renewed, while the server runs, once less than LeafRenewBefore of it is
// left; a CA once less than CARenewBefore is left (then clients must trust the new ca.pem).
const (
	CAValidity      = 10 * 365 * 24 * time.Hour
	CARenewBefore   = 90 * 24 * time.Hour
	LeafValidity    = 90 * 24 * time.Hour
	LeafRenewBefore = 30 * 24 * time.Hour
	// backdate tolerates clients whose clock is a little behind.
	backdate = time.Hour
)

// Options of a local CA.
type Options struct {
	// Dir holds the CA and the leaf (created 0700), normally <data-dir>/tls.
	Dir string
	// Domain is the sandbox domain; a ":port" suffix is ignored. The leaf covers "*.<domain>"
	// and "<domain>" (api.<domain> is one of the former).
	Domain string
	// IPs are put into the leaf as IP SANs (the listen address; loopback for an unspecified one).
	IPs []net.IP
	// Now is the clock (tests); default time.Now.
	Now func() time.Time
}

// Changes reports what Ensure had to (re)make.
type Changes struct {
	NewCA   bool // a CA was created: clients must trust the new ca.pem
	NewLeaf bool // a leaf was issued
}

// Local serves a leaf issued by the local CA and renews it before it expires.
type Local struct {
	opts Options

	mu   sync.Mutex
	cert *tls.Certificate
}

// NewLocal makes sure a fitting CA and leaf exist in o.Dir (reusing what is there when it still
// fits) and returns a Local serving that leaf.
func NewLocal(o Options) (*Local, Changes, error) {
	o, err := o.normalize()
	if err != nil {
		return nil, Changes{}, err
	}
	cert, ch, err := ensure(o)
	if err != nil {
		return nil, ch, err
	}
	return &Local{opts: o, cert: cert}, ch, nil
}

// CAPath is the CA certificate's path: what clients trust.
func (l *Local) CAPath() string { return filepath.Join(l.opts.Dir, CAFile) }

// GetCertificate is a tls.Config.GetCertificate: the current leaf, renewed first when it is
// close to expiry. A failed renewal keeps serving the old leaf while it is valid.
func (l *Local) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.opts.Now()
	if l.cert.Leaf.NotAfter.Sub(now) > LeafRenewBefore {
		return l.cert, nil
	}
	cert, _, err := ensure(l.opts)
	if err != nil {
		if now.Before(l.cert.Leaf.NotAfter) {
			return l.cert, nil
		}
		return nil, err
	}
	l.cert = cert
	return l.cert, nil
}

func (o Options) normalize() (Options, error) {
	if o.Dir == "" {
		return o, fmt.Errorf("tls: directory is empty: %w", errdefs.ErrInvalid)
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	d, err := HostOf(o.Domain)
	if err != nil {
		return o, err
	}
	o.Domain = d
	ips := make([]net.IP, 0, len(o.IPs))
	for _, ip := range o.IPs {
		if ip4 := ip.To4(); ip4 != nil {
			ip = ip4
		}
		if !slices.ContainsFunc(ips, ip.Equal) {
			ips = append(ips, ip)
		}
	}
	o.IPs = ips
	return o, nil
}

// HostOf returns the DNS name of a sandbox domain ("ember.test:8443" -> "ember.test"),
// lower-cased, or ErrInvalid when it is not a DNS name.
func HostOf(domain string) (string, error) {
	d := strings.ToLower(strings.TrimSpace(domain))
	if h, _, err := net.SplitHostPort(d); err == nil {
		d = h
	}
	d = strings.TrimSuffix(d, ".")
	if !validDNSName(d) {
		return "", fmt.Errorf("tls: domain %q: must be a DNS name such as sbx.example.com: %w", domain, errdefs.ErrInvalid)
	}
	return d, nil
}

func validDNSName(d string) bool {
	if d == "" || len(d) > 253 || net.ParseIP(d) != nil {
		return false
	}
	for _, label := range strings.Split(d, ".") {
		if label == "" || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return false
		}
		for i := 0; i < len(label); i++ {
			c := label[i]
			if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
				return false
			}
		}
	}
	return true
}

// ListenIPs are the IP SANs for a listen address: its IP, or the loopback addresses when it
// is unspecified (":443", "0.0.0.0:443"); names other than IPs give none.
func ListenIPs(addr string) []net.IP {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		host = addr
	}
	ip := net.ParseIP(host)
	if host == "" || ip != nil && ip.IsUnspecified() {
		return []net.IP{net.IPv4(127, 0, 0, 1).To4(), net.IPv6loopback}
	}
	if ip == nil {
		return nil
	}
	return []net.IP{ip}
}

// ensure loads the CA and leaf from o.Dir, replacing whichever no longer fits, and returns
// the leaf ready to serve.
func ensure(o Options) (*tls.Certificate, Changes, error) {
	var ch Changes
	if err := os.MkdirAll(o.Dir, 0o700); err != nil {
		return nil, ch, fmt.Errorf("tls: %w", err)
	}
	if err := os.Chmod(o.Dir, 0o700); err != nil {
		return nil, ch, fmt.Errorf("tls: %w", err)
	}
	now := o.Now()
	ca, caKey, err := loadPair(filepath.Join(o.Dir, CAFile), filepath.Join(o.Dir, CAKeyFile))
	if err != nil || !caFits(ca, o, now) {
		ca, caKey, err = newCA(o, now)
		if err != nil {
			return nil, ch, err
		}
		if err := writePair(o.Dir, CAFile, CAKeyFile, ca, caKey, 0o644); err != nil {
			return nil, ch, err
		}
		ch.NewCA = true
	}
	leaf, leafKey, err := loadPair(filepath.Join(o.Dir, CertFile), filepath.Join(o.Dir, KeyFile))
	if ch.NewCA || err != nil || !leafFits(leaf, ca, o, now) {
		leaf, leafKey, err = issueLeaf(o, ca, caKey, now)
		if err != nil {
			return nil, ch, err
		}
		if err := writePair(o.Dir, CertFile, KeyFile, leaf, leafKey, 0o644); err != nil {
			return nil, ch, err
		}
		ch.NewLeaf = true
	}
	return &tls.Certificate{Certificate: [][]byte{leaf.Raw}, PrivateKey: leafKey, Leaf: leaf}, ch, nil
}

// dnsNames are the leaf's DNS SANs for a domain.
func dnsNames(domain string) []string { return []string{"*." + domain, domain} }

// caFits: a CA that is still valid for a while and whose name constraints are exactly the
// ones this configuration asks for (a changed domain or listen address means a new CA).
func caFits(ca *x509.Certificate, o Options, now time.Time) bool {
	if !ca.IsCA || ca.NotAfter.Sub(now) < CARenewBefore || now.Before(ca.NotBefore) {
		return false
	}
	if ca.CheckSignatureFrom(ca) != nil {
		return false
	}
	return slices.Equal(ca.PermittedDNSDomains, []string{o.Domain}) && sameIPNets(ca.PermittedIPRanges, ipNets(o.IPs))
}

// leafFits: issued by ca, valid for a while yet (and not beyond the CA), covering exactly the
// wanted names.
func leafFits(leaf, ca *x509.Certificate, o Options, now time.Time) bool {
	if leaf.CheckSignatureFrom(ca) != nil || !bytes.Equal(leaf.RawIssuer, ca.RawSubject) {
		return false
	}
	if leaf.NotAfter.Sub(now) < LeafRenewBefore || now.Before(leaf.NotBefore) || leaf.NotAfter.After(ca.NotAfter) {
		return false
	}
	if !slices.Equal(leaf.DNSNames, dnsNames(o.Domain)) || len(leaf.IPAddresses) != len(o.IPs) {
		return false
	}
	for i, ip := range leaf.IPAddresses {
		if !ip.Equal(o.IPs[i]) {
			return false
		}
	}
	return true
}

func ipNets(ips []net.IP) []*net.IPNet {
	nets := make([]*net.IPNet, 0, len(ips))
	for _, ip := range ips {
		bits := 8 * len(ip)
		nets = append(nets, &net.IPNet{IP: ip, Mask: net.CIDRMask(bits, bits)})
	}
	return nets
}

func sameIPNets(a, b []*net.IPNet) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i].String() != b[i].String() {
			return false
		}
	}
	return true
}

func serial() (*big.Int, error) {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 128))
	if err != nil {
		return nil, fmt.Errorf("tls: serial: %w", err)
	}
	return n.Add(n, big.NewInt(1)), nil
}

func newCA(o Options, now time.Time) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("tls: ca key: %w", err)
	}
	sn, err := serial()
	if err != nil {
		return nil, nil, err
	}
	host, _ := os.Hostname()
	tmpl := &x509.Certificate{
		SerialNumber: sn,
		Subject: pkix.Name{
			Organization: []string{"ember local CA"},
			CommonName:   fmt.Sprintf("ember CA for %s (%s, %s)", o.Domain, host, now.UTC().Format("2006-01-02")),
		},
		NotBefore:             now.Add(-backdate),
		NotAfter:              now.Add(CAValidity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
		// Trusting this CA must not let it vouch for any name but the sandbox domain's.
		PermittedDNSDomainsCritical: true,
		PermittedDNSDomains:         []string{o.Domain},
		PermittedIPRanges:           ipNets(o.IPs),
	}
	return sign(tmpl, tmpl, key, key)
}

func issueLeaf(o Options, ca *x509.Certificate, caKey crypto.Signer, now time.Time) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("tls: key: %w", err)
	}
	sn, err := serial()
	if err != nil {
		return nil, nil, err
	}
	notAfter := now.Add(LeafValidity)
	if notAfter.After(ca.NotAfter) {
		notAfter = ca.NotAfter
	}
	tmpl := &x509.Certificate{
		SerialNumber: sn,
		Subject:      pkix.Name{Organization: []string{"ember"}, CommonName: "*." + o.Domain},
		NotBefore:    now.Add(-backdate),
		NotAfter:     notAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames:     dnsNames(o.Domain),
		IPAddresses:  o.IPs,
	}
	return sign(tmpl, ca, key, caKey)
}

func sign(tmpl, parent *x509.Certificate, key *ecdsa.PrivateKey, signer crypto.Signer) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, key.Public(), signer)
	if err != nil {
		return nil, nil, fmt.Errorf("tls: sign: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, nil, fmt.Errorf("tls: parse: %w", err)
	}
	return cert, key, nil
}

// loadPair reads a PEM certificate and its PEM key and checks that they belong together.
func loadPair(certPath, keyPath string) (*x509.Certificate, crypto.Signer, error) {
	pair, err := tls.LoadX509KeyPair(certPath, keyPath)
	if err != nil {
		return nil, nil, err
	}
	signer, ok := pair.PrivateKey.(crypto.Signer)
	if !ok {
		return nil, nil, fmt.Errorf("tls: %s: key cannot sign: %w", keyPath, errdefs.ErrInvalid)
	}
	return pair.Leaf, signer, nil
}

// writePair writes the certificate (certMode) and key (0600) atomically, the key first so a
// certificate on disk never names a key that is not there.
func writePair(dir, certName, keyName string, cert *x509.Certificate, key crypto.Signer, certMode fs.FileMode) error {
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return fmt.Errorf("tls: marshal key: %w", err)
	}
	if err := writeFile(filepath.Join(dir, keyName), pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), 0o600); err != nil {
		return err
	}
	return writeFile(filepath.Join(dir, certName), pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: cert.Raw}), certMode)
}

// CA is a certificate authority EnsureCA keeps in a directory.
type CA struct {
	Cert    tls.Certificate // with Leaf set
	CertPEM []byte
	// Replaced: files were there but did not load, and a new CA replaced them.
	Replaced bool
}

// EnsureCA returns the CA in dir (certName and keyName, both 0600), making one when there is
// none or the pair there does not load (a file cut short by a crash of an older version, or
// damaged): the new CA replaces it atomically, and Replaced says so. Unlike the sandbox plane's
// CA it has no name constraints: it signs for any name (the egress proxy's interception).
// Only an error reading the directory itself (permissions) is returned.
func EnsureCA(dir, certName, keyName, commonName string) (*CA, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("tls: %w", err)
	}
	certPath, keyPath := filepath.Join(dir, certName), filepath.Join(dir, keyName)
	existed := false
	for _, p := range []string{certPath, keyPath} {
		if f, err := os.Open(p); err == nil {
			existed = true
			f.Close()
		} else if !errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("tls: %w", err)
		}
	}
	if cert, key, err := loadPair(certPath, keyPath); err == nil && cert.IsCA && time.Now().Before(cert.NotAfter) {
		certPEM, err := os.ReadFile(certPath)
		if err != nil {
			return nil, fmt.Errorf("tls: %w", err)
		}
		return &CA{Cert: tls.Certificate{Certificate: [][]byte{cert.Raw}, PrivateKey: key, Leaf: cert}, CertPEM: certPEM}, nil
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("tls: ca key: %w", err)
	}
	sn, err := serial()
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          sn,
		Subject:               pkix.Name{CommonName: commonName, Organization: []string{"ember"}},
		NotBefore:             now.Add(-backdate),
		NotAfter:              now.Add(CAValidity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	cert, _, err := sign(tmpl, tmpl, key, key)
	if err != nil {
		return nil, err
	}
	if err := writePair(dir, certName, keyName, cert, key, 0o600); err != nil {
		return nil, err
	}
	return &CA{Cert: tls.Certificate{Certificate: [][]byte{cert.Raw}, PrivateKey: key, Leaf: cert},
		CertPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: cert.Raw}), Replaced: existed}, nil
}

func writeFile(path string, data []byte, mode fs.FileMode) error {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return fmt.Errorf("tls: %w", err)
	}
	tmp := f.Name()
	defer os.Remove(tmp)
	if err := f.Chmod(mode); err != nil {
		f.Close()
		return fmt.Errorf("tls: %w", err)
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return fmt.Errorf("tls: write %s: %w", path, err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("tls: sync %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("tls: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("tls: %w", err)
	}
	return nil
}

// ---- an operator's certificate ----

// reloadCheck bounds how often Files looks at its files' modification times.
const reloadCheck = 5 * time.Second

// Files serves a certificate and key the operator gives (PEM; the certificate file may carry
// the chain after the leaf). It re-reads them when either file changes, so a renewed
// certificate (certbot, cert-manager) is picked up without a restart; a pair that fails to load
// leaves the previous one in service.
type Files struct {
	certPath, keyPath string
	now               func() time.Time

	mu        sync.Mutex
	cert      *tls.Certificate
	stamp     string
	checkedAt time.Time
	lastErr   error
}

// LoadFiles loads the operator's certificate and key.
func LoadFiles(certPath, keyPath string) (*Files, error) {
	if certPath == "" || keyPath == "" {
		return nil, fmt.Errorf("tls: give both a certificate and a key: %w", errdefs.ErrInvalid)
	}
	f := &Files{certPath: certPath, keyPath: keyPath, now: time.Now}
	cert, stamp, err := f.load()
	if err != nil {
		return nil, err
	}
	f.cert, f.stamp, f.checkedAt = cert, stamp, f.now()
	return f, nil
}

// Leaf is the certificate currently served.
func (f *Files) Leaf() *x509.Certificate {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.cert.Leaf
}

// GetCertificate is a tls.Config.GetCertificate.
func (f *Files) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	now := f.now()
	if now.Sub(f.checkedAt) < reloadCheck {
		return f.cert, nil
	}
	f.checkedAt = now
	if f.stampNow() == f.stamp {
		return f.cert, nil
	}
	cert, stamp, err := f.load()
	if err != nil {
		f.lastErr = err
		return f.cert, nil
	}
	f.cert, f.stamp, f.lastErr = cert, stamp, nil
	return f.cert, nil
}

// ReloadError is the error of the last failed reload (nil once a reload succeeds).
func (f *Files) ReloadError() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.lastErr
}

func (f *Files) stampNow() string {
	var b strings.Builder
	for _, p := range []string{f.certPath, f.keyPath} {
		st, err := os.Stat(p)
		if err != nil {
			b.WriteString("missing;")
			continue
		}
		fmt.Fprintf(&b, "%d/%d;", st.ModTime().UnixNano(), st.Size())
	}
	return b.String()
}

func (f *Files) load() (*tls.Certificate, string, error) {
	stamp := f.stampNow()
	pair, err := tls.LoadX509KeyPair(f.certPath, f.keyPath)
	if err != nil {
		return nil, "", fmt.Errorf("tls: load %s and %s: %v: %w", f.certPath, f.keyPath, err, errdefs.ErrInvalid)
	}
	return &pair, stamp, nil
}

// Covers reports whether cert is valid for sandbox hosts of domain (<port>-<id>.<domain>).
func Covers(cert *x509.Certificate, domain string) bool {
	host, err := HostOf(domain)
	if err != nil {
		return false
	}
	return cert.VerifyHostname("49983-probe."+host) == nil
}

// ---- server configuration ----

// Source hands out the certificate for each handshake.
type Source interface {
	GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error)
}

// ServerConfig is the TLS configuration of the sandbox-plane listener. http.Server adds the
// ALPN protocols (h2, http/1.1) itself.
func ServerConfig(src Source) *tls.Config {
	return &tls.Config{
		MinVersion:     tls.VersionTLS12,
		GetCertificate: src.GetCertificate,
	}
}
