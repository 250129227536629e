package bench

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/layerfs"
	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/runtime/gvisor"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

// snapIterations: each writes 1 GiB anew, so that no snapshot dedupes against the one before.
const snapIterations = 5

// BenchmarkSnapshot prints what a named snapshot costs after 1 GiB written (issue 11, lever 6):
// the answer (capture on the node: checkpoint, layer clone, record), and the time until the
// background upload has stored it (chunked, in the node's snapshot store; each iteration writes
// 1 GiB of new data, so nothing dedupes), and a second snapshot with no file written since
// (what dedup leaves to upload), next to the raw capture (driver checkpoint + layer clone) of
// the same sandbox as the baseline, and two baselines of the layer itself: cp --reflink=always on
// the data dir's filesystem and a plain cp onto the host filesystem. It runs on the default
// set-up (data dir on the host filesystem: on ext4, ember's btrfs image over it);
// EMBER_BENCH_LAYER_FS=host measures the host filesystem as it is (captures copy on ext4).
func BenchmarkSnapshot(b *testing.B) {
	n := getNode(b, 2)
	ctx := context.Background()
	fmt.Printf("\n== ember named snapshot after 1 GiB written (runsc systrap, %d iterations, medians and p99; layers on %s) ==\n", snapIterations, layerFS)
	sb, err := n.Manager.Create(ctx, sandbox.CreateRequest{TemplateID: "base", NoPool: true, Timeout: time.Hour})
	if err != nil {
		b.Fatal(err)
	}
	defer n.Manager.Kill(ctx, sb.ID)
	var capture, answer, stored, again, pauseResume, clone, reflink, plain, unsynced dist
	raw := newRawRunsc(b, n)
	// waitStored waits until snapshot id is stored and returns the time since t.
	waitStored := func(id string, t time.Time) time.Duration {
		for {
			tpl, err := n.Store.GetTemplate(ctx, id)
			if err != nil {
				b.Fatal(err)
			}
			if st := tpl.UploadState(); st == sandbox.SnapshotStoredState {
				return time.Since(t)
			} else if st != sandbox.SnapshotUploading {
				b.Fatalf("snapshot %s: state %s: %s", id, st, tpl.SnapshotError)
			}
			if time.Since(t) > 5*time.Minute {
				b.Fatalf("snapshot %s not stored within 5 minutes", id)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	for i := 0; i < snapIterations; i++ {
		if _, err := n.run(sb, "head -c 1G /dev/urandom > /home/user/big.bin && sync"); err != nil {
			fmt.Printf("named snapshot after 1 GiB written: could not write 1 GiB: %v\n", err)
			return
		}
		info, err := n.Manager.Get(ctx, sb.ID)
		if err != nil {
			b.Fatal(err)
		}
		img := filepath.Join(n.dataDir, "images", fmt.Sprintf("bench-capture-%d", i))
		os.MkdirAll(img, 0o700)
		t0 := time.Now()
		if err := n.Driver.Checkpoint(ctx, info.Runtime.InstanceID, img, runtime.CheckpointOptions{LeaveRunning: true}); err != nil {
			b.Fatal(err)
		}
		capture = append(capture, time.Since(t0))
		os.RemoveAll(img)
		// Its parts besides runsc checkpoint: the pause and resume around it, and the clone of
		// the layer (of the running sandbox here: only its cost matters).
		t0 = time.Now()
		if _, err := raw.run("pause", info.Runtime.InstanceID); err != nil {
			b.Fatal(err)
		}
		if _, err := raw.run("resume", info.Runtime.InstanceID); err != nil {
			b.Fatal(err)
		}
		pauseResume = append(pauseResume, time.Since(t0))
		dst := filepath.Join(n.dataDir, "images", fmt.Sprintf("bench-clone-%d", i))
		t0 = time.Now()
		if _, err := gvisor.CloneUpper(info.Runtime.StateDir, dst); err != nil {
			b.Fatal(err)
		}
		clone = append(clone, time.Since(t0))
		gvisor.RemoveLayer(dst)
		os.RemoveAll(dst)

		t1 := time.Now()
		snap, err := n.Manager.Snapshot(ctx, sb.ID, "")
		if err != nil {
			b.Fatal(err)
		}
		answer = append(answer, time.Since(t1))
		stored = append(stored, waitStored(snap.ID, t1))
		// Baselines of the layer just captured (the disk-limited layer's ext4 image, or the
		// upper directory): cp --reflink=always on the data dir's filesystem (skipped where it
		// cannot clone), and a plain cp onto the host filesystem beside the data dir (what a
		// capture costs where nothing clones; sparse, like the driver's copy).
		layer := filepath.Join(n.dataDir, "images", snap.ID, "layer", ".disk.img")
		if _, err := os.Stat(layer); err != nil {
			layer = filepath.Join(n.dataDir, "images", snap.ID, "layer", "upper")
		}
		if ok, _ := layerfs.CanClone(n.dataDir); ok {
			dst := filepath.Join(n.dataDir, "images", fmt.Sprintf("bench-reflink-%d", i))
			t0 = time.Now()
			if out, err := exec.Command("cp", "-a", "--reflink=always", layer, dst).CombinedOutput(); err != nil {
				b.Fatalf("cp --reflink: %v %s", err, out)
			}
			reflink = append(reflink, time.Since(t0))
			os.RemoveAll(dst)
		}
		dst = filepath.Join(filepath.Dir(n.dataDir), fmt.Sprintf("bench-copy-%d", i))
		t0 = time.Now()
		if out, err := exec.Command("cp", "-a", "--reflink=never", layer, dst).CombinedOutput(); err != nil {
			b.Fatalf("cp: %v %s", err, out)
		}
		plain = append(plain, time.Since(t0))
		os.RemoveAll(dst)
		exec.Command("sync").Run() // its dirty pages must not slow what follows
		// The same files again: the store has every chunk of the layer (only memory changed).
		t2 := time.Now()
		snap2, err := n.Manager.Snapshot(ctx, sb.ID, "")
		if err != nil {
			b.Fatal(err)
		}
		again = append(again, waitStored(snap2.ID, t2))
		for _, id := range []string{snap.ID, snap2.ID} {
			if err := n.Manager.DeleteTemplate(ctx, id); err != nil {
				b.Fatal(err)
			}
		}
	}
	// The same answer when the 1 GiB is still in the page cache (no sync in the sandbox): any
	// clone first writes the layer's dirty data back, so this one is bound by the disk.
	for i := 0; i < 2; i++ {
		if _, err := n.run(sb, "head -c 1G /dev/urandom > /home/user/big.bin"); err != nil {
			b.Fatal(err)
		}
		t0 := time.Now()
		snap, err := n.Manager.Snapshot(ctx, sb.ID, "")
		if err != nil {
			b.Fatal(err)
		}
		unsynced = append(unsynced, time.Since(t0))
		waitStored(snap.ID, t0)
		if err := n.Manager.DeleteTemplate(ctx, snap.ID); err != nil {
			b.Fatal(err)
		}
	}
	report(b, "capture after 1 GiB written (ckpt+layer clone)", capture)
	report(b, "... of which runsc pause + runsc resume", pauseResume)
	report(b, "... of which the layer clone", clone)
	report(b, "named snapshot after 1 GiB written: answer", answer)
	report(b, "... stored (upload done)", stored)
	report(b, "... stored, nothing written since the last", again)
	report(b, "baseline: cp --reflink=always of the layer", reflink)
	report(b, "baseline: plain cp of the layer to "+layerfs.FSType(filepath.Dir(n.dataDir)), plain)
	report(b, "answer, 1 GiB written without sync (floor: disk)", unsynced)
	fmt.Printf("ratio (p50): answer/capture %.2fx, stored/answer %.1fx\n", ratio(answer, capture), ratio(stored, answer))
}
