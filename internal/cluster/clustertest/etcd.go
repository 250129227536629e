// Package clustertest starts a real etcd cluster on loopback for tests: N members of the etcd
// server that scripts/setup.sh builds into <repo>/.cache/bin/etcd, each with its data in a test
// temporary directory, started within a bound and killed when the test ends. Members can be
// killed, restarted and frozen, and a Proxy stands between a client and the cluster so that a
// test can cut one node off while the others keep their connections.
//
// The cluster runs as ember's operators are told to run it: TLS on client and peer URLs, and
// client certificates required (--client-cert-auth), all issued by `ember cluster certs`
// (tlsca.MakeCluster) into the test's directory. ClientConfig gives a client of it; ServeFlags
// the flags an `ember serve` joins it with.
package clustertest

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/ember-sandbox/ember/internal/auth"

	"github.com/ember-sandbox/ember/internal/cluster"
	"github.com/ember-sandbox/ember/internal/testutil"
	"github.com/ember-sandbox/ember/internal/tlsca"
)

// Ports the members listen on: this range is the cluster work's own on shared hosts, 6 ports
// per 3-member cluster (a client and a peer port each). EMBER_ETCD_PORTS=LO-HI overrides it.
const (
	defaultPortLo = 18840
	defaultPortHi = 18899
)

// Binary returns the etcd binary ($EMBER_ETCD, else <repo>/.cache/bin/etcd) and whether it
// exists.
func Binary() (string, bool) {
	p := os.Getenv("EMBER_ETCD")
	if p == "" {
		p = filepath.Join(testutil.RepoRoot(), ".cache", "bin", "etcd")
	}
	fi, err := os.Stat(p)
	return p, err == nil && !fi.IsDir()
}

// Etcd is a running test cluster.
type Etcd struct {
	t       testing.TB
	bin     string
	members []*member
	initial string
	certs   string      // tlsca.MakeCluster's directory
	tls     *tls.Config // a client's, with the node certificate
	// anyClient: etcd takes clients without a certificate (StartOpen).
	anyClient bool
}

// NodeName is the node the certificate of ClientConfig and ServeFlags is issued to.
const NodeName = "node"

type member struct {
	name, dir    string
	client, peer int
	mu           sync.Mutex
	cmd          *exec.Cmd
	exited       chan struct{}
	logs         *testutil.LogBuffer
}

// Start runs an n-member cluster and waits until it serves writes (30 s bound). Without the
// binary the test skips (fails in CI).
func Start(t testing.TB, n int) *Etcd {
	t.Helper()
	return startWith(t, n, false)
}

// StartOpen is Start with etcd taking clients without a certificate (TLS still): what ember
// refuses to join.
func StartOpen(t testing.TB, n int) *Etcd {
	t.Helper()
	return startWith(t, n, true)
}

func startWith(t testing.TB, n int, anyClient bool) *Etcd {
	t.Helper()
	bin, ok := Binary()
	testutil.Need(t, ok, "etcd "+bin+" not installed: run scripts/setup.sh")
	var last error
	for attempt := 0; attempt < 4; attempt++ {
		e, err := start(t, bin, n, anyClient)
		if err == nil {
			return e
		}
		last = err
	}
	t.Fatalf("etcd did not start: %v", last)
	return nil
}

