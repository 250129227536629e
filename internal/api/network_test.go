package api

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/ember-sandbox/ember/internal/sandbox"
)

func TestCreateNetworkValidation(t *testing.T) {
	e := newEnv(t)
	for _, tc := range []struct {
		name    string
		network string
		status  int
		msg     string // substring of the message
	}{
		{"deny domain", `{"denyOut":["example.com"]}`, 400, "invalid denied CIDR example.com"},
		{"allow domain without ALL_TRAFFIC", `{"allowOut":["example.com"]}`, 400, sandbox.ErrMsgDomainsRequireBlockAll},
		{"allow domain with ALL_TRAFFIC", `{"allowOut":["example.com","*.example.org"],"denyOut":["0.0.0.0/0"]}`, 201, ""},
		{"allow internal name", `{"allowOut":["metadata.google.internal"],"denyOut":["0.0.0.0/0"]}`, 400, "internal names cannot be reached"},
		{"allow localhost", `{"allowOut":["localhost"],"denyOut":["0.0.0.0/0"]}`, 400, "internal names cannot be reached"},
		{"allow unspecified address", `{"allowOut":["0.0.0.0"]}`, 400, "invalid allowed address 0.0.0.0"},
		{"deny ipv6", `{"denyOut":["2001:db8::/32"]}`, 400, "only IPv4"},
		{"allow ipv6", `{"allowOut":["2001:db8::1"]}`, 400, "only IPv4"},
		{"mask host not ascii", `{"maskRequestHost":"hé.example:${PORT}"}`, 400, "is not ASCII"},
		{"mask host with space", `{"maskRequestHost":"a b"}`, 400, "mask request host is not valid"},
		{"rules", `{"rules":{"api.example.com":[{"transform":{"headers":{"Authorization":"Bearer ${e2b.secrets.key}"}}}]}}`, 201, ""},
		{"rule header injection", `{"rules":{"api.example.com":[{"transform":{"headers":{"a":"b\r\nX-Evil: 1"}}}]}}`, 400, "invalid value of header a"},
		{"rule header name injection", `{"rules":{"api.example.com":[{"transform":{"headers":{"a\r\nb":"c"}}}]}}`, 400, "invalid header name"},
		{"rule sets Host", `{"rules":{"api.example.com":[{"transform":{"headers":{"Host":"evil"}}}]}}`, 400, "cannot be set by a rule"},
		{"rule for loopback", `{"rules":{"127.0.0.1":[{}]}}`, 400, "internal, loopback and link-local"},
		{"rule for metadata", `{"rules":{"169.254.169.254":[{}]}}`, 400, "internal, loopback and link-local"},
		{"rule for localhost", `{"rules":{"localhost":[{}]}}`, 400, "internal names"},
		{"rule with a bad secret name", `{"rules":{"a.example":[{"transform":{"headers":{"a":"${e2b.secrets.a b}"}}}]}}`, 400, "invalid secret"},
		{"huge rule set", `{"rules":{` + hugeRules() + `}}`, 400, "at most 64 domains"},
		{"egress proxy", `{"egressProxy":{"address":"203.0.113.7:1080","username":"u","password":"p"}}`, 201, ""},
		{"egress proxy on loopback", `{"egressProxy":{"address":"127.0.0.1:1080"}}`, 400, "internal, loopback and link-local"},
		{"egress proxy without port", `{"egressProxy":{"address":"proxy.example"}}`, 400, "host:port"},
		{"https ports", `{"httpsPorts":[8443]}`, 201, ""},
		{"https port of envd", `{"httpsPorts":[49983]}`, 400, "envd port"},
		{"https port out of range", `{"httpsPorts":[70000]}`, 400, "invalid port"},
		{"rule domains are lowered", `{"rules":{"API.Example.com":[{}]}}`, 201, ""},
		{"wrong type", `{"allowOut":"1.1.1.1"}`, 400, "allowOut"},
		{"valid lists", `{"allowOut":["1.1.1.1","8.8.8.0/24"],"denyOut":["0.0.0.0/0"]}`, 201, ""},
		{"valid mask", `{"maskRequestHost":"${PORT}-app.example.com"}`, 201, ""},
		{"empty object", `{}`, 201, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := e.ctl("POST", "/v2/sandboxes", `{"templateID":"base","network":`+tc.network+`}`)
			if tc.status != 201 {
				r.wantError(t, tc.status)
				var eb errorBody
				r.json(t, &eb)
				if !strings.Contains(eb.Message, tc.msg) {
					t.Fatalf("message %q, want it to contain %q", eb.Message, tc.msg)
				}
				return
			}
			if r.status != 201 {
				t.Fatalf("status %d: %s", r.status, r.body)
			}
		})
	}
}

