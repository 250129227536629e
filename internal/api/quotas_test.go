package api

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
)

// setQuota sets team's quota as the admin key does.
func (e *env) setQuota(team, q string) {
	e.t.Helper()
	if r := e.ctl("PUT", "/ember/teams/"+team+"/quota", q); r.status != http.StatusOK {
		e.t.Fatalf("set quota %s: %d %s", q, r.status, r.body)
	}
}

// want429 asserts a quota's refusal: 429 with Retry-After, naming the quota.
func want429(t *testing.T, r resp, quota string) {
	t.Helper()
	r.wantError(t, http.StatusTooManyRequests)
	if !strings.Contains(string(r.body), "(quota "+quota+")") || r.header.Get("Retry-After") == "" {
		t.Fatalf("want a 429 naming quota %s with Retry-After; got %s %v", quota, r.body, r.header)
	}
}

func (e *env) createAs(key string) string {
	e.t.Helper()
	r := e.as(key, "POST", "/sandboxes", `{"templateID":"base"}`)
	if r.status != http.StatusCreated {
		e.t.Fatalf("create: %d %s", r.status, r.body)
	}
	var sj sandboxJSON
	r.json(e.t, &sj)
	return sj.SandboxID
}

func baseResources(t *testing.T, e *env) (cpu, mem, disk int) {
	var ts []templateJSON
	e.ctl("GET", "/templates", "").json(t, &ts)
	for _, tj := range ts {
		if tj.TemplateID == "base" {
			return int(tj.CPUCount), int(tj.MemoryMB), int(tj.DiskSizeMB)
		}
	}
	t.Fatal("no base template")
	return
}

func TestQuotaSandboxes(t *testing.T) {
	e, b, bt := teamEnv(t)
	e.setQuota(bt, `{"sandboxes":1}`)
	id := e.createAs(b)
	r := e.as(b, "POST", "/sandboxes", `{"templateID":"base"}`)
	want429(t, r, "sandboxes")
	if !strings.Contains(string(r.body), "maximum number of concurrent E2B sandboxes (1)") {
		t.Fatalf("not E2B's words: %s", r.body)
	}
	// Another team is not held by it; and the team's own kill makes room.
	e.createAs(e.key)
	if r := e.as(b, "DELETE", "/sandboxes/"+id, ""); r.status != http.StatusNoContent {
		t.Fatalf("kill: %d %s", r.status, r.body)
	}
	e.createAs(b)
	var u teamUsageJSON
	e.as(b, "GET", "/ember/teams/"+bt+"/usage", "").json(t, &u)
	if u.Usage.Sandboxes != 1 || u.Quota.Sandboxes != 1 {
		t.Fatalf("usage: %+v", u)
	}
}

func TestQuotaCPUsAndMemory(t *testing.T) {
	e, b, bt := teamEnv(t)
	cpu, mem, _ := baseResources(t, e)
	e.setQuota(bt, `{"cpus":`+itoa(int64(cpu))+`}`)
	e.createAs(b)
	want429(t, e.as(b, "POST", "/sandboxes", `{"templateID":"base"}`), "cpus")

	e2, b2, bt2 := teamEnv(t)
	e2.setQuota(bt2, `{"memoryMB":`+itoa(int64(mem))+`}`)
	e2.createAs(b2)
	want429(t, e2.as(b2, "POST", "/sandboxes", `{"templateID":"base"}`), "memoryMB")
}

func TestQuotaPausedDiskAndResume(t *testing.T) {
	e, b, bt := teamEnv(t)
	_, _, disk := baseResources(t, e)
	e.setQuota(bt, `{"pausedDiskMB":`+itoa(int64(disk))+`,"sandboxes":2}`)
	id1, id2 := e.createAs(b), e.createAs(b)
	if r := e.as(b, "POST", "/sandboxes/"+id1+"/pause", ""); r.status != http.StatusNoContent {
		t.Fatalf("pause: %d %s", r.status, r.body)
	}
	want429(t, e.as(b, "POST", "/sandboxes/"+id2+"/pause", ""), "pausedDiskMB")
	// With id1 paused, a new sandbox fits; then the resume of id1 does not.
	e.createAs(b)
	want429(t, e.as(b, "POST", "/sandboxes/"+id1+"/connect", `{"timeout":60}`), "sandboxes")
}

