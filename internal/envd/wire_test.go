package envd_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	pb "github.com/ember-sandbox/ember/api/gen/process"
	"github.com/ember-sandbox/ember/internal/envd"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// envelope frames one Connect streaming message.
func envelope(flags byte, payload string) []byte {
	b := make([]byte, 5+len(payload))
	b[0] = flags
	binary.BigEndian.PutUint32(b[1:5], uint32(len(payload)))
	copy(b[5:], payload)
	return b
}

// compact drops the insignificant whitespace that protojson randomly inserts.
func compact(s string) string {
	var b bytes.Buffer
	if err := json.Compact(&b, []byte(s)); err != nil {
		return s
	}
	return b.String()
}

type frame struct {
	flags   byte
	payload string
}

func readFrames(t *testing.T, r io.Reader) []frame {
	t.Helper()
	var out []frame
	for {
		var hdr [5]byte
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			return out
		}
		p := make([]byte, binary.BigEndian.Uint32(hdr[1:]))
		if _, err := io.ReadFull(r, p); err != nil {
			t.Fatalf("short frame: %v", err)
		}
		out = append(out, frame{hdr[0], string(p)})
	}
}

// TestWireFormat sends the exact bytes the JS SDK sends (Appendix A) and checks the JSON shapes.
func TestWireFormat(t *testing.T) {
	h := newHarness(t, envd.Config{AccessToken: "tok"})
	sdkHeaders := map[string]string{
		"Connect-Protocol-Version": "1",
		"E2b-Sandbox-Id":           "sbx1",
		"E2b-Sandbox-Port":         "49983",
		"X-Access-Token":           "tok",
		"User-Agent":               "e2b-js-sdk/2.51.0",
		"Accept-Encoding":          "gzip, deflate",
	}
	t.Run("Start stream", func(t *testing.T) {
		hdr := map[string]string{"Content-Type": "application/connect+json", "Authorization": basic("root"),
			"Connect-Timeout-Ms": "60000", "Keepalive-Ping-Interval": "50"}
		for k, v := range sdkHeaders {
			hdr[k] = v
		}
		body := envelope(0, `{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hello"],"envs":{"A":"1"},"cwd":"/tmp"},"stdin":false}`)
		code, resp, rh := doReq(t, http.MethodPost, h.url+"/process.Process/Start", bytes.NewReader(body), hdr)
		if code != 200 || rh.Get("Content-Type") != "application/connect+json" || rh.Get("Content-Encoding") != "" {
			t.Fatalf("%d %v", code, rh)
		}
		frames := readFrames(t, bytes.NewReader(resp))
		if len(frames) < 3 {
			t.Fatalf("frames %v", frames)
		}
		var start struct {
			Event struct {
				Start struct {
					Pid int `json:"pid"`
				} `json:"start"`
			} `json:"event"`
		}
		if err := json.Unmarshal([]byte(frames[0].payload), &start); err != nil || start.Event.Start.Pid == 0 || frames[0].flags != 0 {
			t.Fatalf("first frame %v", frames[0])
		}
		var out string
		for _, f := range frames[1 : len(frames)-2] {
			var d struct {
				Event struct {
					Data struct {
						Stdout []byte `json:"stdout"`
					} `json:"data"`
				} `json:"event"`
			}
			json.Unmarshal([]byte(f.payload), &d)
			out += string(d.Event.Data.Stdout)
		}
		if out != "hello\n" {
			t.Errorf("stdout %q from %v", out, frames)
		}
		end := frames[len(frames)-2]
		if compact(end.payload) != `{"event":{"end":{"exited":true,"status":"exit status 0"}}}` {
			t.Errorf("end frame %q", end.payload)
		}
		last := frames[len(frames)-1]
		if last.flags != 2 || last.payload != "{}" {
			t.Errorf("end-stream frame %v", last)
		}
	})

	t.Run("SendSignal unknown pid", func(t *testing.T) {
		hdr := map[string]string{"Content-Type": "application/json"}
		for k, v := range sdkHeaders {
			hdr[k] = v
		}
		code, resp, _ := doReq(t, http.MethodPost, h.url+"/process.Process/SendSignal",
			strings.NewReader(`{"process":{"pid":999999},"signal":"SIGNAL_SIGKILL"}`), hdr)
		if code != 404 || string(resp) != `{"code":"not_found","message":"process with pid 999999 not found"}` {
			t.Fatalf("%d %s", code, resp)
		}
	})

	t.Run("Connect unknown pid ends the stream with not_found", func(t *testing.T) {
		hdr := map[string]string{"Content-Type": "application/connect+json"}
		for k, v := range sdkHeaders {
			hdr[k] = v
		}
		code, resp, _ := doReq(t, http.MethodPost, h.url+"/process.Process/Connect", bytes.NewReader(envelope(0, `{"process":{"pid":999999}}`)), hdr)
		frames := readFrames(t, bytes.NewReader(resp))
		if code != 200 || len(frames) != 1 || frames[0].flags != 2 || !strings.Contains(frames[0].payload, `"code":"not_found"`) {
			t.Fatalf("%d %v", code, frames)
		}
	})

	t.Run("ListDir JSON", func(t *testing.T) {
		dir := t.TempDir()
		os.WriteFile(dir+"/a.txt", []byte("hello"), 0o644)
		hdr := map[string]string{"Content-Type": "application/json", "Authorization": basic("root")}
		for k, v := range sdkHeaders {
			hdr[k] = v
		}
		code, resp, _ := doReq(t, http.MethodPost, h.url+"/filesystem.Filesystem/ListDir", strings.NewReader(`{"path":"`+dir+`","depth":1}`), hdr)
		want := `{"entries":[{"name":"a.txt","type":"FILE_TYPE_FILE","path":"` + dir + `/a.txt","size":"5","mode":420,"permissions":"-rw-r--r--","owner":"root","group":"root","modifiedTime":`
		if code != 200 || !strings.HasPrefix(compact(string(resp)), want) {
			t.Fatalf("%d %s", code, resp)
		}
	})

	t.Run("RPC without token is unauthenticated", func(t *testing.T) {
		code, resp, _ := doReq(t, http.MethodPost, h.url+"/process.Process/List", strings.NewReader(`{}`), map[string]string{"Content-Type": "application/json"})
		if code != 401 || !strings.Contains(string(resp), `"code":"unauthenticated"`) {
			t.Fatalf("%d %s", code, resp)
		}
		code, resp, _ = doReq(t, http.MethodPost, h.url+"/process.Process/Start", bytes.NewReader(envelope(0, `{"process":{"cmd":"/bin/true"}}`)),
			map[string]string{"Content-Type": "application/connect+json"})
		frames := readFrames(t, bytes.NewReader(resp))
		if code != 200 || len(frames) != 1 || !strings.Contains(frames[0].payload, `"code":"unauthenticated"`) {
			t.Fatalf("%d %v", code, frames)
		}
		if _, err := h.proc.List(context.Background(), connect.NewRequest(&pb.ListRequest{})); codeOf(err) != connect.CodeUnauthenticated {
			t.Fatalf("client: %v", err)
		}
	})
}

