package envd_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/ember-sandbox/ember/internal/testutil"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	fspb "github.com/ember-sandbox/ember/api/gen/filesystem"
	"github.com/ember-sandbox/ember/internal/envd"
)

type uploadEntry struct {
	Name     string            `json:"name"`
	Path     string            `json:"path"`
	Type     string            `json:"type"`
	Metadata map[string]string `json:"metadata"`
}

// upload posts files (multipart, or octet-stream when octet) with hdr and decodes the answer.
func upload(t *testing.T, h *harness, files map[string][]byte, order []string, octet bool, hdr map[string]string) (int, []uploadEntry, string) {
	t.Helper()
	all := map[string]string{}
	for k, v := range hdr {
		all[k] = v
	}
	q := map[string]string{}
	var code int
	var resp []byte
	if octet {
		q["path"] = order[0]
		all["Content-Type"] = "application/octet-stream"
		code, resp, _ = doReq(t, http.MethodPost, filesURL(h.url, q), bytes.NewReader(files[order[0]]), all)
	} else {
		if len(order) == 1 {
			q["path"] = order[0]
		}
		body, ct := multipartBody(t, files, order)
		all["Content-Type"] = ct
		code, resp, _ = doReq(t, http.MethodPost, filesURL(h.url, q), body, all)
	}
	var out []uploadEntry
	if code == http.StatusOK {
		if err := json.Unmarshal(resp, &out); err != nil {
			t.Fatalf("upload answer %s: %v", resp, err)
		}
	}
	return code, out, string(resp)
}

func TestFileMetadata(t *testing.T) {
	h := newHarness(t, envd.Config{})
	ctx := context.Background()
	dir := t.TempDir()
	stat := func(t *testing.T, p string) *fspb.EntryInfo {
		t.Helper()
		r, err := h.fs.Stat(ctx, connect.NewRequest(&fspb.StatRequest{Path: p}))
		if err != nil {
			t.Fatalf("stat %s: %v", p, err)
		}
		return r.Msg.GetEntry()
	}
	eq := func(t *testing.T, what string, got, want map[string]string) {
		t.Helper()
		if len(got) != len(want) {
			t.Fatalf("%s: metadata %v, want %v", what, got, want)
		}
		for k, v := range want {
			if got[k] != v {
				t.Fatalf("%s: metadata %v, want %v", what, got, want)
			}
		}
	}

	cases := []struct {
		name  string
		files []string
		octet bool
		hdr   map[string]string
		want  map[string]string
	}{
		{"multipart, keys lower-cased", []string{dir + "/a.txt"}, false, map[string]string{"X-Metadata-Author": "ann", "x-metadata-purpose": "test"}, map[string]string{"author": "ann", "purpose": "test"}},
		{"octet stream", []string{dir + "/b.txt"}, true, map[string]string{"X-Metadata-K": "v"}, map[string]string{"k": "v"}},
		{"multi-file: every file gets it", []string{dir + "/c1.txt", dir + "/c2.txt"}, false, map[string]string{"X-Metadata-Batch": "1"}, map[string]string{"batch": "1"}},
		{"no headers: none", []string{dir + "/d.txt"}, false, nil, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			files := map[string][]byte{}
			for _, p := range tc.files {
				files[p] = []byte("data")
			}
			code, out, resp := upload(t, h, files, tc.files, tc.octet, tc.hdr)
			if code != http.StatusOK || len(out) != len(tc.files) {
				t.Fatalf("upload %d %s", code, resp)
			}
			for i, p := range tc.files {
				eq(t, "answer", out[i].Metadata, tc.want)
				eq(t, "stat", stat(t, p).GetMetadata(), tc.want)
				if tc.want == nil && strings.Contains(resp, "metadata") {
					t.Fatalf("answer without metadata mentions it: %s", resp)
				}
			}
		})
	}

	t.Run("list, rename, direct xattrs", func(t *testing.T) {
		r, err := h.fs.ListDir(ctx, connect.NewRequest(&fspb.ListDirRequest{Path: dir, Depth: 1}))
		if err != nil {
			t.Fatal(err)
		}
		got := map[string]map[string]string{}
		for _, e := range r.Msg.GetEntries() {
			got[e.GetName()] = e.GetMetadata()
		}
		eq(t, "list b.txt", got["b.txt"], map[string]string{"k": "v"})

		mv, err := h.fs.Move(ctx, connect.NewRequest(&fspb.MoveRequest{Source: dir + "/a.txt", Destination: dir + "/moved/a.txt"}))
		if err != nil {
			t.Fatal(err)
		}
		eq(t, "moved", mv.Msg.GetEntry().GetMetadata(), map[string]string{"author": "ann", "purpose": "test"})

		p := dir + "/d.txt"
		for name, val := range map[string]string{"user.e2b.color": "blue", "user.other": "x", "user.e2b.bad": "\xff\xfe"} {
			if err := unix.Setxattr(p, name, []byte(val), 0); err != nil {
				t.Fatalf("setxattr %s: %v", name, err)
			}
		}
		eq(t, "set directly (non-UTF-8 and foreign xattrs skipped)", stat(t, p).GetMetadata(), map[string]string{"color": "blue"})
	})

	t.Run("overwrite replaces stale metadata", func(t *testing.T) {
		p := dir + "/b.txt"
		if code, _, resp := upload(t, h, map[string][]byte{p: []byte("new")}, []string{p}, true, nil); code != http.StatusOK {
			t.Fatalf("overwrite %d %s", code, resp)
		}
		eq(t, "after plain overwrite", stat(t, p).GetMetadata(), nil)
		p = dir + "/c1.txt"
		if code, _, resp := upload(t, h, map[string][]byte{p: []byte("new")}, []string{p}, false, map[string]string{"X-Metadata-Other": "2"}); code != http.StatusOK {
			t.Fatalf("overwrite %d %s", code, resp)
		}
		eq(t, "after overwrite with new metadata", stat(t, p).GetMetadata(), map[string]string{"other": "2"})
		// Foreign user xattrs are not metadata and are left alone.
		if _, err := unix.Getxattr(dir+"/d.txt", "user.other", make([]byte, 8)); err != nil {
			t.Fatalf("user.other: %v", err)
		}
	})

	t.Run("invalid metadata is 400 and writes nothing", func(t *testing.T) {
		p := dir + "/never.txt"
		code, _, resp := upload(t, h, map[string][]byte{p: []byte("x")}, []string{p}, false, map[string]string{"X-Metadata-Big": strings.Repeat("v", 5000)})
		if code != http.StatusBadRequest {
			t.Fatalf("oversized: %d %s", code, resp)
		}
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Fatalf("file written: %v", err)
		}
	})
}

