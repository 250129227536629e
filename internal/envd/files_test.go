package envd_test

import (
	"bytes"
	"compress/gzip"
	"encoding/json"
	"io"
	"mime/multipart"
	"net/http"
	"net/textproto"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/envd"
)

type writeInfo struct {
	Name string `json:"name"`
	Path string `json:"path"`
	Type string `json:"type"`
}

// multipartBody builds the SDK's multipart upload: parts named "file", filename = destination.
func multipartBody(t *testing.T, files map[string][]byte, order []string) (io.Reader, string) {
	t.Helper()
	var buf bytes.Buffer
	mw := multipart.NewWriter(&buf)
	for _, name := range order {
		hdr := textproto.MIMEHeader{}
		hdr.Set("Content-Disposition", `form-data; name="file"; filename="`+name+`"`)
		hdr.Set("Content-Type", "application/octet-stream")
		pw, err := mw.CreatePart(hdr)
		if err != nil {
			t.Fatal(err)
		}
		pw.Write(files[name])
	}
	mw.Close()
	return &buf, mw.FormDataContentType()
}

func doReq(t *testing.T, method, u string, body io.Reader, hdr map[string]string) (int, []byte, http.Header) {
	t.Helper()
	req, err := http.NewRequest(method, u, body)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b, resp.Header
}

func filesURL(base string, q map[string]string) string {
	v := url.Values{}
	for k, s := range q {
		v.Set(k, s)
	}
	return base + "/files?" + v.Encode()
}

func ownerOf(t *testing.T, path string) uint32 {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Sys().(*syscall.Stat_t).Uid
}

func TestFilesWriteRead(t *testing.T) {
	h := newHarness(t, envd.Config{})
	dir := t.TempDir()
	binary := make([]byte, 256)
	for i := range binary {
		binary[i] = byte(i)
	}
	uid, _ := strconv.Atoi(testUser.Uid)
	cases := []struct {
		name     string
		path     string // ?path (destination)
		data     []byte
		octet    bool
		gzip     bool
		user     string
		wantPath string
		wantUID  int
	}{
		{name: "multipart text creates parents", path: dir + "/compat/a.txt", data: []byte("hello file"), wantPath: dir + "/compat/a.txt", wantUID: uid},
		{name: "binary", path: dir + "/bin.dat", data: binary, wantPath: dir + "/bin.dat", wantUID: uid},
		{name: "empty", path: dir + "/empty.txt", data: []byte{}, wantPath: dir + "/empty.txt", wantUID: uid},
		{name: "octet stream", path: dir + "/o.txt", data: []byte("octet"), octet: true, wantPath: dir + "/o.txt", wantUID: uid},
		{name: "octet gzip", path: dir + "/g.txt", data: bytes.Repeat([]byte("gz"), 5000), octet: true, gzip: true, wantPath: dir + "/g.txt", wantUID: uid},
		{name: "relative path in home", path: "rel.txt", data: []byte("r"), wantPath: filepath.Join(testUser.HomeDir, "rel.txt"), wantUID: uid},
		{name: "as root", path: dir + "/root.txt", data: []byte("x"), user: "root", wantPath: dir + "/root.txt", wantUID: 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			q := map[string]string{"path": tc.path}
			if tc.user != "" {
				q["username"] = tc.user
			}
			var body io.Reader
			hdr := map[string]string{}
			if tc.octet {
				hdr["Content-Type"] = "application/octet-stream"
				body = bytes.NewReader(tc.data)
				if tc.gzip {
					var zb bytes.Buffer
					zw := gzip.NewWriter(&zb)
					zw.Write(tc.data)
					zw.Close()
					body = &zb
					hdr["Content-Encoding"] = "gzip"
				}
			} else {
				var ct string
				body, ct = multipartBody(t, map[string][]byte{tc.path: tc.data}, []string{tc.path})
				hdr["Content-Type"] = ct
			}
			code, resp, _ := doReq(t, http.MethodPost, filesURL(h.url, q), body, hdr)
			if code != http.StatusOK {
				t.Fatalf("POST %d %s", code, resp)
			}
			var infos []writeInfo
			if err := json.Unmarshal(resp, &infos); err != nil {
				t.Fatal(err)
			}
			want := writeInfo{Name: filepath.Base(tc.wantPath), Path: tc.wantPath, Type: "file"}
			if len(infos) != 1 || infos[0] != want {
				t.Fatalf("response %s, want [%+v]", resp, want)
			}
			if got := ownerOf(t, tc.wantPath); int(got) != tc.wantUID {
				t.Errorf("owner uid %d, want %d", got, tc.wantUID)
			}

			rq := map[string]string{"path": tc.path}
			if tc.user != "" {
				rq["username"] = tc.user
			}
			code, got, rh := doReq(t, http.MethodGet, filesURL(h.url, rq), nil, nil)
			if code != http.StatusOK || !bytes.Equal(got, tc.data) {
				t.Fatalf("GET %d, %d bytes, want %d", code, len(got), len(tc.data))
			}
			if rh.Get("Content-Length") != strconv.Itoa(len(tc.data)) {
				t.Errorf("Content-Length %q, want %d", rh.Get("Content-Length"), len(tc.data))
			}
			if rh.Get("Content-Encoding") != "" {
				t.Errorf("response was compressed: %q", rh.Get("Content-Encoding"))
			}
		})
	}
}

