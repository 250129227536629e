package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/sandbox"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// firstCmdScript drives the unmodified e2b SDK (test/sdk's pinned version): per iteration it
// creates a sandbox, runs `echo ok` twice and kills the sandbox, and prints the durations (ms)
// as JSON. SETTLE_MS between iterations lets the warm pool refill (0: a create–run–kill loop).
// undici's diagnostics channels (the SDK's HTTP client) split the first command from the SDK's
// side: the SDK's own work before its request goes out, the wait for the start event (the
// response headers come with it), the rest of the stream (output, exit, end event), and the
// SDK's work after the stream ended.
const firstCmdScript = `
import dc from 'node:diagnostics_channel'
import { Sandbox } from 'e2b'
const n = +process.env.ITERATIONS, settle = +process.env.SETTLE_MS
const out = { create: [], first: [], total: [], second: [], sdkBefore: [], toStart: [], toEnd: [], sdkAfter: [] }
let marks = {}
const start = (r) => r.path.includes('Process/Start')
dc.subscribe('undici:client:sendHeaders', ({ request }) => { if (start(request)) marks.sent ??= performance.now() })
dc.subscribe('undici:request:headers', ({ request }) => { if (start(request)) marks.headers ??= performance.now() })
dc.subscribe('undici:request:trailers', ({ request }) => { if (start(request)) marks.end ??= performance.now() })
for (let i = 0; i < n; i++) {
  const t0 = performance.now()
  const sbx = await Sandbox.create('base')
  const t1 = performance.now()
  marks = {}
  const r = await sbx.commands.run('echo ok')
  const t2 = performance.now()
  if (r.stdout !== 'ok\n') throw new Error('first command printed ' + JSON.stringify(r.stdout))
  const m = marks
  await sbx.commands.run('echo ok')
  const t3 = performance.now()
  out.create.push(t1 - t0); out.first.push(t2 - t1); out.total.push(t2 - t0); out.second.push(t3 - t2)
  if (m.sent && m.headers && m.end) {
    out.sdkBefore.push(m.sent - t1); out.toStart.push(m.headers - m.sent); out.toEnd.push(m.end - m.headers); out.sdkAfter.push(t2 - m.end)
  }
  await sbx.kill()
  if (settle > 0) await new Promise(res => setTimeout(res, settle))
}
console.log(JSON.stringify(out))
`

const firstCmdIterations = 20

// BenchmarkFirstCommand: SDK create → the first commands.run('echo ok') done, through the
// daemon's API and sandbox plane, with the pool warm and in a create–run–kill loop, next to
// its floor measured inside the sandbox: a plain `bash -l -c true` (issue 11, lever 5).
func BenchmarkFirstCommand(b *testing.B) {
	sdkDir := filepath.Join(testutil.RepoRoot(), "test", "sdk")
	_, err := os.Stat(filepath.Join(sdkDir, "node_modules", "e2b"))
	testutil.Need(b, err == nil, "test/sdk/node_modules/e2b is missing (cd test/sdk && npm ci)")
	_, err = exec.LookPath("node")
	testutil.Need(b, err == nil, "node is not installed")
	n := getNode(b, 2)
	fmt.Printf("\n== ember first command through the e2b SDK (%d iterations each, medians and p99) ==\n", firstCmdIterations)

	sdk := func(settle time.Duration) map[string]dist {
		cmd := exec.Command("node", "--input-type=module", "-e", firstCmdScript)
		cmd.Dir = sdkDir // bare 'e2b' resolves from here
		cmd.Env = append(os.Environ(), "E2B_API_URL="+n.url, "E2B_SANDBOX_URL="+n.url, "E2B_API_KEY="+n.key,
			"E2B_DOMAIN=ember.local", "ITERATIONS="+strconv.Itoa(firstCmdIterations),
			"SETTLE_MS="+strconv.Itoa(int(settle.Milliseconds())))
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			b.Fatalf("sdk script: %v\n%s", err, stderr.String())
		}
		var raw map[string][]float64
		if err := json.Unmarshal(out, &raw); err != nil {
			b.Fatalf("sdk script output %q: %v", out, err)
		}
		res := map[string]dist{}
		for k, v := range raw {
			for _, f := range v {
				res[k] = append(res[k], time.Duration(f*float64(time.Millisecond)))
			}
		}
		return res
	}
	warm := sdk(1500 * time.Millisecond)
	loop := sdk(0)
	inside := loginShellInside(b, n, "bash -l -c true")
	procFloor := loginShellInside(b, n, "/bin/true")

	report(b, "SDK create -> first run done (pool warm)", warm["total"])
	report(b, "  create (pool warm)", warm["create"])
	report(b, "  first commands.run (pool warm)", warm["first"])
	report(b, "    SDK before its request (pool warm)", warm["sdkBefore"])
	report(b, "    request -> start event (pool warm)", warm["toStart"])
	report(b, "    start event -> stream end (pool warm)", warm["toEnd"])
	report(b, "    SDK after the stream end (pool warm)", warm["sdkAfter"])
	report(b, "  second commands.run (pool warm)", warm["second"])
	report(b, "SDK create -> first run done (loop)", loop["total"])
	report(b, "  create (loop)", loop["create"])
	report(b, "  first commands.run (loop)", loop["first"])
	report(b, "baseline: bash -l -c true inside sandbox", inside)
	report(b, "  of which fork+exec+exit (/bin/true inside)", procFloor)
	fmt.Printf("first commands.run over its floor (p50): pool warm +%s ms, loop +%s ms (host load average %s)\n",
		ms(warm["first"].pct(0.5)-inside.pct(0.5)), ms(loop["first"].pct(0.5)-inside.pct(0.5)), loadAvg())
}

// loginShellInside times cmd (e.g. `bash -l -c true`) inside a sandbox, from bash itself
// ($EPOCHREALTIME needs no process), as the default user that commands.run uses.
func loginShellInside(b *testing.B, n *node, cmd string) dist {
	ctx := context.Background()
	sb, err := n.Manager.Create(ctx, sandbox.CreateRequest{TemplateID: "base"})
	if err != nil {
		b.Fatal(err)
	}
	defer n.Manager.Kill(ctx, sb.ID)
	script := fmt.Sprintf(`for i in $(seq %d); do s=$EPOCHREALTIME; %s; e=$EPOCHREALTIME; echo "$s $e"; done`, firstCmdIterations, cmd)
	out, err := n.run(sb, script)
	if err != nil {
		b.Fatalf("inside: %v: %s", err, out)
	}
	var d dist
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		f := strings.Fields(line)
		if len(f) != 2 {
			b.Fatalf("inside: line %q", line)
		}
		s, _ := strconv.ParseFloat(f[0], 64)
		e, _ := strconv.ParseFloat(f[1], 64)
		d = append(d, time.Duration((e-s)*float64(time.Second)))
	}
	return d
}

// loadAvg is the host's 1-minute load average (the figures above depend on it).
func loadAvg() string {
	data, _ := os.ReadFile("/proc/loadavg")
	if f := strings.Fields(string(data)); len(f) > 0 {
		return f[0]
	}
	return "?"
}
