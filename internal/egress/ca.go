package egress

import (
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
	"os"
	"path/filepath"
	"time"
)

// CA files in the directory LoadOrCreateCA is given: the certificate sandboxes trust, and its
// key (0600), which never leaves the node.
const (
	CAFile    = "egress-ca.pem"
	CAKeyFile = "egress-ca-key.pem"
)

// LoadOrCreateCA returns the node's egress CA from dir, making it (ECDSA P-256, ten years) on
// first use; certPEM is what sandboxes add to their trust store.
func LoadOrCreateCA(dir, name string) (ca tls.Certificate, certPEM []byte, err error) {
	certPath, keyPath := filepath.Join(dir, CAFile), filepath.Join(dir, CAKeyFile)
	if ca, err = tls.LoadX509KeyPair(certPath, keyPath); err == nil {
		certPEM, err = os.ReadFile(certPath)
		if err == nil {
			ca.Leaf, err = x509.ParseCertificate(ca.Certificate[0])
		}
		return ca, certPEM, err
	}
	if !errors.Is(err, os.ErrNotExist) {
		return tls.Certificate{}, nil, fmt.Errorf("egress CA in %s: %w", dir, err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, nil, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	if err != nil {
		return tls.Certificate{}, nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: "ember egress CA " + name, Organization: []string{"ember"}},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.AddDate(10, 0, 0),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return tls.Certificate{}, nil, err
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return tls.Certificate{}, nil, err
	}
	certPEM = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return tls.Certificate{}, nil, err
	}
	if err := os.WriteFile(keyPath, keyPEM, 0o600); err != nil {
		return tls.Certificate{}, nil, err
	}
	if err := os.WriteFile(certPath, certPEM, 0o600); err != nil { // daemon files are 0600 (TestEscapeHostUserReadsDataDir)
		return tls.Certificate{}, nil, err
	}
	if ca, err = tls.X509KeyPair(certPEM, keyPEM); err != nil {
		return tls.Certificate{}, nil, err
	}
	ca.Leaf, err = x509.ParseCertificate(der)
	return ca, certPEM, err
}
