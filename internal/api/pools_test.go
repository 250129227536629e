package api

import (
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// POST /ember/pools/{template}/warm sets a pool's floor and answers its state; GET /ember/pools
// shows it with the demand and the budget. Bad input is 400, an unknown template 404, a node
// without a pool 409.
func TestWarmPoolRoute(t *testing.T) {
	e := poolEnv(t)

	r := e.ctl("POST", "/ember/pools/base/warm", `{"count":4}`)
	if r.status != 200 {
		t.Fatalf("warm: %d %s", r.status, r.body)
	}
	var st sandbox.PoolState
	r.json(t, &st)
	if st.TemplateID != "base" || st.Kind != "restored" || st.Warm != 4 || st.Target != 4 || st.BudgetMB != 512 {
		t.Fatalf("warm answered %+v", st)
	}
	var all []sandbox.PoolState
	testutil.Eventually(t, 10*time.Second, "the pool warmed to 4", func() bool {
		all = nil
		e.ctl("GET", "/ember/pools", "").json(t, &all)
		return len(all) == 1 && all[0].Ready == 4
	})
	if all[0].InstanceMB <= 0 || all[0].UsedMB != 4*all[0].InstanceMB || len(all[0].SandboxIDs) != 4 {
		t.Fatalf("pool state %+v", all[0])
	}
	e.ctl("POST", "/ember/pools/base/warm", `{}`).wantError(t, 400)
	e.ctl("POST", "/ember/pools/base/warm", `{"count":-1}`).wantError(t, 400)
	e.ctl("POST", "/ember/pools/base/warm", `{"count":"x"}`).wantError(t, 400)
	e.ctl("POST", "/ember/pools/nosuch/warm", `{"count":1}`).wantError(t, 404)
	e.do("POST", "/ember/pools/base/warm", `{"count":1}`).wantError(t, 401)

	off := newEnv(t) // no pool
	off.ctl("POST", "/ember/pools/base/warm", `{"count":1}`).wantError(t, 409)
}

// poolEnv is an API over a node with a pool of restored sandboxes (one a template, 512 MiB).
func poolEnv(t *testing.T) *env {
	t.Helper()
	return newEnvWith(t, Config{Domain: testDomain}, func(c *sandbox.Config) { c.PoolSize = 1; c.PoolMemoryMB = 512 })
}
