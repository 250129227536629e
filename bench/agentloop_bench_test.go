package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"mime/multipart"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/sandbox"
)

// BenchmarkAgentLoop (issue 18) runs an agent's episode on many sandboxes at once: each step
// "thinks" for a random while with the sandbox paused (seeded: the same think times in every
// phase), resumes it, runs a command and writes a file through the sandbox plane (as the SDK
// does), and pauses it. Phases, in one run, on the same sandboxes:
//
//  1. the loop with hot pause (POST /sandboxes/{id}/pause, the node's default; resume by
//     POST /v2/sandboxes/{id}/connect: a thaw);
//  2. the same loop with the old full-checkpoint pause as the baseline (PauseOptions.Mode
//     checkpoint through the Manager, as the HTTP API has no per-call mode; the resume is the
//     same HTTP connect: a restore, into a pre-started instance when one is ready);
//  3. a tree search: at every third step a step checkpoint, then that many branches from it,
//     each but the first after a pause, a think and a rollback to the checkpoint (a rollback of
//     a paused sandbox resumes it at the checkpoint); the trunk goes on from the last branch;
//  4. forks from a step checkpoint (one sandbox at a time): as many children as branches.
//
// It prints the step overhead (resume + pause as the client sees them, without the command and
// the think) p50/p99, the host memory the paused sandboxes hold (MemAvailable's drop from before
// the sandboxes were created, sampled during the loop and with all of them paused, and what
// Manager.PausedMemory counts), and checkpoint, rollback and fork p50/p99.
//
//	sudo EMBER_BENCH_AGENT_N=4 EMBER_BENCH_AGENT_STEPS=6 EMBER_BENCH_AGENT_THINK_MS=200-500 \
//	  go test -run '^$' -bench BenchmarkAgentLoop -benchtime 1x -timeout 60m ./bench/
//
// Sizes: EMBER_BENCH_AGENT_N sandboxes (16), _STEPS per sandbox (30), _THINK_MS "min-max" or
// one value (500-2000), _BRANCHES per checkpoint (8), _FORKS sandboxes forked from (2; 0 none),
// _TREE=0 skips the tree search, _SEED (1).
func BenchmarkAgentLoop(b *testing.B) {
	n := getNode(b, 2)
	ctx := context.Background()
	c := agentLoopConfig()
	fmt.Printf("\n== agent loop: %d sandboxes at once × %d steps, think %s–%s ms (seed %d), plain HTTP on loopback; layers on %s ==\n",
		c.sandboxes, c.steps, ms(c.thinkMin), ms(c.thinkMax), c.seed, layerFS)
	time.Sleep(2 * time.Second) // the pool settles
	baseKiB := memAvailableKiB()
	var sbs []*sandbox.Sandbox
	defer func() {
		for _, sb := range sbs {
			n.Manager.Kill(context.Background(), sb.ID)
		}
	}()
	for i := 0; i < c.sandboxes; i++ {
		sb, err := n.Manager.Create(ctx, sandbox.CreateRequest{TemplateID: "base", Timeout: time.Hour})
		if err != nil {
			b.Fatal(err)
		}
		sbs = append(sbs, sb)
		// An agent's shell keeps state in memory: a process and a counter in tmpfs.
		if _, err := n.run(sb, "echo 0 > /dev/shm/steps; (sleep 100000 &)"); err != nil {
			b.Fatal(err)
		}
	}
	time.Sleep(time.Second)
	runKiB := memAvailableKiB()
	fmt.Printf("MemAvailable: %d MiB before the sandboxes, %d MiB less with %d of them running idle\n",
		baseKiB>>10, (baseKiB-runKiB)>>10, c.sandboxes)

	hot, err := n.agentLoop(ctx, sbs, c, sandbox.PauseHot, baseKiB, 1)
	if err != nil {
		b.Fatal(err)
	}
	old, err := n.agentLoop(ctx, sbs, c, sandbox.PauseCheckpoint, baseKiB, 2)
	if err != nil {
		b.Fatal(err)
	}
	fmt.Printf("-- the loop, %d steps (step overhead = resume + pause seen by the client) --\n", len(hot.step))
	report(b, "agent step overhead, hot pause", hot.step)
	report(b, "agent step overhead, checkpoint pause (old)", old.step)
	report(b, "agent resume, hot (thaw, HTTP)", hot.resume)
	report(b, "agent pause, hot (HTTP)", hot.pause)
	report(b, "agent resume, checkpoint (restore, HTTP)", old.resume)
	report(b, "agent pause, checkpoint (Manager)", old.pause)
	report(b, "agent command + file write, hot", hot.act)
	report(b, "agent command + file write, checkpoint", old.act)
	fmt.Printf("step overhead: hot %.3fx the old pause (p50); episode wall time: hot %s s, checkpoint %s s\n",
		ratio(hot.step, old.step), secs(hot.wall), secs(old.wall))
	for _, r := range []*agentRun{hot, old} {
		fmt.Printf("memory, %-10s: MemAvailable drop during the loop mean %d MiB, max %d MiB; all %d paused: %d MiB (PausedMemory: %d in memory, %d MiB); paused in memory during the loop mean %.1f sandboxes, %d MiB\n",
			r.mode, r.meanDropKiB>>10, r.maxDropKiB>>10, c.sandboxes, r.allPausedDropKiB>>10, r.allPausedN, r.allPausedMiB, r.meanPausedN, r.meanPausedMiB)
	}

	if c.tree {
		t, err := n.treeSearch(ctx, sbs, c)
		if err != nil {
			b.Fatal(err)
		}
		fmt.Printf("-- tree search: %d branches from every third step (%d checkpoints, %d rollbacks: %d found a standby ready at the call; the others waited for the one being made, or restored) --\n",
			c.branches, len(t.answer), len(t.rollback), t.standbyReady)
		report(b, "tree checkpoint: answer (HTTP)", t.answer)
		report(b, "tree checkpoint: sandbox stopped", t.stopped)
		report(b, "tree rollback of a paused sandbox (HTTP)", t.rollback)
		report(b, "tree rollback, standby ready at the call", t.rollbackStandby)
		report(b, "tree rollback, no standby ready at the call", t.rollbackRestore)
		report(b, "tree branch overhead (pause + rollback)", t.branch)
		report(b, "tree trunk step overhead (resume + pause)", t.step)
		fmt.Printf("tree search wall time %s s\n", secs(t.wall))
	}
	if c.forks > 0 {
		total, per, err := n.forkFromCheckpoints(ctx, sbs[:min(c.forks, len(sbs))], c.branches)
		if err != nil {
			b.Fatal(err)
		}
		report(b, fmt.Sprintf("fork into %d from a checkpoint (total)", c.branches), total)
		report(b, fmt.Sprintf("fork into %d from a checkpoint (per child)", c.branches), per)
	}
}

