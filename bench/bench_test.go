package bench

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/overlayfs"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

const iterations = 10

// BenchmarkBasic: create → command finished for a cold boot of `base`, and memory per idle
// sandbox with 10 running (issue: foundation).
func BenchmarkBasic(b *testing.B) {
	n := getNode(b, 2) // one node for every benchmark of the run; creates here skip the pool
	ctx := context.Background()
	fmt.Printf("\n== ember basic (runsc systrap, %d iterations) ==\n", iterations)
	var cold dist
	for i := 0; i < iterations; i++ {
		start := time.Now()
		sb, err := n.Manager.Create(ctx, sandbox.CreateRequest{TemplateID: "base", Cold: true, NoPool: true})
		if err != nil {
			b.Fatal(err)
		}
		if out, err := n.run(sb, "echo ok"); err != nil || out != "ok\n" {
			b.Fatalf("command: %q %v", out, err)
		}
		cold = append(cold, time.Since(start))
		n.Manager.Kill(ctx, sb.ID)
	}
	report(b, "cold boot: create -> command finished", cold)
	idleMemory(b, n, 10)
}

// idleMemory starts count idle sandboxes and prints memory per sandbox.
func idleMemory(b *testing.B, n *node, count int) {
	ctx := context.Background()
	before := memAvailableKiB()
	var ids []string
	for i := 0; i < count; i++ {
		sb, err := n.Manager.Create(ctx, sandbox.CreateRequest{TemplateID: "base", NoPool: true})
		if err != nil {
			b.Fatal(err)
		}
		ids = append(ids, sb.ID)
	}
	time.Sleep(2 * time.Second)
	pss, priv, procs := memOfProcs(filepath.Join(n.dataDir, "runsc"))
	after := memAvailableKiB()
	fmt.Printf("memory with %d idle sandboxes: PSS %.1f MiB/sandbox, private %.1f MiB/sandbox, MemAvailable -%.1f MiB/sandbox (%d host processes)\n",
		count, float64(pss)/1024/float64(count), float64(priv)/1024/float64(count), float64(before-after)/1024/float64(count), procs)
	b.ReportMetric(float64(pss)/1024/float64(count), fmt.Sprintf("pss_MiB_per_sandbox_%d", count))
	b.ReportMetric(float64(priv)/1024/float64(count), fmt.Sprintf("private_MiB_per_sandbox_%d", count))
	for _, id := range ids {
		n.Manager.Kill(ctx, id)
	}
}

// pausedBytes is the disk a paused sandbox's image takes (allocated blocks).
func pausedBytes(n *node, id string) int64 {
	var total int64
	dirs, _ := filepath.Glob(filepath.Join(n.dataDir, "sandboxes", id, "image-*"))
	for _, d := range dirs {
		filepath.Walk(d, func(_ string, fi os.FileInfo, err error) error {
			if err == nil && fi.Mode().IsRegular() {
				if st, ok := fi.Sys().(*syscall.Stat_t); ok {
					total += st.Blocks * 512
				}
			}
			return nil
		})
	}
	return total
}

