package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/testutil"
)

// createQueued posts a create with a queue timeout; it returns the status, the Retry-After
// header and the sandbox (on 201).
func (d *daemon) createQueued(ctx context.Context, queueTimeout string) (int, string, sbx, error) {
	var s sbx
	req, _ := http.NewRequestWithContext(ctx, "POST", "http://"+d.addr+"/v2/sandboxes", bytes.NewReader([]byte(`{"templateID":"base"}`)))
	req.Header.Set("X-API-Key", d.key)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Ember-Queue-Timeout", queueTimeout)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, "", s, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode == 201 {
		json.Unmarshal(b, &s)
	}
	return resp.StatusCode, resp.Header.Get("Retry-After"), s, nil
}

// TestAdmissionQueue (issue 19): on a node with room for 2 sandboxes, 6 creates at once all
// run, 2 at a time, the others waiting in the admission queue until a kill frees room; with
// the node full, a create whose queue timeout passes gets a 429 with an integer Retry-After,
// and one whose client disconnects leaves the queue; none of them holds anything afterwards
// (instances, netns, mounts, runsc processes as before). Node c1. Bound: ~1 min.
func TestAdmissionQueue(t *testing.T) {
	d := lostNode(t, "--max-sandboxes", "2", "--pool-size", "0", "--prestart-size", "0", "--prestart-max", "0")
	before := d.host()
	var mu sync.Mutex
	running, peak := 0, 0
	var wg sync.WaitGroup
	errs := make(chan string, 6)
	for i := 0; i < 6; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			code, _, s, err := d.createQueued(context.Background(), "120")
			if err != nil || code != 201 {
				errs <- "create: " + strconv.Itoa(code) + " " + errString(err)
				return
			}
			mu.Lock()
			running++
			peak = max(peak, running)
			mu.Unlock()
			if r, err := d.tryRun(s, "echo up", ""); err != nil || r.stdout != "up\n" {
				errs <- "run in a queued sandbox: " + r.stdout + " " + errString(err)
			}
			time.Sleep(300 * time.Millisecond)
			mu.Lock()
			running--
			mu.Unlock()
			if code, _, err := d.call(30*time.Second, "DELETE", "/sandboxes/"+s.SandboxID, nil, nil); code != 204 {
				errs <- "kill: " + strconv.Itoa(code) + " " + errString(err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
	if peak > 2 {
		t.Errorf("%d sandboxes ran at once on a node with room for 2", peak)
	}
	// Full: two run.
	for i := 0; i < 2; i++ {
		if code, _, s, err := d.createQueued(context.Background(), "0"); code != 201 {
			t.Fatalf("create %d: %d %v\n%s", i, code, err, d.logs())
		} else {
			t.Cleanup(func() { d.call(30*time.Second, "DELETE", "/sandboxes/"+s.SandboxID, nil, nil) })
		}
	}
	// The queue timeout passes: 429 with Retry-After, after waiting about that long.
	t0 := time.Now()
	code, retry, _, err := d.createQueued(context.Background(), "1")
	if _, aerr := strconv.Atoi(retry); code != 429 || aerr != nil || err != nil {
		t.Fatalf("create on a full node: %d Retry-After %q %v, want 429 with an integer Retry-After", code, retry, err)
	}
	if time.Since(t0) < time.Second {
		t.Errorf("the 429 came after %s, before the queue timeout of 1 s", time.Since(t0))
	}
	// A client that disconnects while queued.
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	if _, _, _, err := d.createQueued(ctx, "60"); err == nil {
		t.Fatal("a create on a full node answered within 0.5 s")
	}
	cancel()
	// Neither holds anything: the node runs its 2 sandboxes, and once they are killed it
	// holds what it held before.
	time.Sleep(time.Second) // the server notices the disconnect
	if l := d.listAll(t); len(l) != 2 {
		t.Errorf("the node lists %d sandboxes, want 2", len(l))
	}
	d.killAll(t)
	testutil.Eventually(t, 30*time.Second, "the host as before the creates", func() bool {
		h := d.host()
		return len(h.instances) <= len(before.instances) && len(h.netns) <= len(before.netns) &&
			len(h.procs) <= len(before.procs) && len(h.mounts) <= len(before.mounts)
	})
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