func TestSymlinkEntries(t *testing.T) {
	h := newHarness(t, envd.Config{})
	ctx := context.Background()
	dir := t.TempDir()
	for _, step := range []func() error{
		func() error { return os.WriteFile(dir+"/target.txt", []byte("t"), 0o600) },
		func() error { return os.Mkdir(dir+"/d", 0o750) },
		func() error { return os.Symlink("target.txt", dir+"/rel") },
		func() error { return os.Symlink(dir+"/target.txt", dir+"/abs") },
		func() error { return os.Symlink("d", dir+"/dirlink") },
		func() error { return os.Symlink("rel", dir+"/chain") },
		func() error { return os.Symlink("missing", dir+"/dangling") },
	} {
		if err := step(); err != nil {
			t.Fatal(err)
		}
	}
	cases := []struct {
		name       string
		wantTarget string
		wantType   fspb.FileType
		wantMode   uint32
	}{
		{"rel", dir + "/target.txt", fspb.FileType_FILE_TYPE_FILE, 0o600},
		{"abs", dir + "/target.txt", fspb.FileType_FILE_TYPE_FILE, 0o600},
		{"dirlink", dir + "/d", fspb.FileType_FILE_TYPE_DIRECTORY, 0o750},
		{"chain", dir + "/target.txt", fspb.FileType_FILE_TYPE_FILE, 0o600},
		{"dangling", dir + "/dangling", fspb.FileType_FILE_TYPE_UNSPECIFIED, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r, err := h.fs.Stat(ctx, connect.NewRequest(&fspb.StatRequest{Path: dir + "/" + tc.name}))
			if err != nil {
				t.Fatal(err)
			}
			e := r.Msg.GetEntry()
			if e.GetSymlinkTarget() != tc.wantTarget || e.GetType() != tc.wantType || e.GetMode() != tc.wantMode ||
				e.GetName() != tc.name || e.GetPath() != dir+"/"+tc.name || !strings.HasPrefix(e.GetPermissions(), "L") {
				t.Fatalf("entry %v; want target %s type %v mode %o", e, tc.wantTarget, tc.wantType, tc.wantMode)
			}
		})
	}
	t.Run("no symlink type on the wire", func(t *testing.T) {
		r, err := h.fs.ListDir(ctx, connect.NewRequest(&fspb.ListDirRequest{Path: dir, Depth: 1}))
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range r.Msg.GetEntries() {
			if e.GetType() == fspb.FileType_FILE_TYPE_SYMLINK {
				t.Fatalf("%s listed as FILE_TYPE_SYMLINK", e.GetName())
			}
		}
	})
}

