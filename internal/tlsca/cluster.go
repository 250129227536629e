package tlsca

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"time"

	"github.com/ember-sandbox/ember/internal/errdefs"
)

// The cluster's own certificate authority (`ember cluster certs`): etcd's members present a
// server certificate it issued and trust only client certificates it issued, one per ember
// node. It is a different CA from the sandbox plane's (Local): that one is name-constrained to
// the sandbox domain, and its clients are anyone's browsers.
//
// Files in ClusterOptions.Dir:
const (
	ClusterCAFile     = "ca.pem"          // the cluster CA (etcd --trusted-ca-file, ember --etcd-ca)
	ClusterCAKeyFile  = "ca-key.pem"      // its key (0600): keep it off the nodes
	EtcdCertFile      = "etcd.pem"        // etcd's server and peer certificate (--cert-file, --peer-cert-file)
	EtcdKeyFile       = "etcd-key.pem"    // its key (--key-file, --peer-key-file)
	ClusterSealingKey = "cluster-key.hex" // 32 random bytes, hex: ember --cluster-key-file
)

// NodeCertFile and NodeKeyFile name node's client certificate and key (--etcd-cert, --etcd-key).
func NodeCertFile(node string) string { return "node-" + node + ".pem" }

// NodeKeyFile names node's client key.
func NodeKeyFile(node string) string { return "node-" + node + "-key.pem" }

// ClusterValidity is the lifetime of the certificates `ember cluster certs` issues (the CA's is
// CAValidity): run it again before they expire to issue new ones.
const ClusterValidity = 2 * 365 * 24 * time.Hour

// ClusterOptions of `ember cluster certs`.
type ClusterOptions struct {
	Dir string
	// Hosts are the names and IPs etcd's members are reached at (server certificate SANs).
	Hosts []string
	// Nodes are the ember node ids to issue client certificates for.
	Nodes []string
	Now   func() time.Time
}

// ClusterResult lists what MakeCluster wrote (paths), and what it kept.
type ClusterResult struct {
	Written, Kept []string
}

