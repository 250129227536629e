package api

import (
	"bufio"
	"connectrpc.com/connect"
	"context"
	"github.com/ember-sandbox/ember/api/gen/process"
	"github.com/ember-sandbox/ember/api/gen/process/processconnect"
	"github.com/ember-sandbox/ember/internal/runtime"
	"github.com/ember-sandbox/ember/internal/testutil"
	"io"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/auth"
	"github.com/ember-sandbox/ember/internal/sandbox"
)

func TestRoutingPrecedence(t *testing.T) {
	e := newEnv(t)
	a := e.fake.add(sandbox.StateRunning, nil)
	b := e.fake.add(sandbox.StateRunning, nil)
	sigA := auth.FileSignature("/a.txt", auth.OpRead, "", a.AccessToken, 0)
	sigAWrite := auth.FileSignature("/up.txt", auth.OpWrite, "root", a.AccessToken, time.Now().Unix()+60)
	sigB := auth.FileSignature("/a.txt", auth.OpRead, "", b.AccessToken, 0)

	tests := []struct {
		name     string
		method   string
		path     string
		hdr      []string
		wantHit  string // "id:port" the guest was reached for; "" = control plane
		wantCode int
	}{
		{"header routes to envd port by default", "GET", "/health", []string{"E2b-Sandbox-Id", a.ID}, a.ID + ":49983", 200},
		{"header with port", "GET", "/", []string{"E2b-Sandbox-Id", a.ID, "E2b-Sandbox-Port", "8080"}, a.ID + ":8080", 200},
		{"header beats host", "GET", "/x", []string{"E2b-Sandbox-Id", a.ID, "Host", "3000-" + b.ID + ".ember.test"}, a.ID + ":49983", 200},
		{"header beats signature", "GET", "/files?path=/a.txt&signature=" + url.QueryEscape(sigB), []string{"E2b-Sandbox-Id", a.ID}, a.ID + ":49983", 200},
		{"header beats control paths", "GET", "/sandboxes", []string{"E2b-Sandbox-Id", a.ID}, a.ID + ":49983", 200},
		{"host", "GET", "/", []string{"Host", "3000-" + b.ID + ".ember.test"}, b.ID + ":3000", 200},
		{"host with port", "GET", "/", []string{"Host", "3000-" + b.ID + ".ember.test:3000"}, b.ID + ":3000", 200},
		{"host upper case", "GET", "/", []string{"Host", "3000-" + strings.ToUpper(b.ID) + ".EMBER.test"}, b.ID + ":3000", 200},
		{"legacy host with clientID", "GET", "/", []string{"Host", "49983-" + b.ID + "-ember.ember.test:3000"}, b.ID + ":49983", 200},
		{"host beats signature", "GET", "/files?path=/a.txt&signature=" + url.QueryEscape(sigA), []string{"Host", "49983-" + b.ID + ".ember.test"}, b.ID + ":49983", 200},
		{"signature read", "GET", "/files?path=%2Fa.txt&signature=" + url.QueryEscape(sigA), nil, a.ID + ":49983", 200},
		{"signature picks the other sandbox", "GET", "/files?path=/a.txt&signature=" + url.QueryEscape(sigB), nil, b.ID + ":49983", 200},
		{"signature write with user and expiry", "POST", "/files?username=root&path=%2Fup.txt&signature=" + url.QueryEscape(sigAWrite) +
			"&signature_expiration=" + itoa(time.Now().Unix()+60), nil, a.ID + ":49983", 200},
		{"other domain is control plane", "GET", "/", []string{"Host", "3000-" + b.ID + ".other.test"}, "", 401},
		{"api host is control plane", "GET", "/v2/sandboxes", []string{"Host", "api.ember.test:3000"}, "", 401},
		{"files without signature is control plane", "GET", "/files?path=/a.txt", nil, "", 401},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := len(e.fake.hits())
			r := e.do(tt.method, tt.path, "", tt.hdr...)
			if r.status != tt.wantCode {
				t.Fatalf("status %d, want %d: %s", r.status, tt.wantCode, r.body)
			}
			hits := e.fake.hits()[before:]
			if tt.wantHit == "" {
				if len(hits) != 0 {
					t.Fatalf("reached the sandbox plane %v, want control plane", hits)
				}
				r.wantError(t, http.StatusUnauthorized)
				return
			}
			if !slices.Equal(hits, []string{tt.wantHit}) {
				t.Fatalf("guest hits %v, want [%s]", hits, tt.wantHit)
			}
		})
	}
}

