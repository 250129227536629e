package e2e

import (
	"bufio"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/cluster/clustertest"
)

// etcdWork is what etcd's own counters (its /metrics, summed over the members) say it did.
type etcdWork struct {
	puts, deletes, txns, ranges, events, proposals float64
}

var etcdWorkMetrics = map[string]func(w *etcdWork) *float64{
	"etcd_mvcc_put_total":                   func(w *etcdWork) *float64 { return &w.puts },
	"etcd_mvcc_delete_total":                func(w *etcdWork) *float64 { return &w.deletes },
	"etcd_mvcc_txn_total":                   func(w *etcdWork) *float64 { return &w.txns },
	"etcd_mvcc_range_total":                 func(w *etcdWork) *float64 { return &w.ranges },
	"etcd_debugging_mvcc_events_total":      func(w *etcdWork) *float64 { return &w.events }, // sent to watchers
	"etcd_server_proposals_committed_total": func(w *etcdWork) *float64 { return &w.proposals },
}

// readEtcdWork scrapes every member's /metrics (its client URL, over TLS with a client cert).
func readEtcdWork(t *testing.T, e *clustertest.Etcd) etcdWork {
	t.Helper()
	hc := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: e.TLS()}}
	defer hc.CloseIdleConnections()
	var w etcdWork
	for i, ep := range e.Endpoints() {
		resp, err := hc.Get(strings.TrimSuffix(ep, "/") + "/metrics")
		if err != nil {
			t.Fatalf("etcd metrics: %v", err)
		}
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			name, val, ok := strings.Cut(sc.Text(), " ")
			f := etcdWorkMetrics[name]
			if !ok || f == nil {
				continue
			}
			v, err := strconv.ParseFloat(val, 64)
			if err != nil {
				t.Fatalf("etcd metrics: %q: %v", sc.Text(), err)
			}
			// Proposals are counted by every member alike: the leader's (any one) is enough.
			if name != "etcd_server_proposals_committed_total" || i == 0 {
				*f(&w) += v
			}
		}
		resp.Body.Close()
	}
	return w
}

func (w etcdWork) minus(o etcdWork) etcdWork {
	return etcdWork{w.puts - o.puts, w.deletes - o.deletes, w.txns - o.txns, w.ranges - o.ranges, w.events - o.events, w.proposals - o.proposals}
}

func (w etcdWork) per(n float64) etcdWork {
	return etcdWork{w.puts / n, w.deletes / n, w.txns / n, w.ranges / n, w.events / n, w.proposals / n}
}

// workRound is etcd's work per create (through the first node) and per kill (through the
// second), and its idle transactions per node and second.
type workRound struct {
	nodes          int
	create, kill   etcdWork
	idleTxnPerNode float64
}

// measureWork creates k sandboxes through nodes[0], then kills them through nodes[1], reading
// etcd's counters around each phase; first an idle window.
func measureWork(t *testing.T, e *clustertest.Etcd, nodes []*daemon, k int) workRound {
	t.Helper()
	r := workRound{nodes: len(nodes)}
	idle := 3 * time.Second
	w0 := readEtcdWork(t, e)
	t0 := time.Now()
	time.Sleep(idle)
	w1 := readEtcdWork(t, e)
	r.idleTxnPerNode = w1.minus(w0).txns / float64(len(nodes)) / time.Since(t0).Seconds()
	var ids []string
	for i := 0; i < k; i++ {
		var s sbx
		if code := nodes[0].api(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "base", "timeout": 300}, &s); code != 201 {
			t.Fatalf("create through %s: %d", nodes[0].nodeID, code)
		}
		ids = append(ids, s.SandboxID)
	}
	// The owners' reconcile runs after a create (it writes nothing when the allocation is
	// right): let it, so that its work counts where it belongs.
	time.Sleep(time.Second)
	w2 := readEtcdWork(t, e)
	for _, id := range ids {
		if code := nodes[1].api(t, "DELETE", "/sandboxes/"+id, nil, nil); code != 204 {
			t.Fatalf("kill %s through %s: %d", id, nodes[1].nodeID, code)
		}
	}
	time.Sleep(time.Second) // the owners' reconcile gives the room back
	w3 := readEtcdWork(t, e)
	r.create, r.kill = w2.minus(w1).per(float64(k)), w3.minus(w2).per(float64(k))
	t.Logf("%d nodes: per create %+v; per kill %+v; idle txns per node per second %.2f", r.nodes, r.create, r.kill, r.idleTxnPerNode)
	return r
}

// The work a create and a kill cost etcd does not grow with the number of nodes: real ember
// nodes (3, then 6) on a real etcd over TLS and the S3 server; etcd's own counters (watch
// events sent, puts, transactions) before and after creates through one edge and kills
// through another. Counts of work, not timings.
func TestClusterWorkPerOperationIsFlat(t *testing.T) {
	e, flags := storedClusterFlags(t, 1)
	nodes := addNodes(t, flags, nil, []string{"w1", "w2", "w3"}, 60)
	const k = 4
	three := measureWork(t, e, nodes, k)
	nodes = addNodes(t, flags, nodes, []string{"w4", "w5", "w6"}, 63)
	six := measureWork(t, e, nodes, k)
	t.Logf("| nodes | etcd writes (proposals) / create | puts / create | txns / create | watch events / create | events / kill | idle txns per node |")
	for _, r := range []workRound{three, six} {
		t.Logf("| %d | %.1f | %.1f | %.1f | %.1f | %.1f | %.2f/s |", r.nodes, r.create.proposals, r.create.puts, r.create.txns, r.create.events, r.kill.events, r.idleTxnPerNode)
	}
	for _, r := range []workRound{three, six} {
		if r.create.events > 5 || r.kill.events > 5 {
			t.Errorf("%d nodes: %.1f watch events per create, %.1f per kill, want <= 5", r.nodes, r.create.events, r.kill.events)
		}
	}
	// Not growing: six nodes cost what three did (half an operation of slack: a reconcile
	// that counted a create's reservation and its sandbox both rewrites the allocation twice).
	if six.create.events > three.create.events+0.5 || six.kill.events > three.kill.events+0.5 {
		t.Errorf("watch events grow with the nodes: per create %.1f at 3, %.1f at 6; per kill %.1f at 3, %.1f at 6",
			three.create.events, six.create.events, three.kill.events, six.kill.events)
	}
	if six.create.proposals > three.create.proposals+0.5 || six.create.puts > three.create.puts+0.5 {
		t.Errorf("writes per create grow with the nodes: %.1f (%.1f puts) at 3, %.1f (%.1f puts) at 6",
			three.create.proposals, three.create.puts, six.create.proposals, six.create.puts)
	}
}
