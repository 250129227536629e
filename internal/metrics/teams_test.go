package metrics_test

import (
	"context"
	"testing"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/metrics"
	"github.com/ember-sandbox/ember/internal/quota"
)

type teams struct{}

func (teams) All(context.Context) ([]quota.TeamUsage, error) {
	return []quota.TeamUsage{{Team: &auth.Team{ID: "team-b", Quota: auth.Quota{Sandboxes: 3, CPUs: 4}}, Usage: quota.Usage{Sandboxes: 2, CPUs: 2}}}, nil
}

// Every team's quotas and usage are on /metrics.
func TestTeamQuotasAreExposed(t *testing.T) {
	m := metrics.New()
	m.SetSource(source{})
	m.SetTeams(teams{})
	fams := scrape(t, m.Handler())
	got := map[string]float64{}
	for _, name := range []string{"ember_team_quota", "ember_team_usage"} {
		f := fams[name]
		if f == nil {
			t.Fatalf("%s missing", name)
		}
		for _, mt := range f.Metric {
			lb := map[string]string{}
			for _, l := range mt.Label {
				lb[l.GetName()] = l.GetValue()
			}
			got[name+"/"+lb["team"]+"/"+lb["quota"]] = mt.GetGauge().GetValue()
		}
	}
	for k, want := range map[string]float64{"ember_team_quota/team-b/sandboxes": 3, "ember_team_quota/team-b/cpus": 4,
		"ember_team_usage/team-b/sandboxes": 2, "ember_team_quota/team-b/memoryMB": 0} {
		if got[k] != want {
			t.Errorf("%s = %v, want %v (all: %v)", k, got[k], want, got)
		}
	}
}