func TestCreateNetworkKeptAndShown(t *testing.T) {
	e := newEnv(t)
	r := e.ctl("POST", "/v2/sandboxes", `{"templateID":"base","allow_internet_access":false,"network":{"allowOut":["1.1.1.1"],"denyOut":["8.8.8.8"]}}`)
	if r.status != 201 {
		t.Fatalf("create: %d %s", r.status, r.body)
	}
	var sbx sandboxJSON
	r.json(t, &sbx)
	if sbx.TrafficAccessToken != nil {
		t.Fatalf("trafficAccessToken %q without allowPublicTraffic:false", *sbx.TrafficAccessToken)
	}
	var detail struct {
		AllowInternetAccess *bool `json:"allowInternetAccess"`
		Network             struct {
			AllowOut []string `json:"allowOut"`
			DenyOut  []string `json:"denyOut"`
		} `json:"network"`
	}
	e.ctl("GET", "/sandboxes/"+sbx.SandboxID, "").json(t, &detail)
	if detail.AllowInternetAccess == nil || *detail.AllowInternetAccess ||
		fmt.Sprint(detail.Network.AllowOut, detail.Network.DenyOut) != "[1.1.1.1] [8.8.8.8]" {
		t.Fatalf("getInfo: %+v", detail)
	}
}

func TestTrafficAccessToken(t *testing.T) {
	e := newEnv(t)
	r := e.ctl("POST", "/v2/sandboxes", `{"templateID":"base","network":{"allowPublicTraffic":false}}`)
	if r.status != 201 {
		t.Fatalf("create: %d %s", r.status, r.body)
	}
	var sbx sandboxJSON
	r.json(t, &sbx)
	if sbx.TrafficAccessToken == nil || len(*sbx.TrafficAccessToken) < 16 {
		t.Fatalf("trafficAccessToken = %v, want a token", sbx.TrafficAccessToken)
	}
	tok := *sbx.TrafficAccessToken
	open := e.fake.add(sandbox.StateRunning, nil) // public traffic (the default)
	const missing = "Sandbox is secured with traffic access token. Token header 'e2b-traffic-access-token' is missing"
	const invalid = "Sandbox is secured with traffic access token. Provided token in header 'e2b-traffic-access-token' is invalid"
	host := func(id, port string) []string { return []string{"Host", port + "-" + id + ".ember.test"} }
	hdr := func(id, port string, extra ...string) []string {
		return append([]string{"E2b-Sandbox-Id", id, "E2b-Sandbox-Port", port}, extra...)
	}
	for _, tc := range []struct {
		name   string
		hdr    []string
		status int
		msg    string
	}{
		{"guest port without token", hdr(sbx.SandboxID, "8080"), 403, missing},
		{"guest port with a wrong token", hdr(sbx.SandboxID, "8080", "e2b-traffic-access-token", "nope"), 403, invalid},
		{"guest port with the token", hdr(sbx.SandboxID, "8080", "e2b-traffic-access-token", tok), 200, ""},
		{"host routing without token", host(sbx.SandboxID, "3000"), 403, missing},
		{"host routing with the token", append(host(sbx.SandboxID, "3000"), "E2B-Traffic-Access-Token", tok), 200, ""},
		{"envd port needs no traffic token", hdr(sbx.SandboxID, "49983"), 200, ""},
		{"public sandbox needs none", hdr(open.ID, "8080"), 200, ""},
		{"another sandbox's token is not needed there", hdr(open.ID, "8080", "e2b-traffic-access-token", "x"), 200, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := e.do("GET", "/x", "", tc.hdr...)
			if r.status != tc.status {
				t.Fatalf("status %d, want %d: %s", r.status, tc.status, r.body)
			}
			if tc.status == 403 {
				var body notRunningBody
				r.json(t, &body)
				if body.Code != 403 || body.Message != tc.msg || body.SandboxID != sbx.SandboxID {
					t.Fatalf("body %s", r.body)
				}
			}
		})
	}
	t.Run("unknown sandbox is still 502", func(t *testing.T) {
		if r := e.do("GET", "/x", "", hdr("nosuch", "8080")...); r.status != 502 {
			t.Fatalf("status %d", r.status)
		}
	})
}

