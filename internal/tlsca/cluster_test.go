package tlsca

import (
	"bytes"
	"crypto/x509"
	"os"
	"path/filepath"
	"testing"
)

// `ember cluster certs` run again adds nodes and keeps what fits: the CA, etcd's certificate and
// above all the sealing key (what etcd holds is sealed with it). The node certificates are for
// clients only and chain to the CA; etcd's is for its hosts.
func TestMakeClusterCompletes(t *testing.T) {
	dir := t.TempDir()
	if _, err := MakeCluster(ClusterOptions{Dir: dir, Hosts: []string{"etcd.example", "10.0.0.5"}, Nodes: []string{"a"}}); err != nil {
		t.Fatal(err)
	}
	read := func(name string) []byte {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	ca, key, etcd := read(ClusterCAFile), read(ClusterSealingKey), read(EtcdCertFile)
	res, err := MakeCluster(ClusterOptions{Dir: dir, Hosts: []string{"etcd.example", "10.0.0.5"}, Nodes: []string{"a", "b"}})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Written) != 1 || res.Written[0] != filepath.Join(dir, NodeCertFile("b")) {
		t.Fatalf("second run wrote %v, want only node b's certificate", res.Written)
	}
	if !bytes.Equal(ca, read(ClusterCAFile)) || !bytes.Equal(key, read(ClusterSealingKey)) || !bytes.Equal(etcd, read(EtcdCertFile)) {
		t.Fatal("the CA, etcd's certificate or the sealing key changed")
	}
	if fi, _ := os.Stat(filepath.Join(dir, ClusterSealingKey)); fi.Mode().Perm() != 0o600 {
		t.Fatalf("sealing key mode %v", fi.Mode().Perm())
	}
	caCert, _, err := loadPair(filepath.Join(dir, ClusterCAFile), filepath.Join(dir, ClusterCAKeyFile))
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AddCert(caCert)
	node, _, err := loadPair(filepath.Join(dir, NodeCertFile("b")), filepath.Join(dir, NodeKeyFile("b")))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := node.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		t.Fatalf("node certificate: %v", err)
	}
	if _, err := node.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err == nil {
		t.Fatal("a node certificate works as a server's")
	}
	srv, _, _ := loadPair(filepath.Join(dir, EtcdCertFile), filepath.Join(dir, EtcdKeyFile))
	if _, err := srv.Verify(x509.VerifyOptions{Roots: roots, DNSName: "etcd.example"}); err != nil {
		t.Fatalf("etcd certificate: %v", err)
	}
	// New hosts: etcd's certificate again, the rest kept.
	res, err = MakeCluster(ClusterOptions{Dir: dir, Hosts: []string{"etcd2.example"}, Nodes: []string{"a", "b"}})
	if err != nil || len(res.Written) != 1 || res.Written[0] != filepath.Join(dir, EtcdCertFile) {
		t.Fatalf("new hosts: wrote %v (%v), want etcd's certificate only", res.Written, err)
	}
	if _, err := MakeCluster(ClusterOptions{Dir: dir, Nodes: []string{"../x"}}); err == nil {
		t.Fatal("a node name with a path was accepted")
	}
}