func TestQuotaBuildsAndTemplateDisk(t *testing.T) {
	e, b, bt := teamEnv(t)
	_, _, disk := baseResources(t, e)
	e.setQuota(bt, `{"builds":1}`)
	if r := e.as(b, "POST", "/v3/templates", `{"name":"one"}`); r.status != http.StatusAccepted {
		t.Fatalf("first build: %d %s", r.status, r.body)
	}
	want429(t, e.as(b, "POST", "/v3/templates", `{"name":"two"}`), "builds")

	e.setQuota(bt, `{"templateDiskMB":`+itoa(int64(disk))+`}`)
	id := e.createAs(b)
	if r := e.as(b, "POST", "/sandboxes/"+id+"/snapshots", `{}`); r.status != http.StatusCreated {
		t.Fatalf("first snapshot: %d %s", r.status, r.body)
	}
	want429(t, e.as(b, "POST", "/sandboxes/"+id+"/snapshots", `{}`), "templateDiskMB")
}

func TestQuotaIsShownAndAdminOnly(t *testing.T) {
	e, b, bt := teamEnv(t)
	e.as(b, "PUT", "/ember/teams/"+bt+"/quota", `{"sandboxes":5}`).wantError(t, http.StatusForbidden)
	e.ctl("PUT", "/ember/teams/"+bt+"/quota", `{"sandboxes":-1}`).wantError(t, http.StatusBadRequest)
	e.setQuota(bt, `{"sandboxes":5,"cpus":8}`)
	var tj map[string]json.RawMessage
	e.as(b, "GET", "/ember/teams/"+bt, "").json(t, &tj)
	if !strings.Contains(string(tj["quota"]), `"sandboxes":5`) || !strings.Contains(string(tj["quota"]), `"cpus":8`) {
		t.Fatalf("team: %s", tj["quota"])
	}
}

// Forks and snapshots from step checkpoints, and the rollback of a paused sandbox (which runs
// it again), are held to the team's quotas as their counterparts from the sandbox now are.
func TestQuotaCheckpointForksSnapshotsAndRollback(t *testing.T) {
	e, b, bt := teamEnv(t)
	_, _, disk := baseResources(t, e)
	e.setQuota(bt, `{"sandboxes":1,"templateDiskMB":`+itoa(int64(disk))+`}`)
	id := e.createAs(b)
	var c checkpointJSON
	if r := e.as(b, "POST", "/sandboxes/"+id+"/checkpoints", ""); r.status != http.StatusCreated {
		t.Fatalf("checkpoint: %d %s", r.status, r.body)
	} else {
		r.json(t, &c)
	}
	want429(t, e.as(b, "POST", "/sandboxes/"+id+"/fork", `{"count":1,"checkpointID":"`+c.CheckpointID+`"}`), "sandboxes")
	if r := e.as(b, "POST", "/sandboxes/"+id+"/snapshots", `{"checkpointID":"`+c.CheckpointID+`"}`); r.status != http.StatusCreated {
		t.Fatalf("first snapshot from a checkpoint: %d %s", r.status, r.body)
	}
	want429(t, e.as(b, "POST", "/sandboxes/"+id+"/snapshots", `{"checkpointID":"`+c.CheckpointID+`"}`), "templateDiskMB")
	// Paused, id leaves room for another sandbox; then its rollback (which resumes it) does not fit.
	if r := e.as(b, "POST", "/sandboxes/"+id+"/pause", ""); r.status != http.StatusNoContent {
		t.Fatalf("pause: %d %s", r.status, r.body)
	}
	e.createAs(b)
	want429(t, e.as(b, "POST", "/sandboxes/"+id+"/rollback", `{"checkpointID":"`+c.CheckpointID+`"}`), "sandboxes")
}
