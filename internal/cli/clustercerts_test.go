package cli

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ember-sandbox/ember/internal/tlsca"
)

// `ember cluster certs` writes what etcd and each node need, and prints the flags to use them.
func TestClusterCertsCommand(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "certs")
	var code int
	out := captureStdout(t, func() { code = Main([]string{"cluster", "certs", "--dir", dir, "--nodes", "n1,n2"}) })
	if code != 0 {
		t.Fatalf("exit %d: %s", code, out)
	}
	for _, f := range []string{tlsca.ClusterCAFile, tlsca.ClusterCAKeyFile, tlsca.EtcdCertFile, tlsca.EtcdKeyFile,
		tlsca.NodeCertFile("n1"), tlsca.NodeKeyFile("n1"), tlsca.NodeCertFile("n2"), tlsca.NodeKeyFile("n2"), tlsca.ClusterSealingKey} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Errorf("%s: %v", f, err)
		}
	}
	for _, want := range []string{"--client-cert-auth", "--etcd-cert " + filepath.Join(dir, tlsca.NodeCertFile("n2")), "--cluster-key-file " + filepath.Join(dir, tlsca.ClusterSealingKey)} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	if code := Main([]string{"cluster", "certs", "--dir", dir, "--nodes", "../evil"}); code == 0 {
		t.Fatal("a node name with a path was accepted")
	}
}
