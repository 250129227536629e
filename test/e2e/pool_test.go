package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/testutil"
)

type poolJSON struct {
	TemplateID      string   `json:"templateID"`
	Kind            string   `json:"kind"`
	Ready           int      `json:"ready"`
	Target          int      `json:"target"`
	Burst           float64  `json:"burst"`
	RefillsInFlight int      `json:"refillsInFlight"`
	InstanceMB      float64  `json:"instanceMB"`
	BudgetMB        int      `json:"budgetMB"`
	UsedMB          float64  `json:"usedMB"`
	SandboxIDs      []string `json:"sandboxIDs"`
}

func (d *daemon) restoredPool(t *testing.T) poolJSON {
	t.Helper()
	var pools []poolJSON
	if code, body, err := d.call(10*time.Second, "GET", "/ember/pools", nil, &pools); err != nil || code != 200 {
		t.Fatalf("GET /ember/pools: %d %s %v", code, body, err)
	}
	for _, p := range pools {
		if p.TemplateID == "base" && p.Kind == "restored" {
			return p
		}
	}
	return poolJSON{}
}

// cgroupFile reads a file of the daemon's cgroup of controller ctrl ("" = v2), under
// ember-<node>/rel.
func (d *daemon) cgroupFile(ctrl, rel, name string) (string, error) {
	cg, _ := os.ReadFile("/proc/" + strconv.Itoa(d.cmd.Process.Pid) + "/cgroup")
	for _, line := range strings.Split(string(cg), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) == 3 && parts[1] == ctrl {
			root := filepath.Join("/sys/fs/cgroup", ctrl)
			if ctrl == "" {
				root = "/sys/fs/cgroup/unified"
			}
			b, err := os.ReadFile(filepath.Join(root, parts[2], "ember-"+d.nodeID, rel, name))
			return strings.TrimSpace(string(b)), err
		}
	}
	return "", os.ErrNotExist
}

// cpuWeight is an instance's CPU weight as its cgroup says (v1 cpu.shares or v2 cpu.weight).
func (d *daemon) cpuWeight(id string) string {
	if v, err := d.cgroupFile("cpu", id, "cpu.shares"); err == nil {
		return "shares " + v
	}
	if v, err := d.cgroupFile("", id, "cpu.weight"); err == nil {
		return "weight " + v
	}
	return "?"
}

// memoryCharge is what the host charges the daemon's instances (their parent cgroup), in MiB.
func (d *daemon) memoryCharge() float64 {
	v, err := d.cgroupFile("memory", "", "memory.usage_in_bytes")
	if err != nil {
		v, err = d.cgroupFile("", "", "memory.current")
	}
	if err != nil {
		return -1
	}
	f, _ := strconv.ParseFloat(v, 64)
	return f / (1 << 20)
}

// TestPoolFollowsABurstWithinItsBudget: 16 creates in a loop drain a pool of 1; the pool then
// grows towards the burst, no further than its memory budget at the instances' measured cost
// (GET /ember/pools says so, and runsc runs no more instances than that), and shrinks back to
// its minimum once the demand is forgotten.
func TestPoolFollowsABurstWithinItsBudget(t *testing.T) {
	d := newDaemonWith(t, daemonOpts{Flags: []string{"--pool-size", "1", "--pool-memory-mb", "200", "--pool-decay", "8s",
		"--prestart-size", "0", "--prestart-max", "0"}})
	settled := func(what string, within time.Duration, ok func(p poolJSON) bool) poolJSON {
		t.Helper()
		var p poolJSON
		testutil.EventuallyOr(t, within, func() bool {
			p = d.restoredPool(t)
			return ok(p)
		}, func() string { return fmt.Sprintf("%s: %+v\n%s", what, p, d.logs()) })
		return p
	}
	settled("pool at its minimum", 2*time.Minute, func(p poolJSON) bool { return p.Ready == 1 && p.RefillsInFlight == 0 })
	// The pool's instance was restored at the refills' low CPU weight; the create that takes it
	// runs at the normal weight.
	insts := d.instances()
	if len(insts) != 1 {
		t.Fatalf("runsc instances %+v; want the pool's one", insts)
	}
	if w := d.cpuWeight(insts[0].ID); w != "shares 102" && w != "weight 10" {
		t.Fatalf("pool instance %s at CPU %s, want the refills' (shares 102 or weight 10)", insts[0].ID, w)
	}
	var taken sbx
	if code, body, err := d.call(time.Minute, "POST", "/sandboxes", map[string]any{"templateID": "base"}, &taken); err != nil || code != 201 {
		t.Fatalf("create: %d %s %v", code, body, err)
	}
	if w := d.cpuWeight(insts[0].ID); w != "shares 1024" && w != "weight 100" {
		t.Fatalf("the sandbox that took the pool instance runs at CPU %s, want shares 1024 or weight 100", w)
	}
	d.call(time.Minute, "DELETE", "/sandboxes/"+taken.SandboxID, nil, nil)
	for i := 0; i < 16; i++ {
		var s sbx
		if code, body, err := d.call(time.Minute, "POST", "/sandboxes", map[string]any{"templateID": "base"}, &s); err != nil || code != 201 {
			t.Fatalf("create %d: %d %s %v", i, code, body, err)
		}
		if code, body, err := d.call(time.Minute, "DELETE", "/sandboxes/"+s.SandboxID, nil, nil); err != nil || code != 204 {
			t.Fatalf("kill %d: %d %s %v", i, code, body, err)
		}
	}
	p := d.restoredPool(t)
	if p.Burst < 10 || p.Target < 10 {
		t.Fatalf("after 16 creates in a loop the pool is %+v; want a target near the burst", p)
	}
	// It grows until the budget stops it, instances counted at their measured cgroup charge;
	// nothing running (refills included) ever exceeds the budget.
	most, peakCharge := 0, 0.0
	deadline := time.Now().Add(60 * time.Second)
	for {
		p = d.restoredPool(t)
		if p.UsedMB > float64(p.BudgetMB) {
			t.Fatalf("pool uses %.1f MiB of its %d MiB budget: %+v", p.UsedMB, p.BudgetMB, p)
		}
		n := len(d.instances())
		peakCharge = max(peakCharge, d.memoryCharge())
		fits := int(float64(p.BudgetMB) / p.InstanceMB)
		if n > fits {
			t.Fatalf("%d instances run at %.1f MiB each within a budget of %d MiB", n, p.InstanceMB, p.BudgetMB)
		}
		most = max(most, p.Ready)
		if p.Ready >= 4 && p.Ready >= min(p.Target, fits) && p.RefillsInFlight == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the pool did not fill to its target or its budget within 60 s: %+v", p)
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("pool grew to %d instances at %.1f MiB each (budget %d MiB); the node's cgroup peaked at %.1f MiB", most, p.InstanceMB, p.BudgetMB, peakCharge)
	if p.InstanceMB == 32 || p.InstanceMB < 4 {
		t.Fatalf("instances counted at %.1f MiB: not measured", p.InstanceMB)
	}
	// Idle, it shrinks back to its minimum, step by step.
	settled("pool back at its minimum", 90*time.Second, func(p poolJSON) bool { return p.Ready == 1 && p.Target == 1 })
	testutil.EventuallyOr(t, 20*time.Second, func() bool { return len(d.instances()) == 1 }, func() string {
		return fmt.Sprintf("runsc instances %+v with a pool of 1 and no sandbox", d.instances())
	})
}