func TestReadNonSeekable(t *testing.T) {
	h := newHarness(t, envd.Config{})
	fifo := t.TempDir() + "/fifo"
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	go func() {
		f, err := os.OpenFile(fifo, os.O_WRONLY, 0)
		if err != nil {
			return
		}
		defer f.Close()
		_, _ = f.WriteString("through a pipe\n")
	}()
	bootID, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	testutil.Need(t, err == nil, fmt.Sprintf("no boot_id: %v", err))
	cases := []struct {
		name, path string
		want       func([]byte) bool
	}{
		{"procfs", "/proc/sys/kernel/random/boot_id", func(b []byte) bool { return bytes.Equal(b, bootID) }},
		{"proc status", "/proc/self/status", func(b []byte) bool { return bytes.HasPrefix(b, []byte("Name:")) }},
		{"fifo", fifo, func(b []byte) bool { return string(b) == "through a pipe\n" }},
		{"empty device", "/dev/null", func(b []byte) bool { return len(b) == 0 }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			done := make(chan struct{})
			var code int
			var body []byte
			var hdr http.Header
			go func() {
				defer close(done)
				code, body, hdr = doReq(t, http.MethodGet, filesURL(h.url, map[string]string{"path": tc.path}), nil, nil)
			}()
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				t.Fatal("read did not finish")
			}
			if code != http.StatusOK || !tc.want(body) {
				t.Fatalf("%d %q", code, body)
			}
			if len(body) == 0 && hdr.Get("Content-Length") != "0" {
				t.Fatalf("empty answer without Content-Length: 0 (%v)", hdr)
			}
		})
	}
}