// agentLoopCfg is the benchmark's size (agentLoopConfig).
type agentLoopCfg struct {
	sandboxes, steps, branches, forks int
	thinkMin, thinkMax                time.Duration
	seed                              uint64
	tree                              bool
}

func agentLoopConfig() agentLoopCfg {
	c := agentLoopCfg{
		sandboxes: max(1, atoiOr(os.Getenv("EMBER_BENCH_AGENT_N"), 16)),
		steps:     max(1, atoiOr(os.Getenv("EMBER_BENCH_AGENT_STEPS"), 30)),
		branches:  max(1, atoiOr(os.Getenv("EMBER_BENCH_AGENT_BRANCHES"), 8)),
		forks:     max(0, atoiOr(os.Getenv("EMBER_BENCH_AGENT_FORKS"), 2)),
		seed:      uint64(max(0, atoiOr(os.Getenv("EMBER_BENCH_AGENT_SEED"), 1))),
		tree:      os.Getenv("EMBER_BENCH_AGENT_TREE") != "0",
		thinkMin:  500 * time.Millisecond,
		thinkMax:  2000 * time.Millisecond,
	}
	if v := os.Getenv("EMBER_BENCH_AGENT_THINK_MS"); v != "" {
		lo, hi, ok := strings.Cut(v, "-")
		if !ok {
			hi = lo
		}
		a, b := atoiOr(lo, 500), atoiOr(hi, 2000)
		c.thinkMin, c.thinkMax = time.Duration(min(a, b))*time.Millisecond, time.Duration(max(a, b))*time.Millisecond
	}
	return c
}