func TestFilesMultiAndErrors(t *testing.T) {
	h := newHarness(t, envd.Config{})
	dir := t.TempDir()

	t.Run("multi-file without path query", func(t *testing.T) {
		p1, p2 := dir+"/m/m1.txt", dir+"/m/m2.txt"
		body, ct := multipartBody(t, map[string][]byte{p1: []byte("1"), p2: []byte("2")}, []string{p1, p2})
		code, resp, _ := doReq(t, http.MethodPost, h.url+"/files", body, map[string]string{"Content-Type": ct})
		if code != http.StatusOK {
			t.Fatalf("%d %s", code, resp)
		}
		var infos []writeInfo
		json.Unmarshal(resp, &infos)
		if len(infos) != 2 || infos[0].Path != p1 || infos[1].Path != p2 {
			t.Fatalf("%s", resp)
		}
		for p, want := range map[string]string{p1: "1", p2: "2"} {
			if b, _ := os.ReadFile(p); string(b) != want {
				t.Errorf("%s = %q", p, b)
			}
		}
	})

	cases := []struct {
		name     string
		path     string
		wantCode int
		wantMsg  string
	}{
		{"missing file is 404", "/nonexistent-envd-test/x", 404, "path '/nonexistent-envd-test/x' does not exist"},
		{"directory is 400", dir, 400, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			code, body, hdr := doReq(t, http.MethodGet, filesURL(h.url, map[string]string{"path": tc.path}), nil, nil)
			var e struct {
				Code    int    `json:"code"`
				Message string `json:"message"`
			}
			if err := json.Unmarshal(body, &e); err != nil || hdr.Get("Content-Type") != "application/json" {
				t.Fatalf("body %q (%v)", body, err)
			}
			if code != tc.wantCode || e.Code != tc.wantCode || (tc.wantMsg != "" && e.Message != tc.wantMsg) {
				t.Fatalf("%d %s", code, body)
			}
		})
	}

	t.Run("unknown user is 401", func(t *testing.T) {
		code, body, _ := doReq(t, http.MethodGet, filesURL(h.url, map[string]string{"path": "/etc/hostname", "username": "no-such-user-xyz"}), nil, nil)
		if code != http.StatusUnauthorized {
			t.Fatalf("%d %s", code, body)
		}
	})
}

