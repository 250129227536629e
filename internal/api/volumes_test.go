package api

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/store"
	"github.com/ember-sandbox/ember/internal/volume"
)

// newVolumeEnv is newEnv with volumes (plain directories: no loop mounts in unit tests); a
// destroy is refused while a sandbox of the service mounts the volume.
func newVolumeEnv(t *testing.T) (*env, *volume.Manager) {
	t.Helper()
	keys := auth.NewKeys(auth.NewMemoryBackend())
	key, _, err := keys.Create(context.Background(), "test")
	if err != nil {
		t.Fatal(err)
	}
	g := newGuest(t)
	fake := newService(t, g.srv.Listener.Addr().String())
	st, err := store.Open(t.TempDir() + "/volumes.db")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	vm, err := volume.Open(context.Background(), volume.Config{Dir: t.TempDir(), Store: st, NoDiskLimit: true,
		Users: func(ctx context.Context, id string) ([]string, error) {
			sbs, err := fake.List(ctx, sandbox.ListFilter{})
			var out []string
			for _, sb := range sbs {
				if sb.UsesVolume(id) {
					out = append(out, sb.ID)
				}
			}
			return out, err
		}})
	if err != nil {
		t.Fatal(err)
	}
	h := New(Config{Domain: testDomain, Volumes: vm, Builds: fake.builds()}, fake, keys, testLogger(t))
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return &env{t: t, fake: fake, keys: keys, key: key, api: srv, guest: g}, vm
}

func TestVolumeAPI(t *testing.T) {
	e, _ := newVolumeEnv(t)
	r := e.ctl("POST", "/volumes", `{"name":"data"}`)
	if r.status != http.StatusCreated {
		t.Fatalf("create: %d %s", r.status, r.body)
	}
	var v volumeAndTokenJSON
	r.json(t, &v)
	if v.VolumeID == "" || v.Name != "data" || !strings.HasPrefix(v.Token, "vol_") {
		t.Fatalf("created %+v", v)
	}
	r = e.ctl("POST", "/volumes", `{"name":"data"}`)
	r.wantError(t, http.StatusConflict)
	if !strings.Contains(string(r.body), `"volume with name 'data' already exists"`) {
		t.Fatalf("duplicate: %s", r.body)
	}
	e.ctl("POST", "/volumes", `{}`).wantError(t, http.StatusBadRequest)
	e.ctl("POST", "/volumes", `{"name":"a/b"}`).wantError(t, http.StatusBadRequest)
	e.do("POST", "/volumes", `{"name":"x"}`).wantError(t, http.StatusUnauthorized)

	for _, key := range []string{v.VolumeID, "data"} {
		r = e.ctl("GET", "/volumes/"+key, "")
		var got volumeAndTokenJSON
		r.json(t, &got)
		if r.status != 200 || got != v {
			t.Fatalf("get %s: %d %s", key, r.status, r.body)
		}
	}
	e.ctl("GET", "/volumes/nosuch", "").wantError(t, http.StatusNotFound)
	r = e.ctl("GET", "/volumes", "")
	var list []map[string]any
	r.json(t, &list)
	if len(list) != 1 || list[0]["volumeID"] != v.VolumeID || list[0]["name"] != "data" || list[0]["token"] != nil {
		t.Fatalf("list: %s", r.body)
	}

	// Mounted by a sandbox: shown in its info, and the volume cannot be destroyed.
	e.ctl("POST", "/sandboxes", `{"templateID":"base","volumeMounts":[{"name":"nosuch","path":"/mnt"}]}`).wantError(t, http.StatusBadRequest)
	e.ctl("POST", "/sandboxes", `{"templateID":"base","volumeMounts":[{"name":"data","path":"relative"}]}`).wantError(t, http.StatusBadRequest)
	e.ctl("POST", "/sandboxes", `{"templateID":"base","volumeMounts":[{"name":"data","path":"/proc/x"}]}`).wantError(t, http.StatusBadRequest)
	r = e.ctl("POST", "/sandboxes", `{"templateID":"base","volumeMounts":[{"name":"data","path":"/mnt/data"}]}`)
	if r.status != http.StatusCreated {
		t.Fatalf("create with a volume: %d %s", r.status, r.body)
	}
	var sb sandboxJSON
	r.json(t, &sb)
	r = e.ctl("GET", "/sandboxes/"+sb.SandboxID, "")
	if !strings.Contains(string(r.body), `"volumeMounts":[{"name":"data","path":"/mnt/data"}]`) {
		t.Fatalf("sandbox info: %s", r.body)
	}
	r = e.ctl("DELETE", "/volumes/"+v.VolumeID, "")
	r.wantError(t, http.StatusConflict)
	if !strings.Contains(string(r.body), "is in use by sandbox "+sb.SandboxID) {
		t.Fatalf("destroy while mounted: %s", r.body)
	}
	if r := e.ctl("DELETE", "/sandboxes/"+sb.SandboxID, ""); r.status != http.StatusNoContent {
		t.Fatalf("kill: %d %s", r.status, r.body)
	}
	if r := e.ctl("DELETE", "/volumes/"+v.VolumeID, ""); r.status != http.StatusNoContent {
		t.Fatalf("destroy: %d %s", r.status, r.body)
	}
	e.ctl("DELETE", "/volumes/"+v.VolumeID, "").wantError(t, http.StatusNotFound)
}