// thinker draws a sandbox's think times: the same sequence for sandbox i in every phase.
type thinker struct {
	rng      *rand.Rand
	min, max time.Duration
}

func (c agentLoopCfg) thinker(i int) *thinker {
	return &thinker{rng: rand.New(rand.NewPCG(c.seed, uint64(i))), min: c.thinkMin, max: c.thinkMax}
}

func (t *thinker) think() {
	d := t.min
	if t.max > t.min {
		d += time.Duration(t.rng.Int64N(int64(t.max - t.min)))
	}
	time.Sleep(d)
}

// agentRun is one phase of the loop.
type agentRun struct {
	mode                     string
	step, resume, pause, act dist
	wall                     time.Duration
	meanDropKiB, maxDropKiB  int64
	meanPausedN              float64
	meanPausedMiB            int64
	allPausedDropKiB         int64
	allPausedN               int
	allPausedMiB             int64
	mu                       sync.Mutex
}

// agentLoop runs c.steps steps on every sandbox at once, pausing in mode; every sandbox is
// paused before and after. Memory is sampled against baseKiB (MemAvailable without sandboxes).
func (n *node) agentLoop(ctx context.Context, sbs []*sandbox.Sandbox, c agentLoopCfg, mode string, baseKiB int64, phase int) (*agentRun, error) {
	r := &agentRun{mode: mode}
	for _, sb := range sbs {
		if err := n.pauseIn(ctx, sb.ID, mode); err != nil {
			return nil, err
		}
	}
	stopSampling := n.sampleMemory(baseKiB, func(meanDrop, maxDrop int64, meanN float64, meanMiB int64) {
		r.meanDropKiB, r.maxDropKiB, r.meanPausedN, r.meanPausedMiB = meanDrop, maxDrop, meanN, meanMiB
	})
	start := time.Now()
	err := forEachSandbox(sbs, func(stop context.Context, i int, sb *sandbox.Sandbox) error {
		th := c.thinker(i)
		for s := 0; s < c.steps && stop.Err() == nil; s++ {
			th.think() // the model thinks while the sandbox is paused
			res, err := n.resumeHTTP(sb.ID)
			if err != nil {
				return err
			}
			t0 := time.Now()
			if err := n.agentAct(sb, fmt.Sprintf("p%d-s%d", phase, s)); err != nil {
				return err
			}
			act := time.Since(t0)
			t1 := time.Now()
			if err := n.pauseIn(ctx, sb.ID, mode); err != nil {
				return err
			}
			p := time.Since(t1)
			r.mu.Lock()
			r.resume, r.act, r.pause, r.step = append(r.resume, res), append(r.act, act), append(r.pause, p), append(r.step, res+p)
			r.mu.Unlock()
		}
		return nil
	})
	r.wall = time.Since(start)
	stopSampling()
	if err != nil {
		return nil, err
	}
	// All paused: their state settles (background checkpoints), then the memory they hold.
	time.Sleep(3 * time.Second)
	r.allPausedDropKiB = baseKiB - memAvailableKiB()
	r.allPausedN, r.allPausedMiB = n.Manager.PausedMemory()
	// Memory kept across every pause: the tmpfs counter counts the steps of every phase.
	want := strconv.Itoa(phase * c.steps)
	for _, sb := range sbs {
		if _, err := n.resumeHTTP(sb.ID); err != nil {
			return nil, err
		}
		if out, err := n.run(sb, "cat /dev/shm/steps; cat /proc/[0-9]*/comm 2>/dev/null | grep -qx sleep && echo sleeping"); err != nil || out != want+"\nsleeping\n" {
			return nil, fmt.Errorf("%s after the %s loop: %q (want %s steps and the sleep), %v", sb.ID, mode, out, want, err)
		}
	}
	return r, nil
}