// TestServeH2C runs envd on a real loopback listener and talks HTTP/2 without TLS.
func TestServeH2C(t *testing.T) {
	testutilRoot(t)
	srv := envd.New(envd.Config{DefaultUser: "root"})
	t.Cleanup(func() { srv.Close() })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, ln) }()
	t.Cleanup(func() {
		cancel()
		<-done
	})

	var protocols http.Protocols
	protocols.SetUnencryptedHTTP2(true)
	client := &http.Client{Transport: &http.Transport{Protocols: &protocols, TLSClientConfig: &tls.Config{}}}
	resp, err := client.Get("http://" + ln.Addr().String() + "/health")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 204 || resp.ProtoMajor != 2 {
		t.Fatalf("status %d proto %s", resp.StatusCode, resp.Proto)
	}
	// Client streaming works over h2c as well.
	pc := newProcClient(client, "http://"+ln.Addr().String())
	stream, err := pc.Start(context.Background(), connect.NewRequest(&pb.StartRequest{Process: bash("echo h2")}))
	if err != nil {
		t.Fatal(err)
	}
	if r := collect[*pb.StartResponse](stream); r.stdout != "h2\n" || r.end.GetExitCode() != 0 {
		t.Fatalf("%+v", r)
	}
}

// TestReaper checks that orphans are reaped while tracked commands keep their exit codes.
func TestReaper(t *testing.T) {
	h := newHarness(t, envd.Config{ReapOrphans: true})
	// The orphan: bash exits at once, its background sleep is reparented to this (subreaper) process.
	r := h.run(t, "root", bash("sleep 0.3 >/dev/null 2>&1 & echo $!"), ptr(false))
	if r.err != nil || r.end.GetExitCode() != 0 {
		t.Fatalf("%+v", r)
	}
	orphan, err := strconv.Atoi(strings.TrimSpace(r.stdout))
	if err != nil {
		t.Fatal(err)
	}
	// Meanwhile many short commands must all report their own exit status.
	var wg sync.WaitGroup
	errs := make(chan string, 40)
	for i := range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res := h.run(t, "root", bash("exit "+strconv.Itoa(i)), ptr(false))
			if res.err != nil || res.end.GetExitCode() != int32(i) {
				errs <- "exit " + strconv.Itoa(i) + ": " + res.end.String()
			}
		}()
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
	testutil.EventuallyOr(t, 5*time.Second, func() bool {
		_, err := os.Stat("/proc/" + strconv.Itoa(orphan))
		return os.IsNotExist(err)
	}, func() string {
		b, _ := os.ReadFile("/proc/" + strconv.Itoa(orphan) + "/stat")
		return fmt.Sprintf("orphan %d not reaped: %s", orphan, b)
	})
}