func TestProxyKeepsRequest(t *testing.T) {
	e := newEnv(t)
	a := e.fake.add(sandbox.StateRunning, nil)
	big := strings.Repeat("x", 3<<20) // beyond the control plane's body limit: not applied here
	r := e.do("POST", "/filesystem.Filesystem/ListDir?a=1&b=%2F", big,
		"E2b-Sandbox-Id", a.ID, "E2b-Sandbox-Port", "49983", "X-Access-Token", a.AccessToken)
	if r.status != 200 {
		t.Fatalf("status %d: %.200s", r.status, r.body)
	}
	var echo guestEcho
	r.json(t, &echo)
	if echo.Method != "POST" || echo.Path != "/filesystem.Filesystem/ListDir" || echo.Query != "a=1&b=%2F" {
		t.Fatalf("guest saw %s %s ?%s", echo.Method, echo.Path, echo.Query)
	}
	if echo.Token != a.AccessToken || echo.SandboxID != a.ID {
		t.Fatalf("guest headers: token %q sandbox %q", echo.Token, echo.SandboxID)
	}
	if len(echo.Body) != len(big) {
		t.Fatalf("guest got %d body bytes, want %d", len(echo.Body), len(big))
	}
	if !strings.HasPrefix(echo.Host, "127.0.0.1:") {
		t.Fatalf("guest saw Host %q, want the client's Host", echo.Host)
	}
}

func TestSandboxPlaneNotRunning(t *testing.T) {
	e := newEnv(t)
	paused := e.fake.add(sandbox.StatePaused, nil)
	killed := e.fake.add(sandbox.StateRunning, nil)
	e.fake.Kill(t.Context(), killed.ID)
	down := e.fake.add(sandbox.StateRunning, nil)

	tests := []struct {
		name string
		hdr  []string
		want int
	}{
		{"unknown", []string{"E2b-Sandbox-Id", "nosuch"}, 502},
		{"paused", []string{"E2b-Sandbox-Id", paused.ID}, 502},
		{"killed", []string{"E2b-Sandbox-Id", killed.ID}, 502},
		{"empty id", []string{"E2b-Sandbox-Id", ""}, 502},
		{"odd characters", []string{"E2b-Sandbox-Id", "../etc"}, 502},
		{"debug sandbox id", []string{"E2b-Sandbox-Id", "debug_sandbox_id"}, 502},
		{"upper case", []string{"E2b-Sandbox-Id", "ABC"}, 502},
		{"host unknown", []string{"Host", "49983-nosuch.ember.test"}, 502},
		{"host paused", []string{"Host", "3000-" + paused.ID + ".ember.test"}, 502},
		{"bad port header", []string{"E2b-Sandbox-Id", paused.ID, "E2b-Sandbox-Port", "http"}, 400},
		{"port out of range", []string{"E2b-Sandbox-Id", paused.ID, "E2b-Sandbox-Port", "70000"}, 400},
		{"host port out of range", []string{"Host", "99999-" + paused.ID + ".ember.test"}, 400},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := e.do("GET", "/health", "", tt.hdr...)
			r.wantError(t, tt.want)
		})
	}

	t.Run("guest unreachable", func(t *testing.T) {
		e.fake.unreachable(down)
		r := e.do("GET", "/health", "", "E2b-Sandbox-Id", down.ID)
		r.wantError(t, 502)
	})
}

