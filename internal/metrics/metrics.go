// Package metrics exposes a node's figures in Prometheus's format: lifecycle stage durations
// (histograms) and failures, which the sandbox Manager reports through its Observer hook, and
// the node's state (sandboxes by state, warm pools, snapshot uploads), read from the Manager
// at every scrape. The domain knows nothing of Prometheus; the daemon wires this package in.
package metrics

import (
	"context"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/ember-sandbox/ember/internal/quota"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// Source is what a scrape reads from the node (*sandbox.Manager implements it).
type Source interface {
	List(ctx context.Context, f sandbox.ListFilter) ([]*sandbox.Sandbox, error)
	Pools(ctx context.Context) []sandbox.PoolState
	ListTemplates(ctx context.Context) ([]*sandbox.Template, error)
}

// Buckets of the stage histograms (seconds): from a pool assignment (milliseconds) to a
// template build or a large upload (minutes).
var Buckets = []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600}

// Metrics is a node's registry. It implements sandbox.Observer.
type Metrics struct {
	reg      *prometheus.Registry
	stages   *prometheus.HistogramVec
	failures *prometheus.CounterVec
	retries  prometheus.Counter

	mu    sync.Mutex
	src   Source
	teams TeamSource
	store Store
}

// TeamSource reads every team's quota and usage (*quota.Quotas).
type TeamSource interface {
	All(ctx context.Context) ([]quota.TeamUsage, error)
}

// SetTeams sets what scrapes read the teams' quotas and usage from.
func (m *Metrics) SetTeams(t TeamSource) {
	m.mu.Lock()
	m.teams = t
	m.mu.Unlock()
}

// Store is what a scrape reads of the node's cluster store client (*cluster.Cluster).
type Store interface {
	// EtcdRequests counts the requests sent to etcd by kind (Range, Txn, LeaseKeepAlive, ...).
	EtcdRequests() map[string]int64
	// WatchEvents counts the watch events received.
	WatchEvents() int64
}

// New returns the registry of one node, with the Go runtime and process collectors.
func New() *Metrics {
	m := &Metrics{
		reg: prometheus.NewRegistry(),
		stages: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "ember", Name: "stage_duration_seconds",
			Help:    "Duration of the lifecycle stages that succeeded (create_pool, create_checkpoint, cold_boot, pause, resume, fork, snapshot_capture, snapshot_upload, template_build).",
			Buckets: Buckets,
		}, []string{"stage"}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "ember", Name: "stage_failures_total", Help: "Lifecycle stages that failed, by stage.",
		}, []string{"stage"}),
		retries: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "ember", Name: "placement_retries_total",
			Help: "Creates placed again on another node after a refusal (always 0 on a single node).",
		}),
	}
	for _, st := range sandbox.Stages {
		m.stages.WithLabelValues(string(st))
		m.failures.WithLabelValues(string(st))
	}
	m.reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		m.stages, m.failures, m.retries, &stateCollector{m: m})
	return m
}

// ObserveStage implements sandbox.Observer.
func (m *Metrics) ObserveStage(stage sandbox.Stage, took time.Duration, err error) {
	if err != nil {
		m.failures.WithLabelValues(string(stage)).Inc()
		return
	}
	m.stages.WithLabelValues(string(stage)).Observe(took.Seconds())
}

// PlacementRetry counts one create placed again elsewhere (cluster placement).
func (m *Metrics) PlacementRetry() { m.retries.Inc() }

// SetStore sets what scrapes read the node's etcd figures from (cluster mode).
func (m *Metrics) SetStore(st Store) {
	m.mu.Lock()
	m.store = st
	m.mu.Unlock()
}

// SetSource sets what scrapes read the node's state from (the Manager, once it exists).
func (m *Metrics) SetSource(src Source) {
	m.mu.Lock()
	m.src = src
	m.mu.Unlock()
}

// Handler serves the registry in Prometheus's exposition formats.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{Registry: m.reg})
}

