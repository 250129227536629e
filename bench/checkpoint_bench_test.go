package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// BenchmarkCheckpoint prints what a step checkpoint and a rollback cost through ember's API
// (plain HTTP on loopback): the checkpoint's answer and the time the sandbox's processes were
// stopped for it (as the driver measured it: from the freeze to the thaw), and a rollback (the
// sandbox continues from its first checkpoint: a restore into a new instance, the old one
// ended after the answer) without and with a standby, next to raw `runsc checkpoint --leave-running` of an instance
// restored from the same template and raw `runsc restore` of that image, in the same run.
// Each round takes a checkpoint after writing a file and rolls back to the first one (a tree
// search going back to an earlier step), then deletes the new checkpoint.
//
//	sudo EMBER_BENCH_LAYER_FS=host go test -run '^$' -bench BenchmarkCheckpoint -benchtime 1x ./bench/
//
// Then, with rollback standbys on, each round takes a checkpoint, runs a step, waits until the
// checkpoint's standby is ready (restored and frozen: a model's think time) and rolls back to
// that checkpoint: a thaw and a swap. EMBER_BENCH_CKPT_N sets the rounds (default 20).
func BenchmarkCheckpoint(b *testing.B) {
	n := getNode(b, 2)
	ctx := context.Background()
	rounds := atoiOr(os.Getenv("EMBER_BENCH_CKPT_N"), 20)
	fmt.Printf("\n== ember step checkpoint and rollback (runsc systrap, %d rounds, plain HTTP on loopback; layers on %s) ==\n", rounds, layerFS)
	sb, err := n.Manager.Create(ctx, sandbox.CreateRequest{TemplateID: "base", NoPool: true, Timeout: time.Hour})
	if err != nil {
		b.Fatal(err)
	}
	defer n.Manager.Kill(ctx, sb.ID)
	call := func(method, path string, in, out any) time.Duration {
		var body bytes.Buffer
		if in != nil {
			json.NewEncoder(&body).Encode(in)
		}
		req, _ := http.NewRequest(method, n.url+path, &body)
		req.Header.Set("X-API-Key", n.key)
		req.Header.Set("Content-Type", "application/json")
		t0 := time.Now()
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			b.Fatal(err)
		}
		defer resp.Body.Close()
		el := time.Since(t0)
		if resp.StatusCode >= 300 {
			var e map[string]any
			json.NewDecoder(resp.Body).Decode(&e)
			b.Fatalf("%s %s: %d %v", method, path, resp.StatusCode, e)
		}
		if out != nil {
			json.NewDecoder(resp.Body).Decode(out)
		}
		return el
	}
	type ckpt struct {
		CheckpointID string  `json:"checkpointID"`
		StoppedMs    float64 `json:"stoppedMs"`
	}
	base := "/sandboxes/" + sb.ID
	if _, err := n.run(sb, "head -c 10M /dev/urandom > /home/user/start.bin && sync"); err != nil {
		b.Fatal(err)
	}
	// Without standbys first: every rollback restores.
	n.Manager.CheckpointStandby(false)
	var first ckpt
	call("POST", base+"/checkpoints", nil, &first)
	var answer, stopped, rollback, swap dist
	for i := 0; i < rounds; i++ {
		if _, err := n.run(sb, fmt.Sprintf("echo step-%d > /home/user/step && head -c 1M /dev/urandom > /home/user/step.bin", i)); err != nil {
			b.Fatal(err)
		}
		var c ckpt
		answer = append(answer, call("POST", base+"/checkpoints", nil, &c))
		stopped = append(stopped, time.Duration(c.StoppedMs*float64(time.Millisecond)))
		rollback = append(rollback, call("POST", base+"/rollback", map[string]any{"checkpointID": first.CheckpointID}, nil))
		call("DELETE", base+"/checkpoints/"+c.CheckpointID, nil, nil)
	}
	if out, err := n.run(sb, "test -e /home/user/step && echo step-file-left || echo rolled-back"); err != nil || out != "rolled-back\n" {
		b.Fatalf("after the last rollback: %q %v", out, err)
	}
	// With standbys: a step, then a rollback to the step's checkpoint (retrying the step).
	n.Manager.CheckpointStandby(true)
	for i := 0; i < rounds; i++ {
		var c ckpt
		call("POST", base+"/checkpoints", nil, &c)
		if _, err := n.run(sb, fmt.Sprintf("echo try-%d > /home/user/try", i)); err != nil {
			b.Fatal(err)
		}
		// The standby is ready (restored and frozen) after a think time; wait for it.
		testutil.Eventually(b, time.Minute, "a standby of "+c.CheckpointID, func() bool {
			var list []struct {
				CheckpointID string `json:"checkpointID"`
				Standby      bool   `json:"standby"`
			}
			call("GET", base+"/checkpoints", nil, &list)
			ready := false
			for _, l := range list {
				ready = ready || (l.CheckpointID == c.CheckpointID && l.Standby)
			}
			return ready
		})
		swap = append(swap, call("POST", base+"/rollback", map[string]any{"checkpointID": c.CheckpointID}, nil))
		if out, err := n.run(sb, "test -e /home/user/try && echo try-left || echo rolled-back"); err != nil || out != "rolled-back\n" {
			b.Fatalf("after a rollback by standby: %q %v", out, err)
		}
		call("DELETE", base+"/checkpoints/"+c.CheckpointID, nil, nil)
	}

	// Raw runsc in the same run: checkpoint (leave running) of an instance restored from the
	// template, and restore of that image into a new instance.
	raw := newRawRunsc(b, n)
	tpl, err := n.Store.GetTemplate(ctx, "base")
	if err != nil {
		b.Fatal(err)
	}
	var rawCkpt, rawRestore dist
	for i := 0; i < rounds; i++ {
		id, id2 := fmt.Sprintf("rawstc-%04d", i), fmt.Sprintf("rawstr-%04d", i)
		bundle := raw.instance(b, 0)
		if _, err := raw.restore(bundle, id, tpl.Image, ""); err != nil {
			b.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond)
		img := filepath.Join(raw.dir, "img-"+id)
		os.MkdirAll(img, 0o700)
		el, err := raw.run("checkpoint", "--image-path", img, "--compression=none", "--leave-running", id)
		if err != nil {
			b.Fatal(err)
		}
		rawCkpt = append(rawCkpt, el)
		raw.remove(id)
		back, err := raw.restore(bundle, id2, img, "")
		if err != nil {
			b.Fatal(err)
		}
		rawRestore = append(rawRestore, back)
		raw.remove(id2)
		os.RemoveAll(img)
	}
	report(b, "checkpoint: answer (HTTP)", answer)
	report(b, "checkpoint: sandbox stopped", stopped)
	report(b, "baseline: raw runsc checkpoint --leave-running", rawCkpt)
	report(b, "rollback without standby (HTTP)", rollback)
	report(b, "baseline: raw runsc restore", rawRestore)
	report(b, "rollback with standby (HTTP)", swap)
}