func TestMaskRequestHost(t *testing.T) {
	e := newEnv(t)
	r := e.ctl("POST", "/v2/sandboxes", `{"templateID":"base","network":{"maskRequestHost":"app.internal:${PORT}"}}`)
	if r.status != 201 {
		t.Fatalf("create: %d %s", r.status, r.body)
	}
	var sbx sandboxJSON
	r.json(t, &sbx)
	for _, tc := range []struct {
		name, port, host, want string
	}{
		{"guest port masked with its number", "8080", "8080-" + sbx.SandboxID + ".ember.test:3000", "app.internal:8080"},
		{"another port", "3000", "3000-" + sbx.SandboxID + ".ember.test:3000", "app.internal:3000"},
		{"envd keeps the client's host", "49983", "49983-" + sbx.SandboxID + ".ember.test:3000", "49983-" + sbx.SandboxID + ".ember.test:3000"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := e.do("GET", "/echo", "", "Host", tc.host)
			if r.status != 200 {
				t.Fatalf("status %d: %s", r.status, r.body)
			}
			var got guestEcho
			r.json(t, &got)
			if got.Host != tc.want {
				t.Fatalf("guest saw Host %q, want %q", got.Host, tc.want)
			}
		})
	}
	plain := e.fake.add(sandbox.StateRunning, nil)
	r = e.do("GET", "/echo", "", "Host", "8080-"+plain.ID+".ember.test:3000")
	var got guestEcho
	r.json(t, &got)
	if got.Host != "8080-"+plain.ID+".ember.test:3000" {
		t.Fatalf("unmasked sandbox: guest saw Host %q", got.Host)
	}
}

func TestUpdateNetwork(t *testing.T) {
	e := newEnv(t)
	run := e.fake.add(sandbox.StateRunning, nil)
	// What the sandbox's network slot enforces now.
	rules := func(id string) string {
		sb, err := e.fake.Get(context.Background(), id)
		if err != nil {
			t.Fatal(err)
		}
		eg := e.fake.rig.Network.Egress(sb.Runtime.SlotIndex)
		return fmt.Sprint(eg.AllowInternet, eg.AllowOut, eg.DenyOut)
	}
	paused := e.fake.add(sandbox.StatePaused, nil)
	for _, tc := range []struct {
		name   string
		id     string
		body   string
		status int
		msg    string
		record string // the rules the sandbox's slot has afterwards
	}{
		{"replace lists", run.ID, `{"allowOut":["1.1.1.1"],"denyOut":["0.0.0.0/0"]}`, 204, "", "true [1.1.1.1/32] [0.0.0.0/0]"},
		{"internet off", run.ID, `{"allow_internet_access":false}`, 204, "", "false [] []"},
		{"internet kept, lists cleared", run.ID, `{"allowOut":["9.9.9.9"]}`, 204, "", "false [9.9.9.9/32] []"},
		{"empty body clears", run.ID, ``, 204, "", "false [] []"},
		{"bad deny", run.ID, `{"denyOut":["nope"]}`, 400, "invalid denied CIDR nope", ""},
		{"domain without ALL_TRAFFIC", run.ID, `{"allowOut":["example.com"]}`, 400, sandbox.ErrMsgDomainsRequireBlockAll, ""},
		{"domain", run.ID, `{"allowOut":["example.com"],"denyOut":["0.0.0.0/0"]}`, 204, "", "false [] [0.0.0.0/0]"},
		{"rules", run.ID, `{"rules":{"a.example":[{}]}}`, 204, "", "false [] []"},
		{"bad rule", run.ID, `{"rules":{"10.0.0.1":[{}]}}`, 400, "internal", ""},
		{"unknown sandbox", "nosuch", `{}`, 404, "", ""},
		{"paused sandbox", paused.ID, `{}`, 409, "paused", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := e.ctl("PUT", "/sandboxes/"+tc.id+"/network", tc.body)
			if tc.status != 204 {
				r.wantError(t, tc.status)
				var eb errorBody
				r.json(t, &eb)
				if !strings.Contains(eb.Message, tc.msg) {
					t.Fatalf("message %q, want it to contain %q", eb.Message, tc.msg)
				}
				return
			}
			if r.status != 204 {
				t.Fatalf("status %d: %s", r.status, r.body)
			}
			if got := rules(tc.id); got != tc.record {
				t.Fatalf("slot rules %q, want %q", got, tc.record)
			}
		})
	}
}

