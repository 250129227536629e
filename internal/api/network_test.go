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
		{"allow domain with ALL_TRAFFIC: unsupported", `{"allowOut":["example.com"],"denyOut":["0.0.0.0/0"]}`, 400, "domain names in allow out are not supported"},
		{"allow unspecified address", `{"allowOut":["0.0.0.0"]}`, 400, "invalid allowed address 0.0.0.0"},
		{"deny ipv6", `{"denyOut":["2001:db8::/32"]}`, 400, "only IPv4"},
		{"allow ipv6", `{"allowOut":["2001:db8::1"]}`, 400, "only IPv4"},
		{"mask host not ascii", `{"maskRequestHost":"hé.example:${PORT}"}`, 400, "is not ASCII"},
		{"mask host with space", `{"maskRequestHost":"a b"}`, 400, "mask request host is not valid"},
		{"rules unsupported", `{"rules":{"api.example.com":[{"transform":{"headers":{"a":"b"}}}]}}`, 400, "not supported"},
		{"egress proxy unsupported", `{"egressProxy":{"address":"h:1080"}}`, 400, "not supported"},
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
		{"domain unsupported", run.ID, `{"allowOut":["example.com"],"denyOut":["0.0.0.0/0"]}`, 400, "not supported", ""},
		{"rules unsupported", run.ID, `{"rules":{"a.example":[{}]}}`, 400, "not supported", ""},
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
