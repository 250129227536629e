// Package s3test starts a real S3-compatible server on loopback for tests: the Versity S3
// Gateway (versitygw) with its posix backend, which checks SigV4 signatures like AWS does. It is
// installed at a pinned version into <repo>/.cache/bin by scripts/setup-s3.sh. The package owns
// only the server process and the temporary data directory it gives it.
package s3test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/snapshot/s3"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// BinaryName is the server binary scripts/setup-s3.sh installs.
const BinaryName = "versitygw"

// The server's root credentials and region.
const (
	AccessKey = "ember-test"
	SecretKey = "ember-test-secret"
	Region    = "us-east-1"
)

// Binary returns the S3 server binary ($EMBER_S3_SERVER, else <repo>/.cache/bin/versitygw) and
// whether it exists.
func Binary() (string, bool) {
	p := os.Getenv("EMBER_S3_SERVER")
	if p == "" {
		p = filepath.Join(testutil.RepoRoot(), ".cache", "bin", BinaryName)
	}
	fi, err := os.Stat(p)
	return p, err == nil && !fi.IsDir()
}

// Start runs a fresh server on 127.0.0.1 with an empty data directory, waits until it answers,
// creates a bucket, and stops the server when the test ends. It returns a config for the
// bucket. Without the binary the test skips (fails in CI).
func Start(t testing.TB) s3.Config {
	t.Helper()
	cfg, _ := start(t, false, false)
	return cfg
}

// StartVolumeLimits is Start with the server set up as a cluster's volume disk limits need
// (internal/volume/limit.go): --disableotmp (an object is written in the bucket's temporary
// directory, then renamed or, into another filesystem, copied into place) and --sidecar (the
// objects' metadata in a directory of its own, which a copy keeps). It also returns the
// directory that is the bucket (a key prefix is a directory in it).
func StartVolumeLimits(t testing.TB) (s3.Config, string) {
	t.Helper()
	cfg, data := start(t, false, true)
	return cfg, filepath.Join(data, cfg.Bucket)
}

// StartTLS is Start with HTTPS, using a fresh self-signed certificate for 127.0.0.1 whose PEM
// file the returned config names as CAFile.
func StartTLS(t testing.TB) s3.Config {
	t.Helper()
	cfg, _ := start(t, true, false)
	return cfg
}

func start(t testing.TB, useTLS, volumeLimits bool) (s3.Config, string) {
	t.Helper()
	bin, ok := Binary()
	testutil.Need(t, ok, "S3 test server "+bin+" not installed: run scripts/setup-s3.sh")

	var tlsArgs []string
	var caFile string
	if useTLS {
		certFile, keyFile := selfSigned(t)
		tlsArgs = []string{"--cert", certFile, "--key", keyFile}
		caFile = certFile
	}
	data := t.TempDir()
	var posixArgs []string
	if volumeLimits {
		posixArgs = []string{"--disableotmp", "--sidecar", t.TempDir()}
	}
	var (
		cmd  *exec.Cmd
		addr string
		logs = &testutil.LogBuffer{}
	)
	// A free port can be taken between probing and binding; retry a few times.
	for attempt := 0; ; attempt++ {
		addr = freeAddr(t)
		args := append([]string{"--access", AccessKey, "--secret", SecretKey, "--region", Region,
			"--port", addr, "--quiet"}, tlsArgs...)
		cmd = exec.Command(bin, append(append(append(args, "posix"), posixArgs...), data)...)
		cmd.Stdout, cmd.Stderr = logs, logs
		if err := cmd.Start(); err != nil {
			t.Fatalf("start %s: %v", bin, err)
		}
		exited := make(chan struct{})
		go func() { cmd.Wait(); close(exited) }()
		t.Cleanup(func() {
			cmd.Process.Kill()
			<-exited
		})
		if testutil.WaitListening(addr, exited, 15*time.Second) {
			break
		}
		if attempt == 3 {
			t.Fatalf("S3 test server did not start on %s; its output:\n%s", addr, logs.String())
		}
	}

	cfg := s3.Config{
		Endpoint:  addr,
		Bucket:    "ember-test",
		AccessKey: AccessKey,
		SecretKey: SecretKey,
		Region:    Region,
		PathStyle: true,
		TLS:       useTLS,
		CAFile:    caFile,
	}
	b, err := s3.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	for {
		err := b.EnsureBucket(ctx)
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("create bucket on %s: %v; server output:\n%s", addr, err, logs.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	return cfg, data
}

// selfSigned writes a certificate and key for 127.0.0.1 and returns their files.
func selfSigned(t testing.TB) (certFile, keyFile string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "ember s3 test"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IPAddresses:           []net.IP{net.IPv4(127, 0, 0, 1)},
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	certFile, keyFile = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	if err := os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), 0o600); err != nil {
		t.Fatal(err)
	}
	return certFile, keyFile
}

func freeAddr(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return "127.0.0.1:" + strconv.Itoa(l.Addr().(*net.TCPAddr).Port)
}
