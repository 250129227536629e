package metrics_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/ember-sandbox/ember/internal/metrics"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

type source struct{}

func (source) List(ctx context.Context, f sandbox.ListFilter) ([]*sandbox.Sandbox, error) {
	return []*sandbox.Sandbox{{State: sandbox.StateRunning}, {State: sandbox.StateRunning}, {State: sandbox.StatePaused}}, nil
}

func (source) Pools(ctx context.Context) []sandbox.PoolState {
	// One template has a pool of each kind: the same template label, a different kind (a scrape
	// once failed with "collected before with the same name and label values").
	return []sandbox.PoolState{{TemplateID: "base", Kind: "restored", Ready: 2, Target: 3, Hits: 5, Misses: 1},
		{TemplateID: "base", Kind: "prestarted", Ready: 1, Target: 1}}
}

func (source) ListTemplates(ctx context.Context) ([]*sandbox.Template, error) {
	return []*sandbox.Template{{Kind: "template"}, {Kind: "snapshot", SnapshotState: sandbox.SnapshotUploading}, {Kind: "snapshot", SnapshotStored: true}}, nil
}

// scrape fetches the handler's exposition and parses it.
func scrape(t *testing.T, h http.Handler) map[string]*dto.MetricFamily {
	t.Helper()
	srv := httptest.NewServer(h)
	defer srv.Close()
	resp, err := http.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return fams
}

// value is the value of family name's sample whose label key is val.
func value(fams map[string]*dto.MetricFamily, name, key, val string) (float64, bool) {
	f := fams[name]
	if f == nil {
		return 0, false
	}
	for _, m := range f.GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == key && l.GetValue() == val {
				switch {
				case m.Gauge != nil:
					return m.GetGauge().GetValue(), true
				case m.Counter != nil:
					return m.GetCounter().GetValue(), true
				case m.Histogram != nil:
					return float64(m.GetHistogram().GetSampleCount()), true
				}
			}
		}
	}
	return 0, false
}

func TestExposition(t *testing.T) {
	m := metrics.New()
	m.SetSource(source{})
	m.ObserveStage(sandbox.StagePause, 40*time.Millisecond, nil)
	m.ObserveStage(sandbox.StagePause, 60*time.Millisecond, nil)
	m.ObserveStage(sandbox.StageResume, time.Second, errors.New("no"))
	fams := scrape(t, m.Handler())
	for _, c := range []struct {
		name, key, val string
		want           float64
	}{
		{"ember_stage_duration_seconds", "stage", "pause", 2},
		{"ember_stage_duration_seconds", "stage", "resume", 0},
		{"ember_stage_duration_seconds", "stage", "template_build", 0},
		{"ember_stage_failures_total", "stage", "resume", 1},
		{"ember_stage_failures_total", "stage", "pause", 0},
		{"ember_sandboxes", "state", "running", 2},
		{"ember_sandboxes", "state", "paused", 1},
		{"ember_pool_ready", "kind", "restored", 2},
		{"ember_pool_target", "kind", "restored", 3},
		{"ember_pool_hits_total", "kind", "restored", 5},
		{"ember_pool_ready", "kind", "prestarted", 1},
		{"ember_snapshots", "state", "uploading", 1},
		{"ember_snapshots", "state", "stored", 1},
	} {
		if got, ok := value(fams, c.name, c.key, c.val); !ok || got != c.want {
			t.Errorf("%s{%s=%q} = %v (present %v), want %v", c.name, c.key, c.val, got, ok, c.want)
		}
	}
	if f := fams["ember_placement_retries_total"]; f == nil || f.GetMetric()[0].GetCounter().GetValue() != 0 {
		t.Errorf("placement retries: %v", f)
	}
	if fams["go_goroutines"] == nil || fams["process_cpu_seconds_total"] == nil {
		t.Error("no Go runtime or process metrics")
	}
}