// No token, no wake: a paused sandbox with autoResume is resumed by traffic only once the
// request passed the checks a running sandbox would make — the traffic token on a guest port
// of a sandbox without public traffic, the envd access token on envd's port of a secured one.
func TestAutoResumeNeedsTheToken(t *testing.T) {
	e := newEnv(t)
	create := func(body string) sandboxJSON {
		r := e.ctl("POST", "/v2/sandboxes", body)
		if r.status != 201 {
			t.Fatalf("create: %d %s", r.status, r.body)
		}
		var sbx sandboxJSON
		r.json(t, &sbx)
		if r := e.ctl("POST", "/sandboxes/"+sbx.SandboxID+"/pause", ""); r.status != 204 {
			t.Fatalf("pause: %d %s", r.status, r.body)
		}
		return sbx
	}
	hdr := func(id, port string, extra ...string) []string {
		return append([]string{"E2b-Sandbox-Id", id, "E2b-Sandbox-Port", port}, extra...)
	}
	locked := create(`{"templateID":"base","autoPause":true,"autoResume":{"enabled":true},"network":{"allowPublicTraffic":false}}`)
	for _, h := range [][]string{hdr(locked.SandboxID, "8080"), hdr(locked.SandboxID, "8080", "e2b-traffic-access-token", "wrong")} {
		if r := e.do("GET", "/x", "", h...); r.status != 403 {
			t.Fatalf("guest port without the traffic token: %d %s", r.status, r.body)
		}
		if st := e.fake.state(locked.SandboxID); st != sandbox.StatePaused {
			t.Fatalf("a request without the traffic token woke the sandbox: %s", st)
		}
	}
	if r := e.do("GET", "/x", "", hdr(locked.SandboxID, "8080", "e2b-traffic-access-token", *locked.TrafficAccessToken)...); r.status != 200 {
		t.Fatalf("with the traffic token: %d %s", r.status, r.body)
	}
	if st := e.fake.state(locked.SandboxID); st != sandbox.StateRunning {
		t.Fatalf("the token's request did not wake the sandbox: %s", st)
	}

	secured := create(`{"templateID":"base","secure":true,"autoPause":true,"autoResume":{"enabled":true}}`)
	if secured.EnvdAccessToken == "" {
		t.Fatal("a secure sandbox without an envd access token")
	}
	for _, h := range [][]string{hdr(secured.SandboxID, "49983"), hdr(secured.SandboxID, "49983", "X-Access-Token", "wrong")} {
		e.do("GET", "/health", "", h...)
		if st := e.fake.state(secured.SandboxID); st != sandbox.StatePaused {
			t.Fatalf("a request to envd without its token woke the sandbox: %s", st)
		}
	}
	e.do("GET", "/health", "", hdr(secured.SandboxID, "49983", "X-Access-Token", secured.EnvdAccessToken)...)
	if st := e.fake.state(secured.SandboxID); st != sandbox.StateRunning {
		t.Fatalf("envd's token did not wake the sandbox: %s", st)
	}
}

func hugeRules() string {
	var b strings.Builder
	for i := range 65 {
		if i > 0 {
			b.WriteString(",")
		}
		fmt.Fprintf(&b, `"h%d.example":[{}]`, i)
	}
	return b.String()
}

// TestNetworkRulesReported: getInfo reports rules, egressProxy and httpsPorts as given, never
// the proxy's password.
func TestNetworkRulesReported(t *testing.T) {
	e := newEnv(t)
	r := e.ctl("POST", "/v2/sandboxes", `{"templateID":"base","network":{"allowOut":["api.example.com"],"denyOut":["0.0.0.0/0"],`+
		`"rules":{"api.example.com":[{"transform":{"headers":{"Authorization":"Bearer ${e2b.secrets.key}"}}}]},`+
		`"egressProxy":{"address":"socks5://203.0.113.7:1080","username":"u","password":"hunter2-pw"}}}`)
	if r.status != 201 {
		t.Fatalf("create: %d %s", r.status, r.body)
	}
	var sb struct {
		SandboxID string `json:"sandboxID"`
	}
	r.json(t, &sb)
	r = e.ctl("GET", "/sandboxes/"+sb.SandboxID, "")
	if r.status != 200 {
		t.Fatalf("get: %d %s", r.status, r.body)
	}
	body := string(r.body)
	for _, want := range []string{`"allowOut":["api.example.com"]`, `"Authorization":"Bearer ${e2b.secrets.key}"`,
		`"egressProxy":{"address":"socks5://203.0.113.7:1080","username":"u"}`} {
		if !strings.Contains(body, want) {
			t.Errorf("getInfo lacks %s: %s", want, body)
		}
	}
	if strings.Contains(body, "hunter2-pw") || strings.Contains(body, "secretsOwner") {
		t.Fatalf("getInfo shows the password or internals: %s", body)
	}
}