var (
	descSandboxes = prometheus.NewDesc("ember_sandboxes", "Sandboxes on this node by state (pool instances not counted).", []string{"state"}, nil)
	descPoolReady = prometheus.NewDesc("ember_pool_ready", "Instances ready in a template's pool of that kind (restored sandboxes, pre-started instances, instances pre-started for resumes).", []string{"template", "kind"}, nil)
	descPoolTgt   = prometheus.NewDesc("ember_pool_target", "The size a template's warm pool is kept at now.", []string{"template", "kind"}, nil)
	descPoolHits  = prometheus.NewDesc("ember_pool_hits_total", "Creates served by a template's warm pool.", []string{"template", "kind"}, nil)
	descPoolMiss  = prometheus.NewDesc("ember_pool_misses_total", "Creates that found a template's warm pool empty.", []string{"template", "kind"}, nil)
	descPoolFill  = prometheus.NewDesc("ember_pool_refilling", "Refills of a template's warm pool in flight.", []string{"template", "kind"}, nil)
	descPoolRate  = prometheus.NewDesc("ember_pool_create_rate", "Creates per second a template's warm pool observes (exponentially weighted, decaying when idle).", []string{"template", "kind"}, nil)
	descPoolBurst = prometheus.NewDesc("ember_pool_burst", "The largest run of creates a template's warm pool could not absorb lately (halving every decay period).", []string{"template", "kind"}, nil)
	descPoolWarm  = prometheus.NewDesc("ember_pool_warm", "The floor an explicit warm-up set for a template's warm pool (0: none).", []string{"template", "kind"}, nil)
	descPoolCost  = prometheus.NewDesc("ember_pool_instance_bytes", "Memory one instance of a pool kind is counted at: its measured idle cost, or the estimate before one is measured.", []string{"kind"}, nil)
	descPoolBudg  = prometheus.NewDesc("ember_pool_memory_budget_bytes", "Memory all warm pools of this node may hold.", nil, nil)
	descPoolUsed  = prometheus.NewDesc("ember_pool_memory_used_bytes", "Memory the warm pools of this node hold or are making, each instance at its kind's cost.", nil, nil)
	descQuota     = prometheus.NewDesc("ember_team_quota", "A team's quota (0: no limit): sandboxes, cpus, memoryMB, pausedDiskMB, builds, templateDiskMB.", []string{"team", "quota"}, nil)
	descTeamUsed  = prometheus.NewDesc("ember_team_usage", "What a team holds on this node, in its quotas' units.", []string{"team", "quota"}, nil)
	descSnapshots = prometheus.NewDesc("ember_snapshots", "Named snapshots by the state of their image (uploading, stored, failed, local).", []string{"state"}, nil)
	descEtcdReqs  = prometheus.NewDesc("ember_etcd_requests_total", "Requests this node sent to etcd, by kind (the gRPC method: Range, Txn, Put, DeleteRange, LeaseGrant, LeaseKeepAlive, Watch, ...); cluster mode.", []string{"kind"}, nil)
	descEtcdWatch = prometheus.NewDesc("ember_etcd_watch_events_total", "Watch events this node received from etcd (cluster mode).", nil, nil)
)

// stateCollector reads the node's state at each scrape.
type stateCollector struct{ m *Metrics }

func (c *stateCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descSandboxes, descPoolReady, descPoolTgt, descPoolHits, descPoolMiss, descPoolFill, descPoolRate,
		descPoolBurst, descPoolWarm, descPoolCost, descPoolBudg, descPoolUsed, descSnapshots, descQuota, descTeamUsed, descEtcdReqs, descEtcdWatch} {
		ch <- d
	}
}