func TestSignatureRoutingRejects(t *testing.T) {
	e := newEnv(t)
	a := e.fake.add(sandbox.StateRunning, nil)
	p := e.fake.add(sandbox.StatePaused, nil)
	past := time.Now().Unix() - 10
	tests := []struct {
		name   string
		method string
		query  string
		want   int
	}{
		{"wrong token", "GET", "path=/a&signature=" + url.QueryEscape(auth.FileSignature("/a", "read", "", "tok-other", 0)), 401},
		{"other path", "GET", "path=/b&signature=" + url.QueryEscape(auth.FileSignature("/a", "read", "", a.AccessToken, 0)), 401},
		{"read signature used to write", "POST", "path=/a&signature=" + url.QueryEscape(auth.FileSignature("/a", "read", "", a.AccessToken, 0)), 401},
		{"expired", "GET", "path=/a&signature_expiration=" + itoa(past) + "&signature=" + url.QueryEscape(auth.FileSignature("/a", "read", "", a.AccessToken, past)), 401},
		{"bad expiration", "GET", "path=/a&signature_expiration=soon&signature=v1_x", 400},
		{"garbage", "GET", "path=/a&signature=v1_%00%ff", 401},
		{"paused sandbox", "GET", "path=/a&signature=" + url.QueryEscape(auth.FileSignature("/a", "read", "", p.AccessToken, 0)), 502},
		{"method", "DELETE", "path=/a&signature=" + url.QueryEscape(auth.FileSignature("/a", "read", "", a.AccessToken, 0)), 405},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := e.do(tt.method, "/files?"+tt.query, "")
			r.wantError(t, tt.want)
			if len(e.fake.hits()) != 0 {
				t.Fatalf("guest reached: %v", e.fake.hits())
			}
		})
	}
}

// The proxy must not buffer: the SDK blocks on the first Connect envelope of a stream.
func TestProxyStreamsWithoutBuffering(t *testing.T) {
	e := newEnv(t)
	a := e.fake.add(sandbox.StateRunning, nil)
	req, _ := http.NewRequest("POST", e.api.URL+"/stream", strings.NewReader("{}"))
	req.Header.Set("E2b-Sandbox-Id", a.ID)
	res, err := e.api.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	br := bufio.NewReader(res.Body)
	got := make(chan string, 1)
	go func() {
		line, _ := br.ReadString('\n')
		got <- line
	}()
	select {
	case line := <-got:
		if line != "chunk1\n" {
			t.Fatalf("first chunk %q", line)
		}
	case <-time.After(5 * time.Second):
		close(e.guest.release)
		t.Fatal("first chunk did not arrive while the guest was still streaming: the proxy buffers")
	}
	close(e.guest.release)
	rest, err := io.ReadAll(br)
	if err != nil || string(rest) != "chunk2\n" {
		t.Fatalf("rest %q err %v", rest, err)
	}
}

// The proxy forwards a request body that is still arriving after the guest started answering
// (the e2b SDK's streaming calls): the HTTP/1 server must not drain the body when the response
// starts, or the upstream write fails and the stream is cut.
func TestProxyFullDuplex(t *testing.T) {
	e := newEnv(t)
	a := e.fake.add(sandbox.StateRunning, nil)
	pr, pw := io.Pipe()
	req, _ := http.NewRequest("POST", e.api.URL+"/duplex", pr)
	req.Header.Set("E2b-Sandbox-Id", a.ID)
	done := make(chan struct{})
	var res *http.Response
	var err error
	go func() { res, err = e.api.Client().Do(req); close(done) }()
	io.WriteString(pw, "first\n")
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		pw.Close()
		t.Fatal("no response while the request body is still open")
	}
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	br := bufio.NewReader(res.Body)
	if line, _ := br.ReadString('\n'); line != "got first\n" {
		t.Fatalf("first answer %q", line)
	}
	io.WriteString(pw, "second")
	pw.Close()
	rest, err := io.ReadAll(br)
	if err != nil || string(rest) != "then second" {
		t.Fatalf("rest %q err %v", rest, err)
	}
}

