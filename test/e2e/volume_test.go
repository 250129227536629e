package e2e

import (
	"io"
	"net/http"
	"net/url"
	"strings"
	"syscall"
	"testing"
)

type volumeInfo struct {
	VolumeID string `json:"volumeID"`
	Name     string `json:"name"`
	Token    string `json:"token"`
}

// volumeFile reads path of a volume through the content API (its token, not the API key).
func (d *daemon) volumeFile(t *testing.T, v volumeInfo, path string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest("GET", "http://"+d.addr+"/volumecontent/"+v.VolumeID+"/file?path="+url.QueryEscape(path), nil)
	req.Header.Set("Authorization", "Bearer "+v.Token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func (d *daemon) wantRun(t *testing.T, s sbx, cmd, want string) {
	t.Helper()
	if r := d.run(t, s, cmd); r.stdout != want {
		t.Fatalf("%s in %s: %q (stderr %q, exit %d), want %q", cmd, s.SandboxID, r.stdout, r.stderr, r.exitCode, want)
	}
}

// Volumes with real runsc: two sandboxes on one volume see each other's writes (and the
// content API sees them); the volume survives pause/resume, fork, kill and a daemon restart;
// destroy is refused while a running or paused sandbox mounts it.
func TestVolumes(t *testing.T) {
	d := need(t)
	var v volumeInfo
	if code := d.api(t, "POST", "/volumes", map[string]any{"name": "e2e-shared"}, &v); code != 201 {
		t.Fatalf("create volume: %d", code)
	}
	t.Cleanup(func() { d.api(t, "DELETE", "/volumes/"+v.VolumeID, nil, nil) })
	mount := func(path string) map[string]any {
		return map[string]any{"volumeMounts": []map[string]string{{"name": "e2e-shared", "path": path}}, "timeout": 300}
	}
	a := d.create(t, mount("/mnt/vol"))
	b := d.create(t, mount("/data"))

	// Each sees the other's writes, as root and as the default user.
	d.run(t, a, "echo from-a > /mnt/vol/a.txt")
	d.wantRun(t, b, "cat /data/a.txt", "from-a\n")
	d.run(t, b, "mkdir -p /data/dir && echo from-b > /data/dir/b.txt")
	d.wantRun(t, a, "cat /mnt/vol/dir/b.txt", "from-b\n")
	if code, body := d.volumeFile(t, v, "/dir/b.txt"); code != 200 || body != "from-b\n" {
		t.Fatalf("content API read: %d %q", code, body)
	}

	if code, body := d.apiBody(t, "DELETE", "/volumes/"+v.VolumeID, nil, nil); code != 409 || !strings.Contains(body, "is in use") {
		t.Fatalf("destroy while mounted: %d %s", code, body)
	}

	// Pause (memory) and resume: the restore gives the mount again.
	if code := d.api(t, "POST", "/sandboxes/"+a.SandboxID+"/pause", map[string]any{}, nil); code != 204 {
		t.Fatalf("pause: %d", code)
	}
	d.run(t, b, "echo while-paused > /data/p.txt")
	if code, _ := d.apiBody(t, "DELETE", "/volumes/"+v.VolumeID, nil, nil); code != 409 {
		t.Fatalf("destroy while mounted by a paused sandbox: %d, want 409", code)
	}
	if code := d.api(t, "POST", "/v2/sandboxes/"+a.SandboxID+"/connect", map[string]any{"timeout": 300}, nil); code != 201 {
		t.Fatalf("resume: %d\n%s", code, d.logs())
	}
	d.wantRun(t, a, "cat /mnt/vol/p.txt", "while-paused\n")
	d.run(t, a, "echo after-resume > /mnt/vol/r.txt")
	d.wantRun(t, b, "cat /data/r.txt", "after-resume\n")

	// A fork child mounts the same volume.
	var items []forkItem
	if code := d.api(t, "POST", "/sandboxes/"+a.SandboxID+"/fork", map[string]any{"count": 1, "timeout": 120}, &items); code != 201 || len(items) != 1 || items[0].Sandbox == nil {
		t.Fatalf("fork: %d %+v\n%s", code, items, d.logs())
	}
	kid := *items[0].Sandbox
	t.Cleanup(func() { d.api(t, "DELETE", "/sandboxes/"+kid.SandboxID, nil, nil) })
	d.wantRun(t, kid, "cat /mnt/vol/r.txt", "after-resume\n")
	d.run(t, kid, "echo from-child > /mnt/vol/k.txt")
	d.wantRun(t, b, "cat /data/k.txt", "from-child\n")

	// A filesystem-only pause (the resume boots on the saved layer) mounts the volume again too.
	if code := d.api(t, "POST", "/sandboxes/"+kid.SandboxID+"/pause", map[string]any{"memory": false}, nil); code != 204 {
		t.Fatalf("filesystem-only pause: %d", code)
	}
	d.run(t, b, "echo while-files-paused > /data/f.txt")
	if code := d.api(t, "POST", "/v2/sandboxes/"+kid.SandboxID+"/connect", map[string]any{"timeout": 120}, nil); code != 201 {
		t.Fatalf("resume after a filesystem-only pause: %d\n%s", code, d.logs())
	}
	d.wantRun(t, kid, "cat /mnt/vol/f.txt", "while-files-paused\n")

	// A sandbox created from a snapshot of a mounts the same volume at the same path (its
	// checkpoint restores only with it); other volumes are refused.
	var snap struct {
		SnapshotID string `json:"snapshotID"`
	}
	if code, body := d.apiBody(t, "POST", "/sandboxes/"+a.SandboxID+"/snapshots", map[string]any{}, &snap); code != 201 {
		t.Fatalf("snapshot: %d %s", code, body)
	}
	t.Cleanup(func() { d.api(t, "DELETE", "/templates/"+snap.SnapshotID, nil, nil) })
	fromSnap := d.create(t, map[string]any{"templateID": snap.SnapshotID, "timeout": 120})
	d.run(t, b, "echo after-snapshot > /data/s.txt")
	d.wantRun(t, fromSnap, "cat /mnt/vol/s.txt", "after-snapshot\n")
	if code, body := d.apiBody(t, "POST", "/sandboxes", map[string]any{"templateID": snap.SnapshotID,
		"volumeMounts": []map[string]string{{"name": "e2e-shared", "path": "/elsewhere"}}}, nil); code != 400 {
		t.Fatalf("create from the snapshot with other mounts: %d %s, want 400", code, body)
	}
	if code := d.api(t, "DELETE", "/sandboxes/"+fromSnap.SandboxID, nil, nil); code != 204 {
		t.Fatalf("kill: %d", code)
	}

	// Kill a and the child; b lives on through a daemon restart.
	for _, s := range []sbx{a, kid} {
		if code := d.api(t, "DELETE", "/sandboxes/"+s.SandboxID, nil, nil); code != 204 {
			t.Fatalf("kill %s: %d", s.SandboxID, code)
		}
	}
	d.restart(t, syscall.SIGTERM)
	var got volumeInfo
	if code := d.api(t, "GET", "/volumes/e2e-shared", nil, &got); code != 200 || got != v {
		t.Fatalf("volume after restart: %d %+v, want %+v", code, got, v)
	}
	d.run(t, b, "echo after-restart > /data/after.txt")
	if code, body := d.volumeFile(t, v, "/after.txt"); code != 200 || body != "after-restart\n" {
		t.Fatalf("content API after restart: %d %q", code, body)
	}
	c := d.create(t, mount("/v"))
	d.wantRun(t, c, "cat /v/a.txt /v/k.txt /v/after.txt", "from-a\nfrom-child\nafter-restart\n")

	// Once nothing mounts it, the volume goes.
	for _, s := range []sbx{b, c} {
		if code := d.api(t, "DELETE", "/sandboxes/"+s.SandboxID, nil, nil); code != 204 {
			t.Fatalf("kill %s: %d", s.SandboxID, code)
		}
	}
	if code := d.api(t, "DELETE", "/volumes/"+v.VolumeID, nil, nil); code != 204 {
		t.Fatalf("destroy: %d", code)
	}
	if code := d.api(t, "GET", "/volumes/"+v.VolumeID, nil, nil); code != 404 {
		t.Fatalf("get after destroy: %d, want 404", code)
	}
}