// BenchmarkLifecycle prints the snapshot-first lifecycle figures (issue: snapshot-first).
func BenchmarkLifecycle(b *testing.B) {
	n := getNode(b, 2)
	ctx := context.Background()
	fmt.Printf("\n== ember lifecycle (runsc systrap, %d iterations each, medians and p99) ==\n", iterations)

	create := func(req sandbox.CreateRequest, settle time.Duration) dist {
		var d dist
		for i := 0; i < iterations; i++ {
			time.Sleep(settle)
			start := time.Now()
			sb, err := n.Manager.Create(ctx, req)
			if err != nil {
				b.Fatal(err)
			}
			d = append(d, time.Since(start))
			n.Manager.Kill(ctx, sb.ID)
		}
		return d
	}
	pool := create(sandbox.CreateRequest{TemplateID: "base"}, 1500*time.Millisecond)
	ckpt := create(sandbox.CreateRequest{TemplateID: "base", NoPool: true}, 0)
	cold := create(sandbox.CreateRequest{TemplateID: "base", Cold: true}, 0)
	runc := runcStart(b, n)
	report(b, "create from warm pool (API ready)", pool)
	report(b, "create from checkpoint (restore + /init)", ckpt)
	report(b, "create by cold boot (boot + envd up)", cold)
	if len(runc) > 0 {
		report(b, "runc: plain container start of same rootfs", runc)
		fmt.Printf("ratios (p50): cold/pool %.1fx, cold/checkpoint %.1fx, checkpoint/runc %.2fx, pool/runc %.2fx\n",
			ratio(cold, pool), ratio(cold, ckpt), ratio(ckpt, runc), ratio(pool, runc))
	}

	sb, err := n.Manager.Create(ctx, sandbox.CreateRequest{TemplateID: "base", NoPool: true})
	if err != nil {
		b.Fatal(err)
	}
	if _, err := n.run(sb, "echo keep > /home/user/keep.txt; (sleep 100000 &)"); err != nil {
		b.Fatal(err)
	}
	var pause, resume dist
	for i := 0; i < iterations; i++ {
		t0 := time.Now()
		if err := n.Manager.Pause(ctx, sb.ID); err != nil {
			b.Fatal(err)
		}
		pause = append(pause, time.Since(t0))
		t1 := time.Now()
		if _, _, err := n.Manager.Connect(ctx, sb.ID, time.Minute); err != nil {
			b.Fatal(err)
		}
		resume = append(resume, time.Since(t1))
	}
	report(b, "pause (checkpoint + release)", pause)
	report(b, "resume (restore, same id)", resume)

	// A filesystem-only pause (E2B keepMemory:false) keeps the files and drops the memory: what
	// it costs to pause, to boot back, and on disk per paused sandbox, next to a memory pause.
	var fsPause, fsResume dist
	var memBytes, fsBytes int64
	for i := 0; i < iterations; i++ {
		// No instance pre-started for this resume: it would take the layer out of the image.
		if err := n.Manager.PauseWith(ctx, sb.ID, sandbox.PauseOptions{KeepMemory: true, NoPrestart: true}); err != nil {
			b.Fatal(err)
		}
		memBytes = pausedBytes(n, sb.ID)
		if _, _, err := n.Manager.Connect(ctx, sb.ID, time.Minute); err != nil {
			b.Fatal(err)
		}
		t0 := time.Now()
		if err := n.Manager.PauseWith(ctx, sb.ID, sandbox.PauseOptions{KeepMemory: false}); err != nil {
			b.Fatal(err)
		}
		fsPause = append(fsPause, time.Since(t0))
		fsBytes = pausedBytes(n, sb.ID)
		t1 := time.Now()
		if _, _, err := n.Manager.Connect(ctx, sb.ID, time.Minute); err != nil {
			b.Fatal(err)
		}
		fsResume = append(fsResume, time.Since(t1))
	}
	report(b, "pause, filesystem only (keepMemory false)", fsPause)
	report(b, "resume of it (boot on its files + /init)", fsResume)
	fmt.Printf("paused sandbox on disk: memory pause %.1f MiB, filesystem-only pause %.1f MiB (host memory: none for either)\n",
		float64(memBytes)/(1<<20), float64(fsBytes)/(1<<20))

	var snap dist
	for i := 0; i < iterations; i++ {
		t0 := time.Now()
		s, err := n.Manager.Snapshot(ctx, sb.ID, "")
		if err != nil {
			b.Fatal(err)
		}
		snap = append(snap, time.Since(t0))
		n.Manager.DeleteTemplate(ctx, s.ID)
	}
	report(b, "snapshot of an idle sandbox (answer)", snap)

	var fork, perChild dist
	for i := 0; i < 3; i++ {
		t0 := time.Now()
		res, err := n.Manager.Fork(ctx, sb.ID, 16, time.Minute)
		if err != nil {
			b.Fatal(err)
		}
		el := time.Since(t0)
		fork = append(fork, el)
		perChild = append(perChild, el/16)
		for _, r := range res {
			if r.Err != nil {
				b.Fatal(r.Err)
			}
			n.Manager.Kill(ctx, r.Sandbox.ID)
		}
	}
	report(b, "fork into 16 children (total)", fork)
	report(b, "fork into 16 children (per child)", perChild)

	// The named snapshot after 1 GiB written: BenchmarkSnapshot (snapshot_bench_test.go).
	n.Manager.Kill(ctx, sb.ID)
	// Idle memory at N = 50: BenchmarkIdleMemory (memory_bench_test.go).
}

func ratio(a, b dist) float64 {
	if b.pct(0.5) == 0 {
		return 0
	}
	return float64(a.pct(0.5)) / float64(b.pct(0.5))
}