func TestProxyWebSocketUpgrade(t *testing.T) {
	e := newEnv(t)
	a := e.fake.add(sandbox.StateRunning, nil)
	conn, err := net.DialTimeout("tcp", strings.TrimPrefix(e.api.URL, "http://"), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	_, err = io.WriteString(conn, "GET /ws HTTP/1.1\r\nHost: 3000-"+a.ID+".ember.test:3000\r\n"+
		"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
	if err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(conn)
	res, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	if res.StatusCode != http.StatusSwitchingProtocols || !strings.EqualFold(res.Header.Get("Upgrade"), "websocket") {
		t.Fatalf("upgrade answered %d %v", res.StatusCode, res.Header)
	}
	for _, msg := range []string{"hello", "again"} {
		if _, err := io.WriteString(conn, msg); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, len(msg))
		if _, err := io.ReadFull(br, buf); err != nil {
			t.Fatal(err)
		}
		if string(buf) != msg {
			t.Fatalf("echo %q, want %q", buf, msg)
		}
	}
	if hits := e.fake.hits(); !slices.Equal(hits, []string{a.ID + ":3000"}) {
		t.Fatalf("hits %v", hits)
	}
}

// The caller's API key (or E2B access token) never reaches the sandbox; envd's Basic user and
// an app's own bearer token do.
func TestProxyStripsCredentials(t *testing.T) {
	e := newEnv(t)
	a := e.fake.add(sandbox.StateRunning, nil)
	for _, tc := range []struct {
		name, header, value string
		kept                bool
	}{
		{"api key", "X-API-Key", e.key, false},
		{"api key as bearer", "Authorization", "Bearer " + e.key, false},
		{"access token as bearer", "Authorization", "Bearer sk_e2b_0123456789", false},
		// Every spelling authenticate accepts as the API key is stripped too.
		{"api key as lower-case bearer", "Authorization", "bearer " + e.key, false},
		{"api key as upper-case bearer", "Authorization", "BEARER " + e.key, false},
		{"api key as bearer, two spaces", "Authorization", "Bearer  " + e.key, false},
		{"api key as bearer, a tab", "Authorization", "Bearer \t" + e.key + " ", false},
		{"envd user", "Authorization", "Basic dXNlcjo=", true},
		{"app's own bearer", "Authorization", "Bearer app-token-1", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := e.do("GET", "/headers", "", "E2b-Sandbox-Id", a.ID, "E2b-Sandbox-Port", "8080", tc.header, tc.value)
			if r.status != 200 {
				t.Fatalf("status %d: %s", r.status, r.body)
			}
			var echo guestEcho
			r.json(t, &echo)
			got := echo.Headers[http.CanonicalHeaderKey(tc.header)]
			if tc.kept && got != tc.value || !tc.kept && (got == tc.value || strings.Contains(got, "e2b_")) {
				t.Fatalf("guest saw %s %q (kept=%v wanted)", tc.header, got, tc.kept)
			}
		})
	}
}

// A Connect client calling a sandbox that ended learns why (code unavailable, as the SDKs map a
// 502, with the reason in the message), for streams and unary calls alike.
func TestConnectCallsToAnEndedSandboxSayWhy(t *testing.T) {
	e := newEnv(t)
	sb := e.fake.add(sandbox.StateRunning, nil)
	if err := e.fake.rig.Driver.Crash(sb.Runtime.InstanceID, runtime.ExitOOM); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 2*time.Second, "the crashed sandbox ends", func() bool { return e.fake.state(sb.ID) == sandbox.StateKilled })
	hc := &http.Client{Transport: headerTransport{id: sb.ID, token: sb.AccessToken}}
	pc := processconnect.NewProcessClient(hc, e.api.URL)
	no := false
	stream, err := pc.Start(context.Background(), connect.NewRequest(&process.StartRequest{
		Process: &process.ProcessConfig{Cmd: "/bin/true"}, Stdin: &no}))
	if err == nil {
		for stream.Receive() {
		}
		err = stream.Err()
		stream.Close()
	}
	if connect.CodeOf(err) != connect.CodeUnavailable || !strings.Contains(err.Error(), "out of memory") {
		t.Fatalf("stream to an ended sandbox: %v (code %v), want unavailable naming the reason", err, connect.CodeOf(err))
	}
	_, err = pc.List(context.Background(), connect.NewRequest(&process.ListRequest{}))
	if connect.CodeOf(err) != connect.CodeUnavailable || !strings.Contains(err.Error(), "out of memory") {
		t.Fatalf("unary call to an ended sandbox: %v (code %v)", err, connect.CodeOf(err))
	}
	// The SDKs' plain HTTP calls (/files) still get E2B's JSON 502.
	r := e.do("GET", "/files?path=/x", "", "E2b-Sandbox-Id", sb.ID)
	r.wantError(t, 502)
}