func start(t testing.TB, bin string, n int, anyClient bool) (*Etcd, error) {
	ports, err := freePorts(2 * n)
	if err != nil {
		return nil, err
	}
	e := &Etcd{t: t, bin: bin, certs: t.TempDir(), anyClient: anyClient}
	if _, err := tlsca.MakeCluster(tlsca.ClusterOptions{Dir: e.certs, Hosts: []string{"localhost", "127.0.0.1"}, Nodes: []string{NodeName}}); err != nil {
		return nil, err
	}
	f := e.Files()
	if e.tls, err = cluster.ClientTLS([]string{"https://127.0.0.1:1"}, f); err != nil {
		return nil, err
	}
	var initial []string
	for i := 0; i < n; i++ {
		m := &member{name: fmt.Sprintf("m%d", i), dir: t.TempDir(), client: ports[2*i], peer: ports[2*i+1]}
		e.members = append(e.members, m)
		initial = append(initial, fmt.Sprintf("%s=https://127.0.0.1:%d", m.name, m.peer))
	}
	register(e.Endpoints(), e.tls)
	t.Cleanup(func() { unregister(e.Endpoints()) })
	e.initial = strings.Join(initial, ",")
	t.Cleanup(e.stopAll)
	for _, m := range e.members {
		if err := e.run(m, "new"); err != nil {
			e.stopAll()
			return nil, err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := e.Client(t)
	for {
		wctx, wcancel := context.WithTimeout(ctx, time.Second)
		_, err := c.Put(wctx, "/clustertest/ready", "1")
		wcancel()
		if err == nil {
			return e, nil
		}
		if ctx.Err() != nil {
			out := ""
			for _, m := range e.members {
				out += "--- " + m.name + "\n" + m.logs.String()
			}
			e.stopAll()
			return nil, fmt.Errorf("no write within 30 s (%v); logs:\n%s", err, out)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (e *Etcd) run(m *member, state string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	client := fmt.Sprintf("https://127.0.0.1:%d", m.client)
	peer := fmt.Sprintf("https://127.0.0.1:%d", m.peer)
	ca, cert, key := filepath.Join(e.certs, tlsca.ClusterCAFile), filepath.Join(e.certs, tlsca.EtcdCertFile), filepath.Join(e.certs, tlsca.EtcdKeyFile)
	m.logs = &testutil.LogBuffer{}
	clientAuth := []string{"--client-cert-auth", "--trusted-ca-file", ca}
	if e.anyClient {
		clientAuth = nil
	}
	cmd := exec.Command(e.bin,
		"--name", m.name, "--data-dir", filepath.Join(m.dir, "data"),
		"--listen-client-urls", client, "--advertise-client-urls", client,
		"--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
		"--initial-cluster", e.initial, "--initial-cluster-state", state,
		"--initial-cluster-token", "clustertest",
		"--cert-file", cert, "--key-file", key,
		"--peer-client-cert-auth", "--peer-trusted-ca-file", ca, "--peer-cert-file", cert, "--peer-key-file", key,
		// Fast elections: loopback round trips are well under a millisecond.
		"--heartbeat-interval", "50", "--election-timeout", "500",
		"--log-level", "warn", "--quota-backend-bytes", strconv.Itoa(2<<30))
	cmd.Args = append(cmd.Args, clientAuth...)
	cmd.Stdout, cmd.Stderr = m.logs, m.logs
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return err
	}
	m.cmd = cmd
	m.exited = make(chan struct{})
	go func(ch chan struct{}) { cmd.Wait(); close(ch) }(m.exited)
	if !testutil.WaitListening(fmt.Sprintf("127.0.0.1:%d", m.client), m.exited, 15*time.Second) {
		cmd.Process.Kill()
		<-m.exited
		return fmt.Errorf("member %s did not listen on %d: %s", m.name, m.client, m.logs.String())
	}
	return nil
}

// Endpoints are the members' client URLs.
func (e *Etcd) Endpoints() []string {
	var out []string
	for _, m := range e.members {
		out = append(out, fmt.Sprintf("https://127.0.0.1:%d", m.client))
	}
	return out
}

// CertDir is the directory `ember cluster certs` made the cluster's certificates in.
func (e *Etcd) CertDir() string { return e.certs }

// Files are the credentials of NodeName.
func (e *Etcd) Files() cluster.TLSFiles {
	return cluster.TLSFiles{CA: filepath.Join(e.certs, tlsca.ClusterCAFile),
		Cert: filepath.Join(e.certs, tlsca.NodeCertFile(NodeName)), Key: filepath.Join(e.certs, tlsca.NodeKeyFile(NodeName))}
}

// KeyFile is the cluster sealing key file.
func (e *Etcd) KeyFile() string { return filepath.Join(e.certs, tlsca.ClusterSealingKey) }

// ServeFlags are the flags of an `ember serve` joining the cluster (endpoints, certificates,
// sealing key).
func (e *Etcd) ServeFlags() []string {
	f := e.Files()
	return []string{"--etcd-endpoints", strings.Join(e.Endpoints(), ","), "--etcd-ca", f.CA, "--etcd-cert", f.Cert,
		"--etcd-key", f.Key, "--cluster-key-file", e.KeyFile()}
}

// TLS is a client's TLS configuration (with the node certificate).
func (e *Etcd) TLS() *tls.Config { return e.tls.Clone() }

// Client returns a client of the whole cluster, closed when the test ends.
func (e *Etcd) Client(t testing.TB) *clientv3.Client {
	t.Helper()
	c, err := clientv3.New(ClientConfig(e.Endpoints()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

var (
	regMu sync.Mutex
	reg   = map[string]*tls.Config{}
)

func register(endpoints []string, c *tls.Config) {
	regMu.Lock()
	defer regMu.Unlock()
	for _, ep := range endpoints {
		reg[ep] = c
	}
}

func unregister(endpoints []string) {
	regMu.Lock()
	defer regMu.Unlock()
	for _, ep := range endpoints {
		delete(reg, ep)
	}
}

// ClientConfig is the configuration of a client of endpoints: a test cluster's (or a Proxy's
// to one), with its TLS and the node certificate.
func ClientConfig(endpoints []string) clientv3.Config {
	regMu.Lock()
	defer regMu.Unlock()
	var c *tls.Config
	if len(endpoints) > 0 {
		if c = reg[endpoints[0]]; c != nil {
			c = c.Clone()
		}
	}
	return clientv3.Config{Endpoints: endpoints, DialTimeout: 5 * time.Second, Logger: zap.NewNop(), TLS: c}
}

// Leader returns the index of the member that leads now (-1 if none answers).
func (e *Etcd) Leader(c *clientv3.Client) int {
	for i, ep := range e.Endpoints() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		st, err := c.Status(ctx, ep)
		cancel()
		if err == nil && st.Leader == st.Header.MemberId {
			return i
		}
	}
	return -1
}

// Kill stops member i at once (SIGKILL).
func (e *Etcd) Kill(i int) {
	m := e.members[i]
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.cmd != nil {
		m.cmd.Process.Kill()
		<-m.exited
		m.cmd = nil
	}
}

// Restart starts a killed member again on its data.
func (e *Etcd) Restart(i int) {
	e.t.Helper()
	if err := e.run(e.members[i], "existing"); err != nil {
		e.t.Fatal(err)
	}
}

// Freeze stops (SIGSTOP) every member: the cluster answers nothing until Thaw.
func (e *Etcd) Freeze() { e.signal(syscall.SIGSTOP) }

// Thaw resumes frozen members.
func (e *Etcd) Thaw() { e.signal(syscall.SIGCONT) }

func (e *Etcd) signal(sig syscall.Signal) {
	for _, m := range e.members {
		m.mu.Lock()
		if m.cmd != nil {
			m.cmd.Process.Signal(sig)
		}
		m.mu.Unlock()
	}
}

func (e *Etcd) stopAll() {
	for _, m := range e.members {
		m.mu.Lock()
		if m.cmd != nil {
			m.cmd.Process.Signal(syscall.SIGCONT)
			m.cmd.Process.Kill()
			<-m.exited
			m.cmd = nil
		}
		m.mu.Unlock()
	}
}

// freePorts picks n ports of the range that nothing listens on now.
func freePorts(n int) ([]int, error) {
	lo, hi := defaultPortLo, defaultPortHi
	if v := os.Getenv("EMBER_ETCD_PORTS"); v != "" {
		a, b, _ := strings.Cut(v, "-")
		lo, _ = strconv.Atoi(a)
		hi, _ = strconv.Atoi(b)
	}
	var out []int
	var held []net.Listener
	defer func() {
		for _, l := range held {
			l.Close()
		}
	}()
	start := lo + rand.IntN(hi-lo+1)
	for i := 0; i <= hi-lo && len(out) < n; i++ {
		p := lo + (start-lo+i)%(hi-lo+1)
		l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
		if err != nil {
			continue
		}
		held = append(held, l)
		out = append(out, p)
	}
	if len(out) < n {
		return nil, fmt.Errorf("fewer than %d free ports in %d-%d", n, lo, hi)
	}
	return out, nil
}

// QuotaBlocks sums the blocks of team's quota the nodes hold (cluster/quota.go) as c reads
// them now; ok false when etcd could not be read.
func QuotaBlocks(ctx context.Context, c *clientv3.Client, team string) (sum auth.Quota, ok bool) {
	resp, err := c.Get(ctx, "/ember/quota/"+team+"/", clientv3.WithPrefix())
	if err != nil {
		return auth.Quota{}, false
	}
	for _, kv := range resp.Kvs {
		var q auth.Quota
		if json.Unmarshal(kv.Value, &q) == nil {
			sum.Sandboxes += q.Sandboxes
			sum.CPUs += q.CPUs
			sum.MemoryMB += q.MemoryMB
			sum.PausedDiskMB += q.PausedDiskMB
			sum.Builds += q.Builds
		}
	}
	return sum, true
}
