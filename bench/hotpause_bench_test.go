package bench

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// BenchmarkHotPause (issue 18 items 1-2) measures, on one sandbox, alternated in one run:
//   - hot pause and the resume of a hot-paused sandbox (a thaw), through plain HTTP on
//     loopback (POST /sandboxes/{id}/pause, POST /v2/sandboxes/{id}/connect);
//   - the resume of a sandbox demoted to disk (Manager.Demote after a hot pause; the resume
//     restores, into a pre-started instance when one is ready), through HTTP;
//   - the old full-checkpoint pause and its resume (PauseOptions.Mode checkpoint; through the
//     Manager, as the HTTP API has no per-call mode: loopback HTTP adds well under 1 ms);
//   - the floors: raw `runsc checkpoint`, raw `runsc restore` into a pre-created container and
//     into a new one;
//
// and the host memory (PSS of the sandbox's runsc processes) of an idle sandbox running and
// hot-paused (after its background checkpoint).
func BenchmarkHotPause(b *testing.B) {
	n := getNode(b, 2)
	ctx := context.Background()
	fmt.Printf("\n== hot pause (runsc systrap, %d rounds each, medians and p99; layers on %s) ==\n", iterations, layerFS)
	tpl, err := n.Store.GetTemplate(ctx, "base")
	if err != nil {
		b.Fatal(err)
	}
	raw := newRawRunsc(b, n)
	sb, err := n.Manager.Create(ctx, sandbox.CreateRequest{TemplateID: "base", NoPool: true, Timeout: time.Hour})
	if err != nil {
		b.Fatal(err)
	}
	defer n.Manager.Kill(ctx, sb.ID)
	if _, err := n.run(sb, "echo keep > /home/user/keep.txt; echo mem > /dev/shm/m; (sleep 100000 &)"); err != nil {
		b.Fatal(err)
	}
	post := func(path, body string, want int) time.Duration {
		req, _ := http.NewRequest(http.MethodPost, n.url+path, bytes.NewBufferString(body))
		req.Header.Set("X-API-Key", n.key)
		req.Header.Set("Content-Type", "application/json")
		t0 := time.Now()
		resp, err := http.DefaultClient.Do(req)
		el := time.Since(t0)
		if err != nil {
			b.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != want {
			b.Fatalf("POST %s: %d, want %d", path, resp.StatusCode, want)
		}
		return el
	}
	pause := func() time.Duration { return post("/sandboxes/"+sb.ID+"/pause", "{}", 204) }
	resume := func() time.Duration { return post("/v2/sandboxes/"+sb.ID+"/connect", `{"timeout":3600}`, 201) }
	onDisk := func() {
		testutil.Eventually(b, 30*time.Second, "the background checkpoint finishes", func() bool {
			got, err := n.Manager.Get(ctx, sb.ID)
			return err == nil && got.Runtime.Image != ""
		})
	}
	resumeReady := func() bool {
		for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
			for _, p := range n.Manager.Pools(ctx) {
				if p.Kind == "resume" && slices.Contains(p.SandboxIDs, sb.ID) {
					return true
				}
			}
		}
		return false
	}
	var hotPause, hotResume, demotedResume, ckptPause, ckptResume, rawCkpt, rawInto, rawFresh dist
	missed := 0
	for i := 0; i < iterations; i++ {
		c, in, fr := raw.rawPauseResume(b, i, tpl.Image)
		rawCkpt, rawInto, rawFresh = append(rawCkpt, c), append(rawInto, in), append(rawFresh, fr)

		time.Sleep(300 * time.Millisecond)
		hotPause = append(hotPause, pause())
		onDisk() // a resume during the background checkpoint waits for it: measured apart
		time.Sleep(200 * time.Millisecond)
		hotResume = append(hotResume, resume())

		time.Sleep(300 * time.Millisecond)
		pause()
		if err := n.Manager.Demote(ctx, sb.ID); err != nil {
			b.Fatal(err)
		}
		if !resumeReady() {
			missed++
		}
		time.Sleep(200 * time.Millisecond)
		demotedResume = append(demotedResume, resume())

		time.Sleep(300 * time.Millisecond)
		t0 := time.Now()
		if err := n.Manager.PauseWith(ctx, sb.ID, sandbox.PauseOptions{KeepMemory: true, Mode: sandbox.PauseCheckpoint}); err != nil {
			b.Fatal(err)
		}
		ckptPause = append(ckptPause, time.Since(t0))
		if !resumeReady() {
			missed++
		}
		time.Sleep(200 * time.Millisecond)
		t1 := time.Now()
		if _, _, err := n.Manager.Connect(ctx, sb.ID, time.Hour); err != nil {
			b.Fatal(err)
		}
		ckptResume = append(ckptResume, time.Since(t1))
	}
	if out, err := n.run(sb, "cat /home/user/keep.txt /dev/shm/m"); err != nil || out != "keep\nmem\n" {
		b.Fatalf("after %d rounds the files read %q, %v", iterations, out, err)
	}
	report(b, "hot pause (HTTP)", hotPause)
	report(b, "checkpoint pause (old)", ckptPause)
	report(b, "raw runsc checkpoint (instance exits)", rawCkpt)
	report(b, "resume, hot-paused: thaw (HTTP)", hotResume)
	report(b, "resume after demotion to disk (HTTP)", demotedResume)
	report(b, "resume after a checkpoint pause (old)", ckptResume)
	report(b, "raw runsc restore into a created container", rawInto)
	report(b, "raw runsc restore (new container)", rawFresh)
	if missed > 0 {
		fmt.Printf("(%d resumes found no pre-started instance)\n", missed)
	}
	fmt.Printf("hot pause %.2fx the old pause; thaw %.3fx raw restore; resume after demotion %.2fx raw restore into a created container\n",
		ratio(hotPause, ckptPause), ratio(hotResume, rawFresh), ratio(demotedResume, rawInto))

	// Memory: the sandbox idle and running, then hot-paused (state on disk, instance frozen).
	time.Sleep(2 * time.Second)
	cur, _ := n.Manager.Get(ctx, sb.ID)
	inst := cur.Runtime.InstanceID
	runPSS, runPriv, procs := memOfProcs(inst)
	pause()
	onDisk()
	time.Sleep(2 * time.Second)
	hotPSS0, hotPriv0, _ := memOfProcs(inst)
	// A sandbox that stays paused gives back what the save took (sandbox.DefaultPausedReduceAfter).
	time.Sleep(sandbox.DefaultPausedReduceAfter)
	hotPSS, hotPriv, _ := memOfProcs(inst)
	_, mib := n.Manager.PausedMemory()
	fmt.Printf("memory of an idle sandbox (%d runsc processes): running PSS %d KiB (private %d), hot-paused PSS %d KiB (private %d) 2 s after its state reached disk, %d KiB (private %d) %s later; paused-memory budget counts %d MiB (cgroup)\n",
		procs, runPSS, runPriv, hotPSS0, hotPriv0, hotPSS, hotPriv, sandbox.DefaultPausedReduceAfter, mib)
	recordScalar(runningPSS, float64(runPSS)/1024)
	recordScalar(hotPausedPSS, float64(hotPSS)/1024)
	resume()
}
