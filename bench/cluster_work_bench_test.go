package bench

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ember-sandbox/ember/internal/cluster/clustertest"
)

// The work the cluster asks of etcd, counted by etcd itself (its /metrics, summed over the
// members), per operation and per second, idle and under churn, at several node counts; the
// placement figures (lost races per create, latency) at a steady create rate with the CPU
// used next to each latency; and a model that projects the work to 1,000 nodes and 30,000
// sandboxes at 500 creates/s from the per-operation work measured.
//
// EMBER_SIM_WORK_NODES (3,6,100): the node counts; EMBER_SIM_WORK_OPS (60): creates, then
// kills, counted at each; EMBER_SIM_RATE (200): creates a second (and as many kills) in the
// paced phase; EMBER_SIM_PACED (10s): its length.

// etcdWork is a snapshot of etcd's counters.
type etcdWork struct {
	at     time.Time
	rev    int64              // the store's revision: one per write transaction
	keys   float64            // keys put or deleted (etcd_mvcc_put_total + delete_total, the largest member: each applies every write)
	events float64            // watch events sent (etcd_debugging_mvcc_events_total, summed)
	reqs   map[string]float64 // requests received, by gRPC method (grpc_server_msg_received_total, summed)
	bytes  float64            // client gRPC bytes sent and received (summed)
	cpuMe  float64            // this process's CPU seconds
	cpuEtc float64            // the etcd members' CPU seconds
}

func snapWork(ctx context.Context, admin *clientv3.Client, hc *http.Client, endpoints []string) etcdWork {
	w := etcdWork{at: time.Now(), reqs: map[string]float64{}}
	if r, err := admin.Get(ctx, "/clustertest/none"); err == nil {
		w.rev = r.Header.Revision
	}
	for _, ep := range endpoints {
		resp, err := hc.Get(ep + "/metrics")
		if err != nil {
			continue
		}
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
		resp.Body.Close()
		var keys float64
		for _, line := range strings.Split(string(body), "\n") {
			if strings.HasPrefix(line, "#") {
				continue
			}
			i := strings.LastIndexByte(line, ' ')
			if i < 0 {
				continue
			}
			v, err := strconv.ParseFloat(line[i+1:], 64)
			if err != nil {
				continue
			}
			name, labels, _ := strings.Cut(line[:i], "{")
			switch name {
			case "etcd_mvcc_put_total", "etcd_mvcc_delete_total":
				keys += v
			case "etcd_debugging_mvcc_events_total":
				w.events += v
			case "etcd_network_client_grpc_sent_bytes_total", "etcd_network_client_grpc_received_bytes_total":
				w.bytes += v
			case "grpc_server_msg_received_total":
				if _, m, ok := strings.Cut(labels, `grpc_method="`); ok {
					m, _, _ = strings.Cut(m, `"`)
					w.reqs[m] += v
				}
			}
		}
		w.keys = max(w.keys, keys)
	}
	w.cpuMe, w.cpuEtc = cpuSeconds()
	return w
}

// workDelta is the work between two snapshots, less the idle work of as long (idle may be nil).
type workDelta struct {
	secs                     float64
	writes, keys, events     float64
	txns, reqs, bytes        float64
	cpuMe, cpuEtcd           float64
	byKind                   map[string]float64
	perNodeTxns, perNodeReqs float64 // idle only
}

func diffWork(a, b etcdWork, idle *workDelta) workDelta {
	d := workDelta{secs: b.at.Sub(a.at).Seconds(), writes: float64(b.rev - a.rev), keys: b.keys - a.keys, events: b.events - a.events,
		bytes: b.bytes - a.bytes, cpuMe: b.cpuMe - a.cpuMe, cpuEtcd: b.cpuEtc - a.cpuEtc, byKind: map[string]float64{}}
	for k, v := range b.reqs {
		if dv := v - a.reqs[k]; dv > 0 {
			d.byKind[k] = dv
			d.reqs += dv
		}
	}
	d.txns = d.byKind["Txn"]
	if idle != nil && idle.secs > 0 {
		f := d.secs / idle.secs
		d.writes = max(0, d.writes-f*idle.writes)
		d.keys = max(0, d.keys-f*idle.keys)
		d.events = max(0, d.events-f*idle.events)
		d.txns = max(0, d.txns-f*idle.txns)
		d.reqs = max(0, d.reqs-f*idle.reqs)
		d.bytes = max(0, d.bytes-f*idle.bytes)
		for k, v := range d.byKind {
			d.byKind[k] = max(0, v-f*idle.byKind[k])
		}
	}
	return d
}

func (d workDelta) per(n float64) workDelta {
	o := d
	o.byKind = map[string]float64{}
	for k, v := range d.byKind {
		o.byKind[k] = v / n
	}
	o.writes, o.keys, o.events, o.txns, o.reqs, o.bytes = d.writes/n, d.keys/n, d.events/n, d.txns/n, d.reqs/n, d.bytes/n
	return o
}