func TestWatchEntryAndNetworkMounts(t *testing.T) {
	h := newHarness(t, envd.Config{})
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	stream, err := h.fs.WatchDir(ctx, connect.NewRequest(&fspb.WatchDirRequest{Path: dir, IncludeEntry: true, AllowNetworkMounts: true}))
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	if !stream.Receive() || stream.Msg().GetStart() == nil {
		t.Fatalf("no start event: %v", stream.Err())
	}
	if err := os.WriteFile(filepath.Join(dir, "new.txt"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	for stream.Receive() {
		ev := stream.Msg().GetFilesystem()
		if ev == nil || ev.GetName() != "new.txt" || ev.GetType() != fspb.EventType_EVENT_TYPE_CREATE {
			continue
		}
		if ev.GetEntry().GetPath() != filepath.Join(dir, "new.txt") || ev.GetEntry().GetType() != fspb.FileType_FILE_TYPE_FILE {
			t.Fatalf("create event entry %v", ev.GetEntry())
		}
		return
	}
	t.Fatalf("no create event: %v", stream.Err())
}

func TestSignatureMessages(t *testing.T) {
	const token = "tok-secret"
	h := newHarness(t, envd.Config{AccessToken: token})
	path := t.TempDir() + "/s.txt"
	if err := os.WriteFile(path, []byte("s"), 0o644); err != nil {
		t.Fatal(err)
	}
	now := time.Now().Unix()
	past := now - 10
	cases := []struct {
		name   string
		q      map[string]string
		hdr    map[string]string
		status int
		msg    string
	}{
		{"expired", map[string]string{"path": path, "signature": envd.Signature(path, "read", "", token, past), "signature_expiration": itoa(past)}, nil, 401, "signature is already expired"},
		{"invalid", map[string]string{"path": path, "signature": "v1_nope"}, nil, 401, "invalid signature"},
		{"forged and expired: invalid first", map[string]string{"path": path, "signature": "v1_nope", "signature_expiration": itoa(past)}, nil, 401, "invalid signature"},
		{"missing", map[string]string{"path": path}, nil, 401, "missing signature query parameter"},
		{"wrong header token", map[string]string{"path": path}, map[string]string{"X-Access-Token": "nope"}, 401, "access token present in header but does not match"},
		{"bad expiration", map[string]string{"path": path, "signature": "v1_x", "signature_expiration": "soon"}, nil, 400, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			code, resp, _ := doReq(t, http.MethodGet, filesURL(h.url, tc.q), nil, tc.hdr)
			var e struct {
				Code    int    `json:"code"`
				Message string `json:"message"`
			}
			_ = json.Unmarshal(resp, &e)
			if code != tc.status || e.Code != tc.status || (tc.msg != "" && e.Message != tc.msg) {
				t.Fatalf("%d %s; want %d %q", code, resp, tc.status, tc.msg)
			}
		})
	}
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

// TestFilesystemErrorWording: the Connect codes and messages E2B's envd gives, which the SDKs
// turn into FileNotFoundError, InvalidArgumentError, AuthenticationError or makeDir() = false.
func TestFilesystemErrorWording(t *testing.T) {
	h := newHarness(t, envd.Config{})
	ctx := context.Background()
	dir := t.TempDir()
	if err := os.WriteFile(dir+"/f", []byte("f"), 0o644); err != nil {
		t.Fatal(err)
	}
	missing := dir + "/missing"
	cases := []struct {
		name string
		call func() error
		code connect.Code
		msg  string
	}{
		{"stat missing", func() error {
			_, err := h.fs.Stat(ctx, connect.NewRequest(&fspb.StatRequest{Path: missing}))
			return err
		}, connect.CodeNotFound, "file not found: lstat " + missing + ": no such file or directory"},
		{"list missing", func() error {
			_, err := h.fs.ListDir(ctx, connect.NewRequest(&fspb.ListDirRequest{Path: missing}))
			return err
		}, connect.CodeNotFound, "path not found: stat " + missing + ": no such file or directory"},
		{"list a file", func() error {
			_, err := h.fs.ListDir(ctx, connect.NewRequest(&fspb.ListDirRequest{Path: dir + "/f"}))
			return err
		}, connect.CodeInvalidArgument, "path is not a directory: " + dir + "/f"},
		{"makedir existing dir", func() error {
			_, err := h.fs.MakeDir(ctx, connect.NewRequest(&fspb.MakeDirRequest{Path: dir}))
			return err
		}, connect.CodeAlreadyExists, "directory already exists: " + dir},
		{"makedir over a file", func() error {
			_, err := h.fs.MakeDir(ctx, connect.NewRequest(&fspb.MakeDirRequest{Path: dir + "/f"}))
			return err
		}, connect.CodeInvalidArgument, "path already exists but it is not a directory: " + dir + "/f"},
		{"move missing", func() error {
			_, err := h.fs.Move(ctx, connect.NewRequest(&fspb.MoveRequest{Source: missing, Destination: dir + "/x"}))
			return err
		}, connect.CodeNotFound, "source file not found: lstat " + missing + ": no such file or directory"},
		{"watch a file", func() error {
			_, err := h.fs.CreateWatcher(ctx, connect.NewRequest(&fspb.CreateWatcherRequest{Path: dir + "/f"}))
			return err
		}, connect.CodeInvalidArgument, "path " + dir + "/f not a directory"},
		{"unknown user", func() error {
			req := connect.NewRequest(&fspb.StatRequest{Path: dir})
			req.Header().Set("Authorization", basic("no-such-user-xyz"))
			_, err := h.fs.Stat(ctx, req)
			return err
		}, connect.CodeUnauthenticated, "invalid username: 'no-such-user-xyz'"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.call()
			var ce *connect.Error
			if !errors.As(err, &ce) || ce.Code() != tc.code || ce.Message() != tc.msg {
				t.Fatalf("err = %v; want %v %q", err, tc.code, tc.msg)
			}
		})
	}
}

// TestUploadErrorWording: E2B envd's statuses and messages for the uploads the SDK can get wrong.
func TestUploadErrorWording(t *testing.T) {
	h := newHarness(t, envd.Config{})
	dir := t.TempDir()
	cases := []struct {
		name   string
		q      map[string]string
		hdr    map[string]string
		body   string
		status int
		msg    string
	}{
		{"octet stream without path", nil, map[string]string{"Content-Type": "application/octet-stream"}, "x", 400, "path query parameter is required for raw body upload"},
		{"onto a directory", map[string]string{"path": dir}, map[string]string{"Content-Type": "application/octet-stream"}, "x", 400, "path is a directory: " + dir},
		{"bad gzip", map[string]string{"path": dir + "/g"}, map[string]string{"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"}, "not a gzip stream", 400, "error decompressing request body: gzip: invalid header"},
		{"unknown user", map[string]string{"path": dir + "/u", "username": "no-such-user-xyz"}, map[string]string{"Content-Type": "application/octet-stream"}, "x", 401, "error looking up user 'no-such-user-xyz': user: unknown user no-such-user-xyz"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			code, resp, _ := doReq(t, http.MethodPost, filesURL(h.url, tc.q), strings.NewReader(tc.body), tc.hdr)
			var e struct {
				Code    int    `json:"code"`
				Message string `json:"message"`
			}
			_ = json.Unmarshal(resp, &e)
			if code != tc.status || e.Code != tc.status || e.Message != tc.msg {
				t.Fatalf("%d %s; want %d %q", code, resp, tc.status, tc.msg)
			}
		})
	}
}
