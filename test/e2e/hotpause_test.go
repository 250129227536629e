package e2e

import (
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/testutil"
)

// Hot pause (issue 18 items 1-3) against real runsc: a pause freezes the sandbox in place and a
// resume thaws it (same instance, process and tmpfs); tiers move in the background (demotion
// under the paused-memory budget, least recently paused first, and after --hot-pause-max);
// kill -9 of the daemon during a hot pause, its background checkpoint or a demotion loses
// nothing. Node c1 (lostNode's), restarted with the flags each part needs.

// hotCounter counts in /dev/shm (tmpfs: memory only) every 50 ms.
const hotCounter = `i=0; while :; do i=$((i+1)); echo $i > /dev/shm/count.new; mv /dev/shm/count.new /dev/shm/count; sleep 0.05; done`

// hotSandbox is a sandbox running hotCounter, with a tmpfs file and a file on its disk.
type hotSandbox struct {
	sbx
	pid  uint32
	inst string
}

func (d *daemon) hotSandbox(t *testing.T) hotSandbox {
	t.Helper()
	s := d.create(t, map[string]any{"timeout": 600})
	d.run(t, s, "echo in-memory > /dev/shm/f; echo on-disk > /home/user/f")
	pid := d.background(t, s, hotCounter)
	inst, _ := d.instanceOf(t, s)
	for i := 0; i < 100 && d.count(t, s) < 3; i++ {
		time.Sleep(50 * time.Millisecond)
	}
	return hotSandbox{sbx: s, pid: pid, inst: inst.ID}
}

func (d *daemon) count(t *testing.T, s sbx) int {
	t.Helper()
	r := d.run(t, s, "cat /dev/shm/count 2>/dev/null || echo 0")
	n, err := strconv.Atoi(strings.TrimSpace(r.stdout))
	if err != nil {
		t.Fatalf("counter: %q", r.stdout)
	}
	return n
}

func (d *daemon) pause(t *testing.T, s sbx) time.Duration {
	t.Helper()
	t0 := time.Now()
	if code, body := d.apiBody(t, "POST", "/sandboxes/"+s.SandboxID+"/pause", map[string]any{}, nil); code != 204 {
		t.Fatalf("pause: %d %s\n%s", code, body, d.logs())
	}
	return time.Since(t0)
}

func (d *daemon) tier(t *testing.T, s sbx) (string, string) {
	t.Helper()
	var info sbx
	if code := d.api(t, "GET", "/sandboxes/"+s.SandboxID, nil, &info); code != 200 {
		t.Fatalf("get %s: %d", s.SandboxID, code)
	}
	return info.State, info.PausedIn
}

// resumeAndCheck resumes hs and checks that it continues with its process, tmpfs and disk
// files; thawed reports whether it runs in the same instance (no restore).
func (d *daemon) resumeAndCheck(t *testing.T, hs hotSandbox) (thawed bool) {
	t.Helper()
	var again sbx
	if code, body := d.apiBody(t, "POST", "/v2/sandboxes/"+hs.SandboxID+"/connect", map[string]any{"timeout": 600}, &again); code != 201 && code != 200 {
		t.Fatalf("resume: %d %s\n%s", code, body, d.logs())
	}
	if again.EnvdAccessToken != hs.EnvdAccessToken {
		t.Fatal("resume changed the access token")
	}
	if r := d.run(t, again, "cat /dev/shm/f /home/user/f"); r.stdout != "in-memory\non-disk\n" {
		t.Fatalf("files after resume: %q", r.stdout)
	}
	if pids := d.listPids(t, again); !strings.Contains(pids[hs.pid], "while") {
		t.Fatalf("counter process %d gone after resume: %v", hs.pid, pids)
	}
	n := d.count(t, again)
	time.Sleep(300 * time.Millisecond)
	if m := d.count(t, again); m <= n {
		t.Fatalf("counter does not run after resume: %d then %d", n, m)
	}
	inst, _ := d.instanceOf(t, again)
	return inst.ID == hs.inst
}