func TestVolumeContentAPI(t *testing.T) {
	e, _ := newVolumeEnv(t)
	var v volumeAndTokenJSON
	e.ctl("POST", "/volumes", `{"name":"c"}`).json(t, &v)
	var other volumeAndTokenJSON
	e.ctl("POST", "/volumes", `{"name":"other"}`).json(t, &other)
	base := "/volumecontent/" + v.VolumeID
	bearer := func(method, path, body string) resp {
		return e.do(method, path, body, "Authorization", "Bearer "+v.Token)
	}

	// The token: required, and only the volume's own.
	e.do("GET", base+"/path?path=/", "").wantError(t, http.StatusUnauthorized)
	e.do("GET", base+"/path?path=/", "", "X-API-Key", e.key).wantError(t, http.StatusUnauthorized)
	e.do("GET", base+"/path?path=/", "", "Authorization", "Bearer "+other.Token).wantError(t, http.StatusUnauthorized)
	e.do("GET", "/volumecontent/nosuch/path?path=/", "", "Authorization", "Bearer "+v.Token).wantError(t, http.StatusNotFound)

	r := bearer("PUT", base+"/file?path=/a.txt&uid=1000&gid=1000&mode=420", "hello")
	if r.status != http.StatusCreated {
		t.Fatalf("write: %d %s", r.status, r.body)
	}
	var st volumeEntryJSON
	r.json(t, &st)
	if st.Name != "a.txt" || st.Type != "file" || st.Path != "/a.txt" || st.Size != 5 || st.Mode != 0o644 || st.UID != 1000 || st.GID != 1000 {
		t.Fatalf("written entry %+v", st)
	}
	bearer("PUT", base+"/file?path=/a.txt&force=false", "x").wantError(t, http.StatusConflict)
	if r := bearer("PUT", base+"/file?path=/a.txt&force=true", "bye"); r.status != http.StatusCreated {
		t.Fatalf("overwrite: %d %s", r.status, r.body)
	}
	r = bearer("GET", base+"/file?path=/a.txt", "")
	if r.status != 200 || string(r.body) != "bye" || r.header.Get("Content-Type") != "application/octet-stream" {
		t.Fatalf("read: %d %q", r.status, r.body)
	}
	bearer("GET", base+"/file?path=/nope", "").wantError(t, http.StatusNotFound)
	bearer("PUT", base+"/file?path=/no/dir/f", "x").wantError(t, http.StatusNotFound)

	if r := bearer("POST", base+"/dir?path=/d/e&force=true", ""); r.status != http.StatusCreated {
		t.Fatalf("mkdir -p: %d %s", r.status, r.body)
	}
	bearer("POST", base+"/dir?path=/d", "").wantError(t, http.StatusConflict)
	bearer("POST", base+"/dir?path=/x/y", "").wantError(t, http.StatusNotFound)
	r = bearer("GET", base+"/dir?path=/", "")
	var entries []volumeEntryJSON
	r.json(t, &entries)
	if r.status != 200 || len(entries) != 2 {
		t.Fatalf("list: %d %s", r.status, r.body)
	}
	bearer("GET", base+"/dir?path=/nope", "").wantError(t, http.StatusNotFound)
	r = bearer("GET", base+"/path?path=/d", "")
	r.json(t, &st)
	if st.Type != "directory" || st.Path != "/d" || !strings.HasSuffix(st.Mtime, "Z") {
		t.Fatalf("stat dir: %s", r.body)
	}
	r = bearer("PATCH", base+"/path?path=/a.txt", `{"uid":1001,"gid":1002,"mode":493}`)
	r.json(t, &st)
	if r.status != 200 || st.UID != 1001 || st.GID != 1002 || st.Mode != 0o755 {
		t.Fatalf("patch: %d %s", r.status, r.body)
	}
	bearer("PATCH", base+"/path?path=/nope", `{"mode":420}`).wantError(t, http.StatusNotFound)
	if r := bearer("DELETE", base+"/path?path=/d", ""); r.status != http.StatusNoContent {
		t.Fatalf("remove dir: %d %s", r.status, r.body)
	}
	bearer("DELETE", base+"/path?path=/d", "").wantError(t, http.StatusNotFound)

	// Traversal is refused before anything is touched.
	for _, p := range []string{"/../x", "..", "/a/../../etc/passwd"} {
		for _, op := range []string{"GET /file", "GET /path", "GET /dir", "PUT /file", "DELETE /path", "POST /dir"} {
			m, o, _ := strings.Cut(op, " ")
			bearer(m, base+o+"?path="+p, "x").wantError(t, http.StatusBadRequest)
		}
	}
	bearer("GET", base+"/file", "").wantError(t, http.StatusBadRequest) // no path
	bearer("PUT", base+"/file?path=/f&mode=abc", "").wantError(t, http.StatusBadRequest)
	bearer("POST", base+"/file?path=/f", "").wantError(t, http.StatusMethodNotAllowed)
	bearer("GET", base+"/other?path=/f", "").wantError(t, http.StatusNotFound)
}