// runcStart measures `runc run` of /bin/true on the base template's rootfs: a plain container
// start, the baseline a sandbox start is compared with.
func runcStart(b *testing.B, n *node) dist {
	runc, err := exec.LookPath("runc")
	if err != nil {
		fmt.Println("runc not installed; no container baseline")
		return nil
	}
	tpl, err := n.Store.GetTemplate(context.Background(), "base")
	if err != nil {
		b.Fatal(err)
	}
	bundle := b.TempDir()
	spec := exec.Command(runc, "spec", "--bundle", bundle)
	if out, err := spec.CombinedOutput(); err != nil {
		b.Fatalf("runc spec: %v %s", err, out)
	}
	// The template's rootfs is a stack of layers (its own top over the image's): runc gets the
	// stack mounted read-only, as one tree.
	root := tpl.RootFS
	if len(tpl.Lowers) > 0 {
		root = filepath.Join(bundle, "rootfs")
		if err := os.Mkdir(root, 0o755); err != nil {
			b.Fatal(err)
		}
		if err := overlayfs.Mount(root, append([]string{tpl.RootFS}, tpl.Lowers...), "", ""); err != nil {
			b.Fatalf("mount the template's stack for runc: %v", err)
		}
		defer overlayfs.Unmount(root)
	}
	cfgPath := filepath.Join(bundle, "config.json")
	cfg, _ := os.ReadFile(cfgPath)
	s := strings.Replace(string(cfg), `"path": "rootfs"`, fmt.Sprintf(`"path": %q`, root), 1)
	s = strings.Replace(s, `"terminal": true`, `"terminal": false`, 1)
	s = strings.Replace(s, `"sh"`, `"/bin/true"`, 1)
	os.WriteFile(cfgPath, []byte(s), 0o644)
	var d dist
	var mu sync.Mutex
	for i := 0; i < iterations; i++ {
		id := fmt.Sprintf("ember-bench-runc-%02d", i)
		t0 := time.Now()
		cmd := exec.Command(runc, "--root", filepath.Join(bundle, "state"), "run", "--bundle", bundle, id)
		if out, err := cmd.CombinedOutput(); err != nil {
			fmt.Printf("runc run failed (no baseline): %v %s\n", err, out)
			return nil
		}
		mu.Lock()
		d = append(d, time.Since(t0))
		mu.Unlock()
	}
	return d
}

// BenchmarkLoad: 100 concurrent creates, each running a command, then every sandbox killed:
// wall time, throughput and per-create latency (issue 7 item 8, issue 11's throughput row), next
// to its baseline: 100 raw runsc restores of the template's image at once (restores per second).
func BenchmarkLoad(b *testing.B) {
	n := getNode(b, 2)
	ctx := context.Background()
	const count = 100
	fmt.Printf("\n== ember load: %d concurrent creates + a command each ==\n", count)
	var mu sync.Mutex
	var lat dist
	var ids []string
	failed := 0
	var wg sync.WaitGroup
	start := time.Now()
	for i := 0; i < count; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			t0 := time.Now()
			sb, err := n.Manager.Create(ctx, sandbox.CreateRequest{TemplateID: "base"})
			if err == nil {
				_, err = n.run(sb, "echo ok")
			}
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				failed++
				fmt.Printf("  create+command failed: %v\n", err)
				if sb != nil {
					ids = append(ids, sb.ID)
				}
				return
			}
			lat = append(lat, time.Since(t0))
			ids = append(ids, sb.ID)
		}()
	}
	wg.Wait()
	wall := time.Since(start)
	report(b, "create + command, under 100 concurrent", lat)
	fmt.Printf("%d ok, %d failed in %s: %.1f creates/s\n", len(lat), failed, wall.Round(time.Millisecond), float64(len(lat))/wall.Seconds())
	b.ReportMetric(float64(len(lat))/wall.Seconds(), "creates_per_s")
	recordScalar(loadCreatesPerSec, float64(len(lat))/wall.Seconds())
	t0 := time.Now()
	for _, id := range ids {
		n.Manager.Kill(ctx, id)
	}
	fmt.Printf("killed %d sandboxes in %s\n", len(ids), time.Since(t0).Round(time.Millisecond))

	// The baseline: as many raw runsc restores of the template's image at once, each into its
	// own bundle and network namespace (no slot, layer, envd /init or command of ember's).
	tpl, err := n.Store.GetTemplate(ctx, "base")
	if err != nil {
		b.Fatal(err)
	}
	raw := newRawRunsc(b, n)
	bundles := make([]string, count)
	for i := range bundles {
		bundles[i] = raw.instance(b, i)
	}
	time.Sleep(2 * time.Second) // the kills' clean-up settles
	rawOK := 0
	start = time.Now()
	for i := range bundles {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := raw.restore(bundles[i], fmt.Sprintf("rawload-%03d", i), tpl.Image, "")
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				fmt.Printf("  raw restore: %v\n", err)
				return
			}
			rawOK++
		}()
	}
	wg.Wait()
	rawWall := time.Since(start)
	fmt.Printf("baseline: %d raw runsc restores at once: %d ok in %s: %.1f restores/s\n", count, rawOK, rawWall.Round(time.Millisecond), float64(rawOK)/rawWall.Seconds())
	b.ReportMetric(float64(rawOK)/rawWall.Seconds(), "baseline_raw_restores_per_s")
	recordScalar(loadRawRestoresPerSec, float64(rawOK)/rawWall.Seconds())
	sem := make(chan struct{}, 8)
	for i := range bundles {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			raw.remove(fmt.Sprintf("rawload-%03d", i))
		}()
	}
	wg.Wait()
}