func kinds(m map[string]float64) string {
	var ks []string
	for k, v := range m {
		if v >= 0.005 {
			ks = append(ks, fmt.Sprintf("%s %.2f", k, v))
		}
	}
	sort.Strings(ks)
	return strings.Join(ks, ", ")
}

// workRow is what one node count measured.
type workRow struct {
	nodes              int
	create, kill, idle workDelta
	// The paced phase.
	rate, achieved, killRate       float64
	creates, lost                  int64
	place, createLat               dist
	cpuMe, cpuEtcd, load1          float64
	pacedPerSec                    workDelta
	pacedCreate                    workDelta
	exhausted, otherErr, behindOps int64
}

func runSimWork(b *testing.B) {
	counts := []int{3, 6, 100}
	if v := os.Getenv("EMBER_SIM_WORK_NODES"); v != "" {
		counts = nil
		for _, f := range strings.Split(v, ",") {
			if n, err := strconv.Atoi(strings.TrimSpace(f)); err == nil && n >= 2 {
				counts = append(counts, n)
			}
		}
	}
	ops := simEnvInt("EMBER_SIM_WORK_OPS", 60)
	rate := float64(simEnvInt("EMBER_SIM_RATE", 200))
	paced := simEnvDur("EMBER_SIM_PACED", 10*time.Second)
	if etcdDir := os.Getenv("EMBER_SIM_ETCD_DIR"); etcdDir == "" {
		if fi, err := os.Stat("/dev/shm"); err == nil && fi.IsDir() {
			b.Setenv("TMPDIR", "/dev/shm")
		}
	} else if etcdDir != "disk" {
		b.Setenv("TMPDIR", etcdDir)
	}
	e := clustertest.Start(b, 3)
	admin := e.Client(b)
	var rows []workRow
	for _, n := range counts {
		rows = append(rows, workAt(b, e, admin, n, ops, rate, paced))
	}
	printWork(rows, ops, rate, paced)
}

func workAt(b *testing.B, e *clustertest.Etcd, admin *clientv3.Client, count, ops int, rate float64, paced time.Duration) workRow {
	ctx := context.Background()
	eps := e.Endpoints()
	hc := etcdHTTP(e)
	logs := &simLogs{n: map[string]int{}, ex: map[string]string{}}
	slots := max(1000, 2*int(rate*paced.Seconds())/count+ops)
	s := &sim{cfg: simConfig{name: fmt.Sprintf("work-%d", count), nodes: count, slots: slots, ttl: 10 * time.Second},
		prefix: fmt.Sprintf("/ember-w%d/", count), byID: map[string]*simNode{}, logs: logs, sampleEvery: 1 << 62}
	t0 := time.Now()
	s.join(b, ctx, e, count, slots, s.cfg.ttl)
	for _, n := range s.nodes {
		for len(n.cl.Live()) < count && time.Since(t0) < time.Minute {
			time.Sleep(20 * time.Millisecond)
		}
	}
	s.live = append([]*simNode(nil), s.nodes...)
	fmt.Fprintf(os.Stderr, "[sim work] %d nodes joined in %.1fs\n", count, time.Since(t0).Seconds())
	row := workRow{nodes: count, rate: rate}
	time.Sleep(3 * time.Second)       // the first reconcile rounds
	settle := 2500 * time.Millisecond // one reconcile round (2 s) and the watch
	// Idle.
	w0 := snapWork(ctx, admin, hc, eps)
	time.Sleep(6 * time.Second)
	w1 := snapWork(ctx, admin, hc, eps)
	row.idle = diffWork(w0, w1, nil)
	row.idle.perNodeTxns = row.idle.txns / row.idle.secs / float64(count)
	row.idle.perNodeReqs = row.idle.reqs / row.idle.secs / float64(count)
	// Creates, then kills, 4 at a time through random edges.
	parallel := func(n int, f func()) {
		var wg sync.WaitGroup
		var left atomic.Int64
		left.Store(int64(n))
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for left.Add(-1) >= 0 {
					f()
				}
			}()
		}
		wg.Wait()
	}
	w2 := snapWork(ctx, admin, hc, eps)
	c0 := s.creates.Load()
	parallel(ops, func() { _ = s.create(ctx) })
	time.Sleep(settle)
	w3 := snapWork(ctx, admin, hc, eps)
	row.create = diffWork(w2, w3, &row.idle).per(float64(max(1, s.creates.Load()-c0)))
	k0 := s.kills.Load()
	parallel(ops, func() { s.killOne(ctx) })
	time.Sleep(settle)
	w4 := snapWork(ctx, admin, hc, eps)
	row.kill = diffWork(w3, w4, &row.idle).per(float64(max(1, s.kills.Load()-k0)))

	// Paced: rate creates and rate kills a second, each in its own goroutine (at most 256 in
	// flight: beyond that the simulation is behind and says so).
	s.phase.Store(phaseChurn)
	retries0, creates0, kills0 := sumRetries(s.nodes), s.creates.Load(), s.kills.Load()
	exh0, other0 := s.exhausted.Load(), s.other.Load()
	sem := make(chan struct{}, 256)
	var wg sync.WaitGroup
	var behind atomic.Int64
	tick := time.Duration(float64(time.Second) / rate)
	w5 := snapWork(ctx, admin, hc, eps)
	start := time.Now()
	for i := 0; time.Since(start) < paced; i++ {
		if d := time.Until(start.Add(time.Duration(i) * tick)); d > 0 {
			time.Sleep(d)
		}
		for _, kill := range []bool{false, true} {
			select {
			case sem <- struct{}{}:
				wg.Add(1)
				go func() {
					defer func() { <-sem; wg.Done() }()
					if kill {
						s.killOne(ctx)
					} else {
						_ = s.create(ctx)
					}
				}()
			default:
				behind.Add(1)
			}
		}
	}
	wg.Wait()
	dur := time.Since(start)
	w6 := snapWork(ctx, admin, hc, eps)
	load, _ := os.ReadFile("/proc/loadavg")
	row.load1, _ = strconv.ParseFloat(strings.Fields(string(load) + " 0")[0], 64)
	row.creates = s.creates.Load() - creates0
	row.lost = sumRetries(s.nodes) - retries0
	row.achieved = float64(row.creates) / dur.Seconds()
	row.killRate = float64(s.kills.Load()-kills0) / dur.Seconds()
	row.place, row.createLat = s.placeLat[phaseChurn].get(), s.createLat[phaseChurn].get()
	all := diffWork(w5, w6, nil)
	row.cpuMe, row.cpuEtcd = all.cpuMe/all.secs, all.cpuEtcd/all.secs
	row.pacedPerSec = all.per(all.secs)
	row.pacedCreate = diffWork(w5, w6, &row.idle).per(float64(max(1, row.creates)))
	row.exhausted, row.otherErr, row.behindOps = s.exhausted.Load()-exh0, s.other.Load()-other0, behind.Load()
	fmt.Fprintf(os.Stderr, "[sim work] %d nodes measured in %.1fs\n", count, time.Since(t0).Seconds())
	for _, n := range s.nodes {
		_ = n.cl.Leave(ctx)
		n.close()
	}
	return row
}