func TestHotPause(t *testing.T) {
	d := lostNode(t)

	t.Run("thaw keeps process and tmpfs, no restore", func(t *testing.T) {
		hs := d.hotSandbox(t)
		before := d.count(t, hs.sbx)
		took := d.pause(t, hs.sbx)
		if st, in := d.tier(t, hs.sbx); st != "paused" || in != "memory" {
			t.Fatalf("after pause: %s in %q, want paused in memory", st, in)
		}
		if st, err := d.instanceState(hs.inst); err != nil || st.Status != "paused" {
			t.Fatalf("runsc state of the paused sandbox's instance: %+v %v, want paused", st, err)
		}
		time.Sleep(time.Second)
		var again sbx
		if code := d.api(t, "POST", "/v2/sandboxes/"+hs.SandboxID+"/connect", map[string]any{"timeout": 600}, &again); code != 201 {
			t.Fatalf("resume: %d", code)
		}
		after := d.count(t, again)
		// 1 s frozen: at 50 ms a step it would have made 20; allow the reads' own time.
		if after-before > 12 {
			t.Errorf("counter ran while paused: %d -> %d", before, after)
		}
		if !d.resumeAndCheck(t, hs) { // running: connect answers 200, checks again
			t.Fatal("the resume restored into another instance")
		}
		t.Logf("hot pause answered in %v", took)
	})

	// Memory of an idle running sandbox, to size the budget: two paused ones fit, not three.
	probe := d.hotSandbox(t)
	var ms []struct {
		MemUsed uint64 `json:"memUsed"`
	}
	if code := d.api(t, "GET", "/sandboxes/"+probe.SandboxID+"/metrics", nil, &ms); code != 200 || len(ms) == 0 {
		t.Fatalf("metrics: %d %v", code, ms)
	}
	mib := int(ms[len(ms)-1].MemUsed >> 20)
	d.api(t, "DELETE", "/sandboxes/"+probe.SandboxID, nil, nil)
	budget := mib*5/2 + 1
	t.Logf("an idle running sandbox uses %d MiB: paused-memory budget %d MiB", mib, budget)
	d.flags = []string{"--paused-memory-mb", strconv.Itoa(budget)}
	d.restart(t, 15)

	t.Run("demotion under the budget, LRU; resume from each tier", func(t *testing.T) {
		var hss []hotSandbox
		for i := 0; i < 3; i++ {
			hss = append(hss, d.hotSandbox(t))
		}
		for _, hs := range hss {
			d.pause(t, hs.sbx)
			time.Sleep(200 * time.Millisecond)
		}
		want := []string{"disk", "memory", "memory"}
		var got []string
		testutil.EventuallyOr(t, 20*time.Second, func() bool {
			got = make([]string, 3)
			for i, hs := range hss {
				_, got[i] = d.tier(t, hs.sbx)
			}
			return fmt.Sprint(got) == fmt.Sprint(want)
		}, func() string { return fmt.Sprintf("tiers %v, want %v\n%s", got, want, d.logs()) })
		// The demoted sandbox's memory went back to the host: its instance and processes are gone
		// (the record says disk first; the instance ends right after).
		left := ""
		testutil.EventuallyOr(t, 10*time.Second, func() bool {
			left = ""
			for _, i := range d.instances() {
				if i.ID == hss[0].inst {
					left = "instance " + i.ID + " (" + i.Status + ")"
				}
			}
			for _, p := range d.runscProcs() {
				if strings.Contains(p.args, hss[0].inst) {
					left = "process " + p.args
				}
			}
			return left == ""
		}, func() string { return "the demoted sandbox still holds " + left })
		for i, hs := range hss {
			if thawed := d.resumeAndCheck(t, hs); thawed != (i > 0) {
				t.Errorf("sandbox %d (tier %s): thawed %v", i, want[i], thawed)
			}
		}
	})

	// kill -9 of the daemon: right after a pause's answer (its background checkpoint running),
	// during a demotion (--hot-pause-max 1s, crashes around it), and during a pause.
	d.flags = []string{"--hot-pause-max", "1s"}
	d.restart(t, 15)
	restart := func(t *testing.T) {
		t.Helper()
		http.DefaultTransport.(*http.Transport).CloseIdleConnections()
		d.crash()
		err := d.start()
		for i := 0; i < 5 && err != nil && strings.Contains(d.logs(), "address already in use"); i++ {
			time.Sleep(time.Second)
			err = d.start()
		}
		if err != nil {
			t.Fatalf("restart after kill -9: %v\n%s", err, d.logs())
		}
	}
	t.Run("kill -9 during the background checkpoint", func(t *testing.T) {
		hs := d.hotSandbox(t)
		d.pause(t, hs.sbx)
		restart(t)
		if st, in := d.tier(t, hs.sbx); st != "paused" || in != "memory" {
			t.Fatalf("after the crash: %s in %q, want paused in memory", st, in)
		}
		d.resumeAndCheck(t, hs)
	})
	t.Run("kill -9 during a demotion", func(t *testing.T) {
		for _, wait := range []time.Duration{900, 1000, 1100, 1200, 1400} {
			hs := d.hotSandbox(t)
			d.pause(t, hs.sbx)
			time.Sleep(wait * time.Millisecond)
			restart(t)
			st, in := d.tier(t, hs.sbx)
			if st != "paused" {
				t.Fatalf("after the crash %v after the pause: %s, want paused", wait, st)
			}
			thawed := d.resumeAndCheck(t, hs)
			t.Logf("crash %dms after the pause: paused in %s, thawed %v", wait, in, thawed)
			d.api(t, "DELETE", "/sandboxes/"+hs.SandboxID, nil, nil)
		}
	})
	t.Run("kill -9 during a pause", func(t *testing.T) {
		for _, wait := range []time.Duration{0, 2, 5, 10} {
			hs := d.hotSandbox(t)
			done := make(chan struct{})
			go func() {
				defer close(done)
				d.call(5*time.Second, "POST", "/sandboxes/"+hs.SandboxID+"/pause", map[string]any{}, nil)
			}()
			time.Sleep(wait * time.Millisecond)
			restart(t)
			<-done // a request sent late may reach the restarted daemon: either way it is over
			st, in := d.tier(t, hs.sbx)
			if st != "paused" && st != "running" {
				t.Fatalf("after the crash: %s", st)
			}
			var again sbx
			if code := d.api(t, "POST", "/v2/sandboxes/"+hs.SandboxID+"/connect", map[string]any{"timeout": 600}, &again); code != 201 && code != 200 {
				t.Fatalf("connect after the crash: %d", code)
			}
			d.resumeAndCheck(t, hs)
			t.Logf("crash %dms into a pause: %s %s", wait, st, in)
			d.api(t, "DELETE", "/sandboxes/"+hs.SandboxID, nil, nil)
		}
	})
}
