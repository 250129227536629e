package bench

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/sandbox"
)

// BenchmarkPauseAB (issue 11, lever 3) measures a pause that answers once the memory image is
// written (the layer reaches the image after the answer) against one that answers once the
// layer is in the image too (PauseOptions.LayerFirst, the pause before), alternated on one
// sandbox, each followed by a resume into a pre-started instance; and next to them, the floors:
// raw `runsc checkpoint`, and raw `runsc restore` of that image into a pre-created container.
func BenchmarkPauseAB(b *testing.B) {
	n := getNode(b, 2)
	ctx := context.Background()
	fmt.Printf("\n== pause A/B (runsc systrap, %d rounds each, medians and p99; layers on %s) ==\n", iterations, layerFS)
	tpl, err := n.Store.GetTemplate(ctx, "base")
	if err != nil {
		b.Fatal(err)
	}
	raw := newRawRunsc(b, n)
	sb, err := n.Manager.Create(ctx, sandbox.CreateRequest{TemplateID: "base", NoPool: true})
	if err != nil {
		b.Fatal(err)
	}
	defer n.Manager.Kill(ctx, sb.ID)
	if _, err := n.run(sb, "echo keep > /home/user/keep.txt; (sleep 100000 &)"); err != nil {
		b.Fatal(err)
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
	var deferred, layerFirst, resumeDeferred, resumeLayerFirst, rawCkpt, rawInto dist
	missed := 0
	for i := 0; i < 2*iterations; i++ {
		first := i%2 == 1
		if first {
			c, in, _ := raw.rawPauseResume(b, i, tpl.Image)
			rawCkpt, rawInto = append(rawCkpt, c), append(rawInto, in)
		}
		time.Sleep(300 * time.Millisecond)
		t0 := time.Now()
		if err := n.Manager.PauseWith(ctx, sb.ID, sandbox.PauseOptions{KeepMemory: true, LayerFirst: first}); err != nil {
			b.Fatal(err)
		}
		el := time.Since(t0)
		if !resumeReady() {
			missed++
		}
		time.Sleep(300 * time.Millisecond)
		t1 := time.Now()
		if _, _, err := n.Manager.Connect(ctx, sb.ID, time.Minute); err != nil {
			b.Fatal(err)
		}
		rl := time.Since(t1)
		if first {
			layerFirst, resumeLayerFirst = append(layerFirst, el), append(resumeLayerFirst, rl)
		} else {
			deferred, resumeDeferred = append(deferred, el), append(resumeDeferred, rl)
		}
	}
	if out, err := n.run(sb, "cat /home/user/keep.txt"); err != nil || out != "keep\n" {
		b.Fatalf("after %d pauses the file reads %q, %v", 2*iterations, out, err)
	}
	report(b, "pause, answer on the memory image", deferred)
	report(b, "pause, answer once the layer is in it too", layerFirst)
	report(b, "raw runsc checkpoint (instance exits)", rawCkpt)
	report(b, "resume (pre-started) after the former", resumeDeferred)
	report(b, "resume (pre-started) after the latter", resumeLayerFirst)
	report(b, "raw runsc restore into a created container", rawInto)
	if missed > 0 {
		fmt.Printf("(%d resumes found no pre-started instance)\n", missed)
	}
	fmt.Printf("pause: %.2fx raw checkpoint (was %.2fx); resume: %.2fx raw restore into a created container\n",
		ratio(deferred, rawCkpt), ratio(layerFirst, rawCkpt), ratio(resumeDeferred, rawInto))
}