// killOne kills a random sandbox through a random edge.
func (s *sim) killOne(ctx context.Context) { s.churnDo(ctx, 3) }

// fit is the least-squares line y = a + b·x through the points.
func fit(xs, ys []float64) (a, b float64) {
	n := float64(len(xs))
	var sx, sy, sxx, sxy float64
	for i := range xs {
		sx, sy, sxx, sxy = sx+xs[i], sy+ys[i], sxx+xs[i]*xs[i], sxy+xs[i]*ys[i]
	}
	if den := n*sxx - sx*sx; den != 0 {
		b = (n*sxy - sx*sy) / den
	}
	return (sy - b*sx) / n, b
}

func printWork(rows []workRow, ops int, rate float64, paced time.Duration) {
	fmt.Printf("\n== ember cluster work (etcd's own counters, 3-member etcd; per operation net of the idle work; %d creates then %d kills through random edges) ==\n", ops, ops)
	fmt.Printf("  %-6s %-14s %-12s %-20s %-12s %-12s %-11s %-14s %-14s %s\n", "nodes", "writes/create", "txns/create", "watch events/create", "events/kill", "writes/kill", "txns/kill", "bytes/create", "idle txns/node/s", "idle reqs/node/s")
	for _, r := range rows {
		fmt.Printf("  %-6d %-14.2f %-12.2f %-20.1f %-12.1f %-12.2f %-11.2f %-14.0f %-14.2f %.2f\n", r.nodes, r.create.writes, r.create.txns,
			r.create.events, r.kill.events, r.kill.writes, r.kill.txns, r.create.bytes, r.idle.perNodeTxns, r.idle.perNodeReqs)
	}
	for _, r := range rows {
		fmt.Printf("  requests by kind at %d nodes: create: %s | kill: %s | idle a node a second: %s\n", r.nodes,
			kinds(r.create.byKind), kinds(r.kill.byKind), kinds(r.idle.per(r.idle.secs*float64(r.nodes)).byKind))
	}
	fmt.Printf("\n== placement at %.0f creates/s and %.0f kills/s for %v (in-process nodes; CPU in cores used, this host has %d) ==\n", rate, rate, paced, numCPU())
	fmt.Printf("  %-6s %-18s %-18s %-26s %-26s %-22s %-8s %s\n", "nodes", "creates/s reached", "lost races/create", "place p50/p99 ms", "create p50/p99 ms", "CPU sim / etcd (cores)", "load1", "under churn: txns/s, events/s, writes/s, KiB/s")
	for _, r := range rows {
		lost := float64(r.lost) / float64(max(1, r.creates))
		fmt.Printf("  %-6d %-18s %-18.3f %-26s %-26s %-22s %-8.1f %.0f, %.0f, %.0f, %.0f\n", r.nodes, fmt.Sprintf("%.0f (%d)", r.achieved, r.creates), lost,
			ms(r.place.pct(0.5))+" / "+ms(r.place.pct(0.99)), ms(r.createLat.pct(0.5))+" / "+ms(r.createLat.pct(0.99)),
			fmt.Sprintf("%.2f / %.2f", r.cpuMe, r.cpuEtcd), r.load1,
			r.pacedPerSec.txns, r.pacedPerSec.events, r.pacedPerSec.writes, r.pacedPerSec.bytes/1024)
		if r.exhausted+r.otherErr+r.behindOps > 0 {
			fmt.Printf("         (%d exhausted, %d other errors, %d operations not started: the simulation was behind)\n", r.exhausted, r.otherErr, r.behindOps)
		}
	}
	if len(rows) < 2 {
		return
	}
	// The model: each per-operation figure as a + b·N through the points measured.
	const N, sbx, cps = 1000.0, 30000.0, 500.0
	var xs []float64
	col := func(f func(r workRow) float64) []float64 {
		var out []float64
		for _, r := range rows {
			out = append(out, f(r))
		}
		return out
	}
	for _, r := range rows {
		xs = append(xs, float64(r.nodes))
	}
	proj := func(name string, f func(r workRow) float64) float64 {
		a, bb := fit(xs, col(f))
		v := max(0, a+bb*N)
		fmt.Printf("  %-30s %8.3f + %8.4f·N  -> %10.2f at N=1000\n", name, a, bb, v)
		return v
	}
	fmt.Printf("\n== projection to %.0f nodes, %.0f sandboxes, %.0f creates/s (and as many kills: steady) ==\n", N, sbx, cps)
	fmt.Printf("  per-operation work fitted as a + b·N over N = %v:\n", xs)
	wc := proj("etcd writes / create", func(r workRow) float64 { return r.create.writes })
	wk := proj("etcd writes / kill", func(r workRow) float64 { return r.kill.writes })
	tc := proj("txns / create", func(r workRow) float64 { return r.create.txns })
	tk := proj("txns / kill", func(r workRow) float64 { return r.kill.txns })
	ec := proj("watch events / create", func(r workRow) float64 { return r.create.events })
	ek := proj("watch events / kill", func(r workRow) float64 { return r.kill.events })
	bc := proj("bytes / create", func(r workRow) float64 { return r.create.bytes })
	bk := proj("bytes / kill", func(r workRow) float64 { return r.kill.bytes })
	last := rows[len(rows)-1]
	lc := float64(last.lost) / float64(max(1, last.creates))
	var idleTxn, idleReq float64
	for _, r := range rows {
		idleTxn += r.idle.perNodeTxns / float64(len(rows))
		idleReq += r.idle.perNodeReqs / float64(len(rows))
	}
	fmt.Printf("  at N=1000 and %.0f creates/s + %.0f kills/s:\n", cps, cps)
	fmt.Printf("    etcd writes          %10.0f /s\n", cps*(wc+wk))
	fmt.Printf("    transactions         %10.0f /s  (+ %.0f /s idle: %.2f a node a second)\n", cps*(tc+tk), idleTxn*N, idleTxn)
	fmt.Printf("    all requests, idle   %10.0f /s  (%.2f a node a second: renewals, reconcile reads)\n", idleReq*N, idleReq)
	fmt.Printf("    watch events         %10.0f /s\n", cps*(ec+ek))
	fmt.Printf("    client bytes         %10.1f MiB/s\n", cps*(bc+bk)/(1<<20))
	fmt.Printf("    lost races           %10.0f /s  (%.3f a create, as measured at %d nodes: a block is reserved per several creates of an edge, so they do not grow with N)\n", cps*lc, lc, last.nodes)
	fmt.Printf("    sandboxes a node     %10.0f\n", sbx/N)
}

// etcdHTTP reads the members' /metrics (on their client URLs, TLS with a client certificate).
func etcdHTTP(e *clustertest.Etcd) *http.Client {
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: e.TLS()}}
}

func numCPU() int {
	b, _ := os.ReadFile("/proc/cpuinfo")
	return max(1, strings.Count(string(b), "processor\t:"))
}
