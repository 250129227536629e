package bench

import (
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// benchLogger is the benchmark node's logger: discarded, or with EMBER_BENCH_LOG=<file> a debug
// log in that file (the per-stage timelines of pause, resume and create: "pause timeline",
// "resume timeline", "create timeline", "launch timings", and the driver's "checkpoint timeline"
// and "restore into timeline").
func benchLogger() *slog.Logger {
	if p := os.Getenv("EMBER_BENCH_LOG"); p != "" {
		if f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600); err == nil {
			return slog.New(slog.NewTextHandler(f, &slog.HandlerOptions{Level: slog.LevelDebug}))
		}
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// restoreInto is the floor of a restore into a pre-started instance: `runsc create` of bundle
// as id (not timed: a pre-started instance has done it before the request), then `runsc
// restore --detach` of image into that container, timed. debugDir, if set, gets runsc's debug
// logs of both.
func (r *rawRunsc) restoreInto(bundle, id, image, debugDir string) (time.Duration, error) {
	var dbg []string
	if debugDir != "" {
		dbg = []string{"--debug", "--debug-log=" + debugDir + "/"}
	}
	if _, err := r.run(append(dbg, "create", "--bundle", bundle, id)...); err != nil {
		return 0, err
	}
	return r.run(append(dbg, "restore", "--detach", "--image-path", image, id)...)
}

// rawPauseResume is one round of the raw floors of a pause and a resume: an instance restored
// from image (the template's), left to settle as a paused sandbox would have, checkpointed
// (timed: the floor of a pause), then that checkpoint restored into a pre-created container
// (timed: the floor of a resume into a pre-started instance) and into a new one (timed).
func (r *rawRunsc) rawPauseResume(b *testing.B, i int, image string) (ckpt, into, fresh time.Duration) {
	b.Helper()
	id := fmt.Sprintf("rawpr-%04d", i)
	bundle := r.instance(b, 0)
	if _, err := r.restore(bundle, id, image, ""); err != nil {
		b.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	img := filepath.Join(r.dir, "img-"+id)
	os.MkdirAll(img, 0o700)
	defer os.RemoveAll(img)
	ckpt, err := r.run("checkpoint", "--image-path", img, "--compression=none", id)
	if err != nil {
		b.Fatal(err)
	}
	r.remove(id)
	if into, err = r.restoreInto(bundle, id+"-in", img, ""); err != nil {
		b.Fatal(err)
	}
	r.remove(id + "-in")
	if fresh, err = r.restore(bundle, id+"-new", img, ""); err != nil {
		b.Fatal(err)
	}
	r.remove(id + "-new")
	return ckpt, into, fresh
}

// breakdownInto is breakdown for a restore into a pre-created container: runsc's debug-log
// timers of one such restore of image.
func (r *rawRunsc) breakdownInto(b *testing.B, image string) {
	dbg := filepath.Join(r.dir, "debug-into")
	os.MkdirAll(dbg, 0o700)
	id := "rawdbi-0000"
	el, err := r.restoreInto(r.instance(b, 0), id, image, dbg)
	if err != nil {
		fmt.Printf("restore-into breakdown: %v\n", err)
		return
	}
	time.Sleep(300 * time.Millisecond)
	r.remove(id)
	fmt.Printf("-- where a raw restore into a pre-created container goes (runsc debug-log timers; it took %s with --debug) --\n", el.Round(time.Millisecond))
	logs, _ := filepath.Glob(filepath.Join(dbg, "*.boot.txt"))
	for _, l := range logs {
		for _, tl := range parseTimelines(l) {
			tl.print(8)
		}
	}
}