func (c *stateCollector) Collect(ch chan<- prometheus.Metric) {
	c.m.mu.Lock()
	src, teams, store := c.m.src, c.m.teams, c.m.store
	c.m.mu.Unlock()
	if store != nil {
		for kind, n := range store.EtcdRequests() {
			ch <- prometheus.MustNewConstMetric(descEtcdReqs, prometheus.CounterValue, float64(n), kind)
		}
		ch <- prometheus.MustNewConstMetric(descEtcdWatch, prometheus.CounterValue, float64(store.WatchEvents()))
	}
	if src == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if teams != nil {
		if tus, err := teams.All(ctx); err == nil {
			for _, tu := range tus {
				for _, f := range quotaFields(tu.Team.Quota, tu.Usage) {
					ch <- prometheus.MustNewConstMetric(descQuota, prometheus.GaugeValue, float64(f.limit), tu.Team.ID, f.name)
					ch <- prometheus.MustNewConstMetric(descTeamUsed, prometheus.GaugeValue, float64(f.used), tu.Team.ID, f.name)
				}
			}
		}
	}
	if sbs, err := src.List(ctx, sandbox.ListFilter{States: []sandbox.State{sandbox.StateRunning, sandbox.StatePaused}}); err == nil {
		n := map[sandbox.State]int{sandbox.StateRunning: 0, sandbox.StatePaused: 0}
		for _, sb := range sbs {
			n[sb.State]++
		}
		for st, v := range n {
			ch <- prometheus.MustNewConstMetric(descSandboxes, prometheus.GaugeValue, float64(v), string(st))
		}
	}
	costs := map[string]bool{}
	var budget, used float64
	for _, p := range src.Pools(ctx) {
		ch <- prometheus.MustNewConstMetric(descPoolReady, prometheus.GaugeValue, float64(p.Ready), p.TemplateID, p.Kind)
		ch <- prometheus.MustNewConstMetric(descPoolTgt, prometheus.GaugeValue, float64(p.Target), p.TemplateID, p.Kind)
		ch <- prometheus.MustNewConstMetric(descPoolHits, prometheus.CounterValue, float64(p.Hits), p.TemplateID, p.Kind)
		ch <- prometheus.MustNewConstMetric(descPoolMiss, prometheus.CounterValue, float64(p.Misses), p.TemplateID, p.Kind)
		if p.Kind == sandbox.PoolKindResume {
			continue // instances pre-started for resumes follow pauses, not demand
		}
		ch <- prometheus.MustNewConstMetric(descPoolFill, prometheus.GaugeValue, float64(p.RefillsInFlight), p.TemplateID, p.Kind)
		ch <- prometheus.MustNewConstMetric(descPoolRate, prometheus.GaugeValue, p.CreateRate, p.TemplateID, p.Kind)
		ch <- prometheus.MustNewConstMetric(descPoolBurst, prometheus.GaugeValue, p.Burst, p.TemplateID, p.Kind)
		ch <- prometheus.MustNewConstMetric(descPoolWarm, prometheus.GaugeValue, float64(p.Warm), p.TemplateID, p.Kind)
		if !costs[p.Kind] {
			costs[p.Kind] = true
			ch <- prometheus.MustNewConstMetric(descPoolCost, prometheus.GaugeValue, p.InstanceMB*(1<<20), p.Kind)
		}
		budget, used = float64(p.BudgetMB)*(1<<20), p.UsedMB*(1<<20)
	}
	if budget > 0 {
		ch <- prometheus.MustNewConstMetric(descPoolBudg, prometheus.GaugeValue, budget)
		ch <- prometheus.MustNewConstMetric(descPoolUsed, prometheus.GaugeValue, used)
	}
	if tpls, err := src.ListTemplates(ctx); err == nil {
		n := map[string]int{sandbox.SnapshotUploading: 0, sandbox.SnapshotStoredState: 0, sandbox.SnapshotFailed: 0, sandbox.SnapshotLocal: 0}
		for _, t := range tpls {
			if st := t.UploadState(); st != "" {
				n[st]++
			}
		}
		for st, v := range n {
			ch <- prometheus.MustNewConstMetric(descSnapshots, prometheus.GaugeValue, float64(v), st)
		}
	}
}

type quotaField struct {
	name        string
	limit, used int
}

func quotaFields(q, u quota.Usage) []quotaField {
	return []quotaField{
		{"sandboxes", q.Sandboxes, u.Sandboxes}, {"cpus", q.CPUs, u.CPUs}, {"memoryMB", q.MemoryMB, u.MemoryMB},
		{"pausedDiskMB", q.PausedDiskMB, u.PausedDiskMB}, {"builds", q.Builds, u.Builds}, {"templateDiskMB", q.TemplateDiskMB, u.TemplateDiskMB},
	}
}