type headerTransport struct{ id, token string }

func (h headerTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("E2b-Sandbox-Id", h.id)
	r.Header.Set("X-Access-Token", h.token)
	return http.DefaultTransport.RoundTrip(r)
}

// The sandbox plane's refusals are E2B's (client-proxy), status and JSON body word for word:
// a sandbox that is unknown, killed, ended or paused without autoResume is 502 "The sandbox was
// not found" (what the SDKs read as not running), a closed port of a running sandbox is 502
// "The sandbox is running but port is not open" with the port, and a missing or wrong traffic
// access token 403 naming the header (issue 22, item 4).
func TestSandboxPlaneErrorBodiesAreE2Bs(t *testing.T) {
	e := newEnv(t)
	paused := e.fake.add(sandbox.StatePaused, nil)
	killed := e.fake.add(sandbox.StateRunning, nil)
	e.fake.Kill(t.Context(), killed.ID)
	ended := e.fake.add(sandbox.StateRunning, nil)
	if err := e.fake.rig.Driver.Crash(ended.Runtime.InstanceID, runtime.ExitOOM); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 2*time.Second, "the crashed sandbox ends", func() bool { return e.fake.state(ended.ID) == sandbox.StateKilled })
	running := e.fake.add(sandbox.StateRunning, nil)
	e.fake.closePort(running, 8080)
	r := e.ctl("POST", "/v2/sandboxes", `{"templateID":"base","network":{"allowPublicTraffic":false}}`)
	var secured sandboxJSON
	r.json(t, &secured)

	notFound := func(id string) string {
		return `{"sandboxId":"` + id + `","message":"The sandbox was not found","code":502}`
	}
	for _, tc := range []struct {
		name   string
		hdr    []string
		status int
		body   string
	}{
		{"unknown", []string{"E2b-Sandbox-Id", "nosuch"}, 502, notFound("nosuch")},
		{"unknown by host", []string{"Host", "3000-nosuch.ember.test"}, 502, notFound("nosuch")},
		{"killed", []string{"E2b-Sandbox-Id", killed.ID}, 502, notFound(killed.ID)},
		{"ended (out of memory)", []string{"Host", "49983-" + ended.ID + ".ember.test"}, 502, notFound(ended.ID)},
		{"paused without autoResume", []string{"Host", "3000-" + paused.ID + ".ember.test"}, 502, notFound(paused.ID)},
		{"paused, envd port", []string{"E2b-Sandbox-Id", paused.ID}, 502, notFound(paused.ID)},
		{"port not open", []string{"Host", "8080-" + running.ID + ".ember.test"}, 502,
			`{"sandboxId":"` + running.ID + `","message":"The sandbox is running but port is not open","port":8080,"code":502}`},
		{"port not open by header", []string{"E2b-Sandbox-Id", running.ID, "E2b-Sandbox-Port", "8080"}, 502,
			`{"sandboxId":"` + running.ID + `","message":"The sandbox is running but port is not open","port":8080,"code":502}`},
		{"traffic token missing", []string{"Host", "3000-" + secured.SandboxID + ".ember.test"}, 403,
			`{"sandboxId":"` + secured.SandboxID + `","message":"Sandbox is secured with traffic access token. Token header 'e2b-traffic-access-token' is missing","code":403}`},
		{"traffic token wrong", []string{"Host", "3000-" + secured.SandboxID + ".ember.test", "E2b-Traffic-Access-Token", "nope"}, 403,
			`{"sandboxId":"` + secured.SandboxID + `","message":"Sandbox is secured with traffic access token. Provided token in header 'e2b-traffic-access-token' is invalid","code":403}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := e.do("GET", "/", "", tc.hdr...)
			if r.status != tc.status || strings.TrimSpace(string(r.body)) != tc.body {
				t.Fatalf("got %d %s\nwant %d %s", r.status, r.body, tc.status, tc.body)
			}
			if ct := r.header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
				t.Errorf("Content-Type %q", ct)
			}
		})
	}
}
