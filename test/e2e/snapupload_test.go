package e2e

import (
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/ember-sandbox/ember/internal/testutil"
)

// Named snapshots answer before their upload (issue 11 lever 6). These tests run on node c1
// (nothinglost_test.go's) and kill it with -9.

type templateInfo struct {
	TemplateID    string `json:"templateID"`
	Kind          string `json:"kind"`
	SnapshotState string `json:"snapshotState"`
	SnapshotError string `json:"snapshotError"`
}

// snapshotState is GET /templates/{id}'s snapshotState ("absent" on 404).
func (d *daemon) snapshotState(t *testing.T, id string) string {
	t.Helper()
	var ti templateInfo
	code, body, err := d.call(30*time.Second, "GET", "/templates/"+id, nil, &ti)
	switch {
	case code == 404:
		return "absent"
	case err != nil || code != 200:
		t.Fatalf("GET /templates/%s: %d %s %v", id, code, body, err)
	}
	if ti.SnapshotState == "failed" {
		t.Fatalf("snapshot %s failed: %s\n%s", id, ti.SnapshotError, d.logs())
	}
	return ti.SnapshotState
}

// bigSandbox is a sandbox holding a 512 MiB file of random bytes (an upload of seconds) and a
// small one; it returns the big file's sha256.
func (d *daemon) bigSandbox(t *testing.T) (sbx, string) {
	t.Helper()
	s := d.create(t, map[string]any{"timeout": 900})
	r, err := d.runFor(3*time.Minute, s, "head -c 512M /dev/urandom > /home/user/big.bin && echo small > /home/user/small.txt && sync && sha256sum /home/user/big.bin | cut -d' ' -f1")
	if err != nil || r.exitCode != 0 {
		t.Fatalf("write 512 MiB: %v %+v", err, r)
	}
	return s, strings.TrimSpace(r.stdout)
}

func (d *daemon) checkSnapshotFiles(t *testing.T, snap, sum string) {
	t.Helper()
	c := d.create(t, map[string]any{"templateID": snap, "timeout": 300})
	r, err := d.runFor(2*time.Minute, c, "cat /home/user/small.txt; sha256sum /home/user/big.bin | cut -d' ' -f1")
	if err != nil || r.stdout != "small\n"+sum+"\n" {
		t.Fatalf("sandbox from snapshot %s: %q %v, want small and %s", snap, r.stdout, err, sum)
	}
	d.api(t, "DELETE", "/sandboxes/"+c.SandboxID, nil, nil)
}

// chunkFiles counts the chunks in the node's local snapshot store.
func (d *daemon) chunkFiles() int {
	n := 0
	filepath.Walk(filepath.Join(d.dataDir, "snapshots", "chunks"), func(_ string, fi os.FileInfo, err error) error {
		if err == nil && fi.Mode().IsRegular() {
			n++
		}
		return nil
	})
	return n
}