// agentAct is one step's work: a command, then a file write, both through the sandbox plane.
func (n *node) agentAct(sb *sandbox.Sandbox, step string) error {
	if _, err := n.run(sb, "n=$(cat /dev/shm/steps); echo $((n+1)) > /dev/shm/steps; ls /home/user > /dev/null"); err != nil {
		return fmt.Errorf("%s step %s: command: %w", sb.ID, step, err)
	}
	if err := n.writeFile(sb, "/home/user/"+step+".txt", bytes.Repeat([]byte(step+"\n"), 256)); err != nil {
		return fmt.Errorf("%s step %s: %w", sb.ID, step, err)
	}
	return nil
}

// writeFile writes a file in a sandbox by POST /files through the sandbox plane, as the SDK's
// files.write does (a multipart part named "file", the path as its file name).
func (n *node) writeFile(sb *sandbox.Sandbox, path string, data []byte) error {
	var body bytes.Buffer
	mw := multipart.NewWriter(&body)
	fw, err := mw.CreateFormFile("file", path)
	if err != nil {
		return err
	}
	fw.Write(data)
	mw.Close()
	req, _ := http.NewRequest(http.MethodPost, n.url+"/files?"+url.Values{"username": {"user"}}.Encode(), &body)
	req.Header.Set("Content-Type", mw.FormDataContentType())
	resp, err := (&http.Client{Transport: hdr{sb.ID, sb.AccessToken}}).Do(req)
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(resp.Body)
		return fmt.Errorf("write %s: %d %s", path, resp.StatusCode, msg)
	}
	return nil
}

// call makes a request to the node's API (X-API-Key) and decodes a 2xx answer into out; it
// returns the time to the response's headers.
func (n *node) call(method, path string, in, out any) (time.Duration, error) {
	var body bytes.Buffer
	if in != nil {
		json.NewEncoder(&body).Encode(in)
	}
	req, _ := http.NewRequest(method, n.url+path, &body)
	req.Header.Set("X-API-Key", n.key)
	req.Header.Set("Content-Type", "application/json")
	t0 := time.Now()
	resp, err := apiClient.Do(req)
	el := time.Since(t0)
	if err != nil {
		return el, err
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 {
		msg, _ := io.ReadAll(resp.Body)
		return el, fmt.Errorf("%s %s: %d %s", method, path, resp.StatusCode, bytes.TrimSpace(msg))
	}
	if out != nil {
		if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
			return el, fmt.Errorf("%s %s: %w", method, path, err)
		}
	}
	return el, nil
}

// resumeHTTP resumes a paused sandbox as Sandbox.connect does.
func (n *node) resumeHTTP(id string) (time.Duration, error) {
	return n.call(http.MethodPost, "/v2/sandboxes/"+id+"/connect", map[string]int{"timeout": 3600}, nil)
}

// pauseIn pauses a sandbox in mode: hot as a client does (HTTP, the node's default mode), the
// old checkpoint pause through the Manager (PauseOptions.Mode: no HTTP form).
func (n *node) pauseIn(ctx context.Context, id, mode string) error {
	if mode == sandbox.PauseHot {
		_, err := n.call(http.MethodPost, "/sandboxes/"+id+"/pause", struct{}{}, nil)
		return err
	}
	return n.Manager.PauseWith(ctx, id, sandbox.PauseOptions{KeepMemory: true, Mode: mode})
}