func TestAccessTokenAndSignatures(t *testing.T) {
	const token = "tok-secret"
	h := newHarness(t, envd.Config{AccessToken: token})
	dir := t.TempDir()
	path := dir + "/up.txt"
	now := time.Now().Unix()

	t.Run("health needs no token", func(t *testing.T) {
		if code, _, _ := doReq(t, http.MethodGet, h.url+"/health", nil, nil); code != http.StatusNoContent {
			t.Fatalf("health %d", code)
		}
	})

	cases := []struct {
		name   string
		method string
		q      map[string]string
		hdr    map[string]string
		want   int
	}{
		{"no token", "GET", map[string]string{"path": "/etc/hostname"}, nil, 401},
		{"wrong token", "GET", map[string]string{"path": "/etc/hostname"}, map[string]string{"X-Access-Token": "nope"}, 401},
		{"right token", "GET", map[string]string{"path": "/etc/hostname"}, map[string]string{"X-Access-Token": token}, 200},
		{"signed upload", "POST", map[string]string{"path": path, "signature": envd.Signature(path, "write", "", token, 0)}, nil, 200},
		{"signed download", "GET", map[string]string{"path": path, "signature": envd.Signature(path, "read", "", token, 0)}, nil, 200},
		{"signature for another operation", "GET", map[string]string{"path": path, "signature": envd.Signature(path, "write", "", token, 0)}, nil, 401},
		{"signature for another path", "GET", map[string]string{"path": "/etc/hostname", "signature": envd.Signature(path, "read", "", token, 0)}, nil, 401},
		{"signed with user and expiration", "GET", map[string]string{"path": path, "username": "root",
			"signature": envd.Signature(path, "read", "root", token, now+60), "signature_expiration": strconv.FormatInt(now+60, 10)}, nil, 200},
		{"expired signature", "GET", map[string]string{"path": path,
			"signature": envd.Signature(path, "read", "", token, now-10), "signature_expiration": strconv.FormatInt(now-10, 10)}, nil, 401},
		{"envs need the token", "GET", nil, nil, 401},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			u := filesURL(h.url, tc.q)
			if tc.q == nil {
				u = h.url + "/envs"
			}
			var body io.Reader
			hdr := map[string]string{}
			for k, v := range tc.hdr {
				hdr[k] = v
			}
			if tc.method == "POST" {
				var ct string
				body, ct = multipartBody(t, map[string][]byte{path: []byte("via-url")}, []string{path})
				hdr["Content-Type"] = ct
			}
			code, resp, _ := doReq(t, tc.method, u, body, hdr)
			if code != tc.want {
				t.Fatalf("%s: %d %s, want %d", tc.name, code, resp, tc.want)
			}
			if code == 401 {
				var e struct {
					Code int `json:"code"`
				}
				if json.Unmarshal(resp, &e); e.Code != 401 {
					t.Errorf("401 body %s", resp)
				}
			}
			if tc.name == "signed download" && string(resp) != "via-url" {
				t.Errorf("downloaded %q", resp)
			}
		})
	}
}

func TestInitAndEnvs(t *testing.T) {
	h := newHarness(t, envd.Config{})
	post := func(body string, token string) int {
		hdr := map[string]string{"Content-Type": "application/json"}
		if token != "" {
			hdr["X-Access-Token"] = token
		}
		code, _, _ := doReq(t, http.MethodPost, h.url+"/init", bytes.NewBufferString(body), hdr)
		return code
	}
	steps := []struct {
		name  string
		body  string
		token string
		want  int
	}{
		{"first init sets the token", `{"envVars":{"A":"1"},"accessToken":"t1","defaultUser":"` + testUser.Username + `"}`, "", 204},
		{"re-init without the token", `{"accessToken":"t2"}`, "", 401},
		{"re-init with a wrong token", `{"accessToken":"t2"}`, "bad", 401},
		{"re-init with the token", `{"envVars":{"B":"2"},"accessToken":"t2"}`, "t1", 204},
		{"old token no longer works", `{}`, "t1", 401},
		{"new token works", `{}`, "t2", 204},
	}
	for _, st := range steps {
		t.Run(st.name, func(t *testing.T) {
			if got := post(st.body, st.token); got != st.want {
				t.Fatalf("init = %d, want %d", got, st.want)
			}
		})
	}
	code, body, _ := doReq(t, http.MethodGet, h.url+"/envs", nil, map[string]string{"X-Access-Token": "t2"})
	var envs map[string]string
	if err := json.Unmarshal(body, &envs); err != nil || code != 200 || envs["A"] != "1" || envs["B"] != "2" {
		t.Fatalf("envs %d %s", code, body)
	}
	code, body, _ = doReq(t, http.MethodGet, h.url+"/metrics", nil, map[string]string{"X-Access-Token": "t2"})
	var m map[string]any
	if err := json.Unmarshal(body, &m); err != nil || code != 200 {
		t.Fatalf("metrics %d %s", code, body)
	}
	for _, k := range []string{"ts", "cpu_count", "cpu_used_pct", "mem_total", "mem_used", "mem_cache", "disk_used", "disk_total", "mem_total_mib", "mem_used_mib"} {
		if _, ok := m[k]; !ok {
			t.Errorf("metrics lack %q: %s", k, body)
		}
	}
	if m["cpu_count"].(float64) < 1 || m["mem_total"].(float64) <= 0 || m["disk_total"].(float64) <= 0 {
		t.Errorf("implausible metrics %s", body)
	}
}
