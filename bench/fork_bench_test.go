package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// forkRounds: rounds of each kind of fork, alternated.
const forkRounds = 5

// BenchmarkFork (issue 11): a fork into 16 children whose layers stack over the source's layer
// captured once, read-only (fork layers), next to the same fork giving each child a copy of the
// source's layer (the way before) and to the floor, 16 raw runsc restores at once; alternated
// in one run; the source has 64 MiB written in its layer. Then where a raw
// restore's time goes (runsc's debug-log timers), and the driver's own capture of the source
// (pause, checkpoint, layer clone or capture, resume), which every fork waits for.
func BenchmarkFork(b *testing.B) {
	n := getNode(b, 2)
	ctx := context.Background()
	fmt.Printf("\n== fork into 16 (runsc systrap, %d rounds each, alternated, medians and p99; layers on %s) ==\n", forkRounds, layerFS)
	sb, err := n.Manager.Create(ctx, sandbox.CreateRequest{TemplateID: "base", NoPool: true, Timeout: time.Hour})
	if err != nil {
		b.Fatal(err)
	}
	defer n.Manager.Kill(ctx, sb.ID)
	if _, err := n.run(sb, "head -c 64M /dev/urandom > /home/user/data.bin && sync"); err != nil {
		b.Fatal(err)
	}
	defer n.Manager.ForkCopiesLayers(false)
	var layered, copied, floor dist
	fork := func(copies bool) time.Duration {
		n.Manager.ForkCopiesLayers(copies)
		time.Sleep(300 * time.Millisecond)
		t0 := time.Now()
		res, err := n.Manager.Fork(ctx, sb.ID, 16, time.Minute)
		if err != nil {
			b.Fatal(err)
		}
		el := time.Since(t0) / 16
		for _, r := range res {
			if r.Err != nil {
				b.Fatal(r.Err)
			}
		}
		for _, r := range res {
			n.Manager.Kill(ctx, r.Sandbox.ID)
		}
		return el
	}
	// The floor: 16 raw runsc restores of the template's image at once (no layer, slot, envd
	// or /init of ember's), wall time per restore.
	tpl, err := n.Store.GetTemplate(ctx, "base")
	if err != nil {
		b.Fatal(err)
	}
	raw := newRawRunsc(b, n)
	bundles := make([]string, 16)
	for i := range bundles {
		bundles[i] = raw.instance(b, i)
	}
	rawFloor := func(round int) time.Duration {
		time.Sleep(300 * time.Millisecond)
		var wg sync.WaitGroup
		t0 := time.Now()
		for i := range bundles {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if _, err := raw.restore(bundles[i], fmt.Sprintf("rawfork-%02d%02d", round, i), tpl.Image, ""); err != nil {
					fmt.Printf("  raw restore: %v\n", err)
				}
			}()
		}
		wg.Wait()
		el := time.Since(t0) / 16
		for i := range bundles {
			raw.remove(fmt.Sprintf("rawfork-%02d%02d", round, i))
		}
		return el
	}
	for i := 0; i < forkRounds; i++ {
		layered = append(layered, fork(false))
		copied = append(copied, fork(true))
		floor = append(floor, rawFloor(i))
	}
	report(b, "fork into 16, per child: over the captured layer", layered)
	report(b, "fork into 16, per child: a copy of the layer each (before)", copied)
	report(b, "floor: 16 raw runsc restores at once, wall per restore", floor)
	raw.breakdown(b, tpl.Image)

	// The capture alone, at the driver.
	info, err := n.Manager.Get(ctx, sb.ID)
	if err != nil {
		b.Fatal(err)
	}
	lc, _ := n.Driver.(runtime.LayerCapturer)
	var ckpt, capt dist
	for i := 0; i < forkRounds; i++ {
		img := filepath.Join(n.dataDir, "images", fmt.Sprintf("bench-fork-%d", i))
		os.MkdirAll(img, 0o700)
		t0 := time.Now()
		if err := n.Driver.Checkpoint(ctx, info.Runtime.InstanceID, img, runtime.CheckpointOptions{LeaveRunning: true}); err != nil {
			b.Fatal(err)
		}
		ckpt = append(ckpt, time.Since(t0))
		os.RemoveAll(img)
		if lc == nil {
			continue
		}
		os.MkdirAll(img, 0o700)
		layer := filepath.Join(n.dataDir, "images", fmt.Sprintf("bench-fork-layer-%d", i))
		t1 := time.Now()
		if _, err := lc.CheckpointToLayer(ctx, info.Runtime.InstanceID, img, layer); err != nil {
			b.Fatal(err)
		}
		capt = append(capt, time.Since(t1))
		lc.RemoveCapturedLayer(ctx, layer)
		os.RemoveAll(img)
	}
	report(b, "driver: checkpoint with the layer cloned into the image", ckpt)
	report(b, "driver: checkpoint with the layer captured (CheckpointToLayer)", capt)
}
