package bench

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/sandbox"
)

// BenchmarkPrestart (issue 11, lever 1): what a pre-started instance (runsc create done ahead,
// with the template image's layer, disk-limit image and network slot in place) saves on the
// paths that restore a checkpoint: a create that finds no restored sandbox ready, and the
// resume of a paused sandbox; each next to the same operation without it, in the same run. Fork
// children restore into new instances (their stack, over the source's layer captured at the
// fork, exists only once the fork's checkpoint is written): their row is the baseline the
// targets are set against; BenchmarkFork compares them with a copy of the layer per child.
func BenchmarkPrestart(b *testing.B) {
	n := getNode(b, 2)
	ctx := context.Background()
	fmt.Printf("\n== pre-started instances (runsc systrap, %d iterations each, medians and p99; layers on %s) ==\n",
		iterations, layerFS)

	// settle waits until no pool refills and a pre-started instance of base is ready, so that
	// every timed operation runs on a quiet node.
	settle := func() {
		deadline := time.Now().Add(60 * time.Second)
		for time.Now().Before(deadline) {
			quiet, ready := true, false
			for _, p := range n.Manager.Pools(ctx) {
				quiet = quiet && !p.Refilling
				if p.Kind == "prestarted" && p.TemplateID == "base" && p.Ready > 0 {
					ready = true
				}
			}
			if quiet && ready {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		time.Sleep(300 * time.Millisecond)
	}
	hits := func() int {
		h := 0
		for _, p := range n.Manager.Pools(ctx) {
			if p.Kind == "prestarted" {
				h += p.Hits
			}
		}
		return h
	}
	create := func(req sandbox.CreateRequest, first bool) (dist, dist) {
		var d, cmd dist
		for i := 0; i < iterations; i++ {
			settle()
			start := time.Now()
			sb, err := n.Manager.Create(ctx, req)
			if err != nil {
				b.Fatal(err)
			}
			d = append(d, time.Since(start))
			if first {
				if out, err := n.run(sb, "echo ok"); err != nil || out != "ok\n" {
					b.Fatalf("command: %q %v", out, err)
				}
				cmd = append(cmd, time.Since(start))
			}
			n.Manager.Kill(ctx, sb.ID)
		}
		return d, cmd
	}
	h0 := hits()
	pre, preCmd := create(sandbox.CreateRequest{TemplateID: "base", NoRestoredPool: true}, true)
	preHits := hits() - h0
	plain, plainCmd := create(sandbox.CreateRequest{TemplateID: "base", NoPool: true}, true)
	report(b, "create on pool miss, pre-started instance", pre)
	report(b, "create on pool miss, new instance (restore)", plain)
	report(b, "  + first command, pre-started instance", preCmd)
	report(b, "  + first command, new instance", plainCmd)
	fmt.Printf("pre-started instances served %d of %d creates; saved (p50) %.1f ms, %.0f%%\n",
		preHits, iterations, float64((plain.pct(0.5)-pre.pct(0.5)).Microseconds())/1000,
		100*float64(plain.pct(0.5)-pre.pct(0.5))/float64(plain.pct(0.5)))

	sb, err := n.Manager.Create(ctx, sandbox.CreateRequest{TemplateID: "base", NoPool: true})
	if err != nil {
		b.Fatal(err)
	}
	if _, err := n.run(sb, "echo keep > /home/user/keep.txt; (sleep 100000 &)"); err != nil {
		b.Fatal(err)
	}
	fmt.Printf("sandboxes have a disk limit of %d MiB (an ext4 image per writable layer)\n", sb.DiskSizeMB)
	// resumeReady waits until the paused sandbox has its pre-started instance.
	resumeReady := func() bool {
		for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
			for _, p := range n.Manager.Pools(ctx) {
				if p.Kind == "resume" && slices.Contains(p.SandboxIDs, sb.ID) {
					return true
				}
			}
		}
		return false
	}
	// The floors, interleaved: raw runsc checkpoint, and raw restore of that image into a
	// pre-created container and into a new one.
	tpl, err := n.Store.GetTemplate(ctx, "base")
	if err != nil {
		b.Fatal(err)
	}
	raw := newRawRunsc(b, n)
	var pause, resume, preResume, rawCkpt, rawInto, rawNew dist
	missed := 0
	for i := 0; i < 2*iterations; i++ {
		pre := i%2 == 1
		if pre {
			c, in, nw := raw.rawPauseResume(b, i, tpl.Image)
			rawCkpt, rawInto, rawNew = append(rawCkpt, c), append(rawInto, in), append(rawNew, nw)
		}
		settle()
		t0 := time.Now()
		if err := n.Manager.PauseWith(ctx, sb.ID, sandbox.PauseOptions{KeepMemory: true, NoPrestart: !pre}); err != nil {
			b.Fatal(err)
		}
		pause = append(pause, time.Since(t0))
		settle()
		if pre && !resumeReady() {
			missed++
		}
		t1 := time.Now()
		if _, _, err := n.Manager.Connect(ctx, sb.ID, time.Minute); err != nil {
			b.Fatal(err)
		}
		if pre {
			preResume = append(preResume, time.Since(t1))
		} else {
			resume = append(resume, time.Since(t1))
		}
	}
	report(b, "pause (answer once the image is durable)", pause)
	report(b, "resume, pre-started instance", preResume)
	report(b, "resume, new instance (restore)", resume)
	if missed > 0 {
		fmt.Printf("(%d resumes found no pre-started instance)\n", missed)
	}
	report(b, "raw runsc checkpoint (instance exits)", rawCkpt)
	report(b, "raw runsc restore into a created container", rawInto)
	report(b, "raw runsc restore into a new container", rawNew)
	fmt.Printf("pause %.2fx raw checkpoint; resume, pre-started %.2fx raw restore into a created container\n",
		ratio(pause, rawCkpt), ratio(preResume, rawInto))
	raw.breakdownInto(b, tpl.Image)

	var perChild dist
	for i := 0; i < 3; i++ {
		settle()
		t0 := time.Now()
		res, err := n.Manager.Fork(ctx, sb.ID, 16, time.Minute)
		if err != nil {
			b.Fatal(err)
		}
		perChild = append(perChild, time.Since(t0)/16)
		for _, r := range res {
			if r.Err != nil {
				b.Fatal(r.Err)
			}
			n.Manager.Kill(ctx, r.Sandbox.ID)
		}
	}
	report(b, "fork into 16 children (per child)", perChild)
	n.Manager.Kill(ctx, sb.ID)
}