var nodeNameRe = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,62}$`)

// MakeCluster makes (or completes) a cluster's TLS material in o.Dir: the CA, etcd's
// certificate for o.Hosts, a client certificate per node and the cluster sealing key. What
// exists and still fits is kept (so that it can be run again to add a node); etcd's
// certificate is issued again when the hosts changed.
func MakeCluster(o ClusterOptions) (ClusterResult, error) {
	var res ClusterResult
	if o.Dir == "" {
		return res, fmt.Errorf("cluster certs: directory is empty: %w", errdefs.ErrInvalid)
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if len(o.Hosts) == 0 {
		o.Hosts = []string{"localhost", "127.0.0.1", "::1"}
	}
	var dns []string
	var ips []net.IP
	for _, h := range o.Hosts {
		if ip := net.ParseIP(h); ip != nil {
			ips = append(ips, ip)
		} else if validDNSName(h) {
			dns = append(dns, h)
		} else {
			return res, fmt.Errorf("cluster certs: host %q is neither an IP nor a DNS name: %w", h, errdefs.ErrInvalid)
		}
	}
	for _, n := range o.Nodes {
		if !nodeNameRe.MatchString(n) {
			return res, fmt.Errorf("cluster certs: node %q: lowercase letters, digits, '.', '_' and '-' only: %w", n, errdefs.ErrInvalid)
		}
	}
	if err := os.MkdirAll(o.Dir, 0o700); err != nil {
		return res, fmt.Errorf("cluster certs: %w", err)
	}
	now := o.Now()
	path := func(name string) string { return filepath.Join(o.Dir, name) }

	ca, caKey, err := loadPair(path(ClusterCAFile), path(ClusterCAKeyFile))
	newCA := err != nil || !ca.IsCA || ca.NotAfter.Sub(now) < CARenewBefore || ca.CheckSignatureFrom(ca) != nil
	if newCA {
		if ca, caKey, err = newClusterCA(now); err != nil {
			return res, err
		}
		if err := writePair(o.Dir, ClusterCAFile, ClusterCAKeyFile, ca, caKey, 0o644); err != nil {
			return res, err
		}
		res.Written = append(res.Written, path(ClusterCAFile), path(ClusterCAKeyFile))
	} else {
		res.Kept = append(res.Kept, path(ClusterCAFile))
	}

	srv, _, err := loadPair(path(EtcdCertFile), path(EtcdKeyFile))
	if newCA || err != nil || !clusterLeafFits(srv, ca, now) || !sameNames(srv, dns, ips) {
		leaf, key, err := issueClusterLeaf(ca, caKey, now, "ember etcd", dns, ips,
			[]x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth})
		if err != nil {
			return res, err
		}
		if err := writePair(o.Dir, EtcdCertFile, EtcdKeyFile, leaf, key, 0o644); err != nil {
			return res, err
		}
		res.Written = append(res.Written, path(EtcdCertFile))
	} else {
		res.Kept = append(res.Kept, path(EtcdCertFile))
	}

	for _, n := range o.Nodes {
		c, _, err := loadPair(path(NodeCertFile(n)), path(NodeKeyFile(n)))
		if !newCA && err == nil && clusterLeafFits(c, ca, now) {
			res.Kept = append(res.Kept, path(NodeCertFile(n)))
			continue
		}
		leaf, key, err := issueClusterLeaf(ca, caKey, now, "ember node "+n, nil, nil, []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth})
		if err != nil {
			return res, err
		}
		if err := writePair(o.Dir, NodeCertFile(n), NodeKeyFile(n), leaf, key, 0o644); err != nil {
			return res, err
		}
		res.Written = append(res.Written, path(NodeCertFile(n)))
	}

	// The sealing key is never replaced: what etcd holds sealed with it would be lost.
	if _, err := os.Stat(path(ClusterSealingKey)); errors.Is(err, fs.ErrNotExist) {
		b := make([]byte, 32)
		if _, err := rand.Read(b); err != nil {
			return res, err
		}
		if err := writeFile(path(ClusterSealingKey), []byte(hex.EncodeToString(b)+"\n"), 0o600); err != nil {
			return res, err
		}
		res.Written = append(res.Written, path(ClusterSealingKey))
	} else if err != nil {
		return res, fmt.Errorf("cluster certs: %w", err)
	} else {
		res.Kept = append(res.Kept, path(ClusterSealingKey))
	}
	return res, nil
}

func newClusterCA(now time.Time) (*x509.Certificate, *ecdsa.PrivateKey, error) {
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
		Subject: pkix.Name{Organization: []string{"ember cluster CA"},
			CommonName: fmt.Sprintf("ember cluster CA (%s, %s)", host, now.UTC().Format("2006-01-02"))},
		NotBefore:             now.Add(-backdate),
		NotAfter:              now.Add(CAValidity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	return sign(tmpl, tmpl, key, key)
}

func issueClusterLeaf(ca *x509.Certificate, caKey crypto.Signer, now time.Time, cn string, dns []string, ips []net.IP, usage []x509.ExtKeyUsage) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("tls: key: %w", err)
	}
	sn, err := serial()
	if err != nil {
		return nil, nil, err
	}
	notAfter := now.Add(ClusterValidity)
	if notAfter.After(ca.NotAfter) {
		notAfter = ca.NotAfter
	}
	tmpl := &x509.Certificate{
		SerialNumber: sn,
		Subject:      pkix.Name{Organization: []string{"ember cluster"}, CommonName: cn},
		NotBefore:    now.Add(-backdate),
		NotAfter:     notAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  usage,
		DNSNames:     dns,
		IPAddresses:  ips,
	}
	return sign(tmpl, ca, key, caKey)
}

func clusterLeafFits(leaf, ca *x509.Certificate, now time.Time) bool {
	return leaf.CheckSignatureFrom(ca) == nil && leaf.NotAfter.Sub(now) > LeafRenewBefore && !now.Before(leaf.NotBefore)
}

func sameNames(c *x509.Certificate, dns []string, ips []net.IP) bool {
	if len(c.DNSNames) != len(dns) || len(c.IPAddresses) != len(ips) {
		return false
	}
	for i := range dns {
		if c.DNSNames[i] != dns[i] {
			return false
		}
	}
	for i := range ips {
		if !c.IPAddresses[i].Equal(ips[i]) {
			return false
		}
	}
	return true
}