// A snapshot answers while its upload runs and says uploading; the daemon is killed -9 while the
// upload exports the capture; the restarted daemon resumes the upload, creates from the
// snapshot work while it runs (from the node-local capture), it completes, the stored snapshot
// restores with its files, and nothing the cut export held (its read-only mount of the
// capture's disk image) is left.
func TestSnapshotUploadSurvivesKill9(t *testing.T) {
	d := lostNode(t)
	src, sum := d.bigSandbox(t)
	var created struct {
		SnapshotID string `json:"snapshotID"`
		State      string `json:"state"`
	}
	t0 := time.Now()
	if code := d.api(t, "POST", "/sandboxes/"+src.SandboxID+"/snapshots", map[string]any{"name": "upcrash"}, &created); code != 201 {
		t.Fatalf("snapshot: %d", code)
	}
	t.Logf("snapshot of a sandbox with 512 MiB written answered in %s, state %q", time.Since(t0).Round(time.Millisecond), created.State)
	defer d.call(30*time.Second, "DELETE", "/templates/upcrash", nil, nil)
	if created.State != "uploading" {
		t.Fatalf("snapshot answered with state %q, want uploading", created.State)
	}
	// Kill it while the export reads the capture's disk image (mounted from a loop device).
	images := filepath.Join(d.dataDir, "images")
	deadline := time.Now().Add(20 * time.Second)
	var exportMounts []string
	for len(exportMounts) == 0 {
		if time.Now().After(deadline) || d.snapshotState(t, "upcrash") != "uploading" {
			t.Fatalf("never saw the upload export the capture's disk image\n%s", d.logs())
		}
		for _, dev := range d.loopsUnder(images) {
			exportMounts = append(exportMounts, mountPointsOf(dev)...)
		}
		time.Sleep(5 * time.Millisecond)
	}
	d.crash()
	t.Logf("killed while the export had %v mounted", exportMounts)
	if _, err := os.Stat(filepath.Join(d.dataDir, "snapshots", "manifests", "upcrash.json")); err == nil {
		t.Fatal("the manifest was stored before the crash")
	}
	if err := d.start(); err != nil {
		t.Fatalf("restart: %v\n%s", err, d.logs())
	}
	if !strings.Contains(d.logs(), "resuming snapshot upload") {
		t.Fatalf("the restarted daemon did not resume the upload\n%s", d.logs())
	}
	// Created from while the resumed upload runs.
	if st := d.snapshotState(t, "upcrash"); st != "uploading" {
		t.Fatalf("state right after the restart: %q, want uploading", st)
	}
	c := d.create(t, map[string]any{"templateID": "upcrash"})
	if r := d.run(t, c, "cat /home/user/small.txt"); r.stdout != "small\n" {
		t.Fatalf("sandbox from the uploading snapshot reads %q", r.stdout)
	}
	d.api(t, "DELETE", "/sandboxes/"+c.SandboxID, nil, nil)
	deadline = time.Now().Add(3 * time.Minute)
	for d.snapshotState(t, "upcrash") != "stored" {
		if time.Now().After(deadline) {
			t.Fatalf("the resumed upload did not finish within 3 minutes\n%s", d.logs())
		}
		time.Sleep(200 * time.Millisecond)
	}
	if _, err := os.Stat(filepath.Join(d.dataDir, "snapshots", "manifests", "upcrash.json")); err != nil {
		t.Fatalf("stored snapshot without a manifest: %v", err)
	}
	d.checkSnapshotFiles(t, "upcrash", sum)
	// An auto-clearing loop device stays attached while it is mounted.
	if held := d.loopsUnder(images); len(held) > 0 {
		t.Fatalf("the export cut by the crash left its mount of the capture's disk image: %v", held)
	}
	for _, p := range exportMounts {
		if _, err := os.Stat(p); err == nil {
			t.Fatalf("the export cut by the crash left its mount point %s", p)
		}
	}
}

// mountPointsOf lists where device dev (/dev/loopN) is mounted.
func mountPointsOf(dev string) []string {
	data, _ := os.ReadFile("/proc/self/mounts")
	var out []string
	for _, line := range strings.Split(string(data), "\n") {
		if f := strings.Fields(line); len(f) > 1 && f[0] == dev {
			out = append(out, f[1])
		}
	}
	return out
}

// loopsUnder lists the loop devices (/dev/loopN) whose backing file is under dir.
func (d *daemon) loopsUnder(dir string) []string {
	var held []string
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err == nil && strings.HasPrefix(string(b), dir+"/") {
			held = append(held, "/dev/"+filepath.Base(filepath.Dir(filepath.Dir(f))))
		}
	}
	return held
}

// Deleting a snapshot during its upload cancels the upload and leaves nothing behind: no record,
// no capture, no manifest, no chunk more than before.
func TestDeleteSnapshotDuringUpload(t *testing.T) {
	d := lostNode(t)
	src, _ := d.bigSandbox(t)
	before := d.chunkFiles()
	var created struct {
		State string `json:"state"`
	}
	if code := d.api(t, "POST", "/sandboxes/"+src.SandboxID+"/snapshots", map[string]any{"name": "updel"}, &created); code != 201 || created.State != "uploading" {
		t.Fatalf("snapshot: %d %+v", code, created)
	}
	time.Sleep(300 * time.Millisecond) // let it upload some chunks
	if code := d.api(t, "DELETE", "/templates/updel", nil, nil); code != 204 {
		t.Fatalf("delete during upload: %d", code)
	}
	if st := d.snapshotState(t, "updel"); st != "absent" {
		t.Fatalf("state after delete: %q", st)
	}
	if _, err := os.Stat(filepath.Join(d.dataDir, "images", "updel")); !os.IsNotExist(err) {
		t.Fatalf("capture after delete: %v", err)
	}
	var merr error
	var chunks int
	var stages []string
	testutil.EventuallyOr(t, time.Minute, func() bool {
		_, merr = os.Stat(filepath.Join(d.dataDir, "snapshots", "manifests", "updel.json"))
		chunks = d.chunkFiles()
		stages, _ = filepath.Glob(filepath.Join(d.dataDir, "images", ".*"))
		return os.IsNotExist(merr) && chunks <= before && len(stages) == 0
	}, func() string {
		return fmt.Sprintf("left behind after the delete: manifest %v, %d chunks (before %d), stages %v\n%s", merr, chunks, before, stages, d.logs())
	})
	if !strings.Contains(d.logs(), `msg="snapshot upload stopped" snapshot=updel why="snapshot deleted"`) {
		t.Errorf("no log line of the cancelled upload\n%s", d.logs())
	}
}

