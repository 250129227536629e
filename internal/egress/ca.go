package egress

import (
	"crypto/tls"
	"fmt"

	"github.com/ember-sandbox/ember/internal/tlsca"
)

// CA files in the directory LoadOrCreateCA is given: the certificate sandboxes trust, and its
// key, which never leaves the node (both 0600, like every daemon file).
const (
	CAFile    = "egress-ca.pem"
	CAKeyFile = "egress-ca-key.pem"
)

// LoadOrCreateCA returns the node's egress CA from dir, making it (tlsca.EnsureCA: ECDSA P-256,
// ten years, written atomically) on first use; certPEM is what sandboxes add to their trust
// store. A pair that does not load (cut short by a crash of a version that wrote it in place,
// or damaged) is replaced by a new CA rather than stopping the daemon: the CA is the node's
// own, and sandboxes that trusted the old one only fail closed (TLS to their rules' hosts
// does not verify) until they are made again; replaced reports it.
func LoadOrCreateCA(dir, name string) (ca tls.Certificate, certPEM []byte, replaced bool, err error) {
	c, err := tlsca.EnsureCA(dir, CAFile, CAKeyFile, "ember egress CA "+name)
	if err != nil {
		return tls.Certificate{}, nil, false, fmt.Errorf("egress CA in %s: %w", dir, err)
	}
	return c.Cert, c.CertPEM, c.Replaced, nil
}