// sampleMemory samples MemAvailable's drop from baseKiB and Manager.PausedMemory every 250 ms
// until the returned function is called, which hands the means and the maximum drop to done.
func (n *node) sampleMemory(baseKiB int64, done func(meanDropKiB, maxDropKiB int64, meanN float64, meanMiB int64)) func() {
	stop, finished := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(finished)
		var sumDrop, maxDrop, sumMiB int64
		sumN, count := 0, 0
		t := time.NewTicker(250 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-stop:
				if count > 0 {
					done(sumDrop/int64(count), maxDrop, float64(sumN)/float64(count), sumMiB/int64(count))
				}
				return
			case <-t.C:
			}
			drop := baseKiB - memAvailableKiB()
			pn, pmib := n.Manager.PausedMemory()
			sumDrop, maxDrop, sumN, sumMiB, count = sumDrop+drop, max(maxDrop, drop), sumN+pn, sumMiB+pmib, count+1
		}
	}()
	return func() { close(stop); <-finished }
}

// forEachSandbox runs f for every sandbox at once and returns their errors; once one failed,
// ctx (f's) is done and the others stop at their next step.
func forEachSandbox(sbs []*sandbox.Sandbox, f func(ctx context.Context, i int, sb *sandbox.Sandbox) error) error {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errs := make([]error, len(sbs))
	var wg sync.WaitGroup
	for i, sb := range sbs {
		wg.Go(func() {
			if errs[i] = f(ctx, i, sb); errs[i] != nil {
				cancel()
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// treeRun is the tree search's figures.
type treeRun struct {
	mu                                                          sync.Mutex
	answer, stopped, rollback, rollbackStandby, rollbackRestore dist
	branch, step                                                dist
	standbyReady                                                int
	wall                                                        time.Duration
}

// treeSearch runs the tree search on every sandbox at once (hot pause, the node's default):
// each step resumes, acts, and at every third step takes a checkpoint and runs c.branches
// branches from it (each after the first: pause, think, rollback to the checkpoint, then a
// branch's work, which checks that the previous branch's file is gone); the trunk goes on from
// the last branch, and the checkpoint is deleted once its branches are done.
func (n *node) treeSearch(ctx context.Context, sbs []*sandbox.Sandbox, c agentLoopCfg) (*treeRun, error) {
	t := &treeRun{}
	for _, sb := range sbs {
		if err := n.pauseIn(ctx, sb.ID, sandbox.PauseHot); err != nil {
			return nil, err
		}
	}
	start := time.Now()
	err := forEachSandbox(sbs, func(stop context.Context, i int, sb *sandbox.Sandbox) error {
		th := c.thinker(i)
		pause := func() (time.Duration, error) {
			return n.call(http.MethodPost, "/sandboxes/"+sb.ID+"/pause", struct{}{}, nil)
		}
		for s := 0; s < c.steps && stop.Err() == nil; s++ {
			th.think() // the model thinks while the sandbox is paused
			res, err := n.resumeHTTP(sb.ID)
			if err != nil {
				return err
			}
			if err := n.agentAct(sb, fmt.Sprintf("t-s%d", s)); err != nil {
				return err
			}
			if s%3 == 0 {
				var ck struct {
					CheckpointID string  `json:"checkpointID"`
					StoppedMs    float64 `json:"stoppedMs"`
				}
				el, err := n.call(http.MethodPost, "/sandboxes/"+sb.ID+"/checkpoints", nil, &ck)
				if err != nil {
					return err
				}
				t.mu.Lock()
				t.answer, t.stopped = append(t.answer, el), append(t.stopped, time.Duration(ck.StoppedMs*float64(time.Millisecond)))
				t.mu.Unlock()
				marker := fmt.Sprintf("/home/user/branch-%d", s)
				for br := 0; br < c.branches && stop.Err() == nil; br++ {
					if br > 0 {
						p, err := pause()
						if err != nil {
							return err
						}
						th.think()
						ready := false
						if tree, err := n.Manager.ListCheckpoints(ctx, sb.ID); err == nil {
							ready = tree.Standby == ck.CheckpointID
						}
						rb, err := n.call(http.MethodPost, "/sandboxes/"+sb.ID+"/rollback", map[string]string{"checkpointID": ck.CheckpointID}, nil)
						if err != nil {
							return err
						}
						t.mu.Lock()
						t.rollback, t.branch = append(t.rollback, rb), append(t.branch, p+rb)
						if ready {
							t.standbyReady++
							t.rollbackStandby = append(t.rollbackStandby, rb)
						} else {
							t.rollbackRestore = append(t.rollbackRestore, rb)
						}
						t.mu.Unlock()
					}
					// The branch's work: the previous branch's file must be gone (rolled back).
					if out, err := n.run(sb, "test -e "+marker+" && echo left || echo gone"); err != nil || out != "gone\n" {
						return fmt.Errorf("%s step %d branch %d: the previous branch's file: %q %v", sb.ID, s, br, out, err)
					}
					if err := n.writeFile(sb, marker, []byte(strconv.Itoa(br))); err != nil {
						return err
					}
				}
				if _, err := n.call(http.MethodDelete, "/sandboxes/"+sb.ID+"/checkpoints/"+ck.CheckpointID, nil, nil); err != nil {
					return err
				}
			}
			p, err := pause()
			if err != nil {
				return err
			}
			t.mu.Lock()
			t.step = append(t.step, res+p)
			t.mu.Unlock()
		}
		return nil
	})
	t.wall = time.Since(start)
	return t, err
}

// forkFromCheckpoints forks count children from a fresh checkpoint of each sandbox in turn (one
// at a time) and kills them; it returns each fork's total time and the time per child.
func (n *node) forkFromCheckpoints(ctx context.Context, sbs []*sandbox.Sandbox, count int) (total, per dist, err error) {
	for _, sb := range sbs {
		if cur, gerr := n.Manager.Get(ctx, sb.ID); gerr == nil && cur.State == sandbox.StatePaused {
			if _, err := n.resumeHTTP(sb.ID); err != nil {
				return nil, nil, err
			}
		}
		var ck struct {
			CheckpointID string `json:"checkpointID"`
		}
		if _, err := n.call(http.MethodPost, "/sandboxes/"+sb.ID+"/checkpoints", nil, &ck); err != nil {
			return nil, nil, err
		}
		var children []struct {
			Sandbox *struct {
				SandboxID string `json:"sandboxID"`
			} `json:"sandbox"`
			Error *struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		el, err := n.call(http.MethodPost, "/sandboxes/"+sb.ID+"/fork", map[string]any{"count": count, "checkpointID": ck.CheckpointID, "timeout": 600}, &children)
		var failed []string
		for _, ch := range children {
			switch {
			case ch.Sandbox != nil:
				n.Manager.Kill(ctx, ch.Sandbox.SandboxID)
			case ch.Error != nil:
				failed = append(failed, ch.Error.Message)
			}
		}
		if err != nil {
			return nil, nil, err
		}
		if len(failed) > 0 || len(children) != count {
			return nil, nil, fmt.Errorf("fork of %s into %d: %d answers, failed: %v", sb.ID, count, len(children), failed)
		}
		total, per = append(total, el), append(per, el/time.Duration(count))
		if _, err := n.call(http.MethodDelete, "/sandboxes/"+sb.ID+"/checkpoints/"+ck.CheckpointID, nil, nil); err != nil {
			return nil, nil, err
		}
	}
	return total, per, nil
}

// apiClient bounds a benchmark's API call (a hung call fails the run instead of stalling it).
var apiClient = &http.Client{Timeout: 5 * time.Minute}

// secs formats d in seconds.
func secs(d time.Duration) string { return strconv.FormatFloat(d.Seconds(), 'f', 1, 64) }