// /metrics, after a create, pause, resume and kill through the real daemon, counts them: with
// the API key on the API listener, without one on --metrics-listen.
func TestMetricsCountTheLifecycle(t *testing.T) {
	maddr := freePort()
	d := lostNode(t, "--metrics-listen", maddr)
	get := func(url, key string) (int, map[string]*dto.MetricFamily) {
		t.Helper()
		req, _ := http.NewRequest("GET", url, nil)
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != 200 {
			return resp.StatusCode, nil
		}
		p := expfmt.NewTextParser(model.UTF8Validation)
		fams, err := p.TextToMetricFamilies(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		return 200, fams
	}
	if code, _ := get("http://"+d.addr+"/metrics", ""); code != 401 {
		t.Fatalf("/metrics without the API key: %d, want 401", code)
	}
	count := func(fams map[string]*dto.MetricFamily, name, label, value string) float64 {
		for _, m := range fams[name].GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == label && l.GetValue() == value {
					if h := m.GetHistogram(); h != nil {
						return float64(h.GetSampleCount())
					}
					return m.GetGauge().GetValue() + m.GetCounter().GetValue()
				}
			}
		}
		t.Fatalf("no %s{%s=%q} in /metrics", name, label, value)
		return 0
	}
	_, before := get("http://"+d.addr+"/metrics", d.key)
	creates := func(f map[string]*dto.MetricFamily) float64 {
		return count(f, "ember_stage_duration_seconds", "stage", "create_pool") + count(f, "ember_stage_duration_seconds", "stage", "create_checkpoint")
	}
	s := d.create(t, nil)
	_, running := get("http://"+d.addr+"/metrics", d.key)
	if n := count(running, "ember_sandboxes", "state", "running"); n < 1 {
		t.Errorf("ember_sandboxes{state=running} = %v with a sandbox running", n)
	}
	if code := d.api(t, "POST", "/sandboxes/"+s.SandboxID+"/pause", nil, nil); code != 204 {
		t.Fatalf("pause: %d", code)
	}
	_, paused := get("http://"+d.addr+"/metrics", d.key)
	if n := count(paused, "ember_sandboxes", "state", "paused"); n < 1 {
		t.Errorf("ember_sandboxes{state=paused} = %v with a sandbox paused", n)
	}
	if code := d.api(t, "POST", "/sandboxes/"+s.SandboxID+"/resume", map[string]any{"timeout": 60}, nil); code != 201 {
		t.Fatalf("resume: %d", code)
	}
	if code := d.api(t, "DELETE", "/sandboxes/"+s.SandboxID, nil, nil); code != 204 {
		t.Fatalf("kill: %d", code)
	}
	code, after := get("http://"+maddr+"/metrics", "")
	if code != 200 {
		t.Fatalf("/metrics on --metrics-listen without a key: %d", code)
	}
	if got := creates(after) - creates(before); got != 1 {
		t.Errorf("create samples: +%v, want +1", got)
	}
	for _, st := range []string{"pause", "resume"} {
		if got := count(after, "ember_stage_duration_seconds", "stage", st) - count(before, "ember_stage_duration_seconds", "stage", st); got != 1 {
			t.Errorf("%s samples: +%v, want +1", st, got)
		}
		if got := count(after, "ember_stage_failures_total", "stage", st); got != 0 {
			t.Errorf("%s failures: %v", st, got)
		}
	}
	if n := count(after, "ember_pool_ready", "template", "base"); n < 0 {
		t.Errorf("pool ready %v", n)
	}
	if f := after["ember_placement_retries_total"]; f == nil || f.GetMetric()[0].GetCounter().GetValue() != 0 {
		t.Errorf("placement retries: %v", f)
	}
}
