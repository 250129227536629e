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
	"testing"
	"time"

	"github.com/ember-sandbox/ember/internal/codeinterp"
	"github.com/ember-sandbox/ember/internal/testutil"
)

// codeInterpScript drives the unmodified @e2b/code-interpreter (test/sdk's pinned version) on
// loopback. Every create waits first until the template's restored pool has an instance ready
// (GET /ember/pools), so "create" is a warm-pool create; base's creates are measured the same
// way in the same run. Then, per iteration: the first runCode('1+1') after the create, a
// second one on the now-warm context next to commands.run('true') in the same sandbox, and a
// matplotlib plot returned as a PNG. Durations in ms, as JSON.
const codeInterpScript = `
import { Sandbox } from '@e2b/code-interpreter'
const n = +process.env.ITERATIONS
const api = process.env.E2B_API_URL, key = process.env.E2B_API_KEY
const out = { createCI: [], createBase: [], firstRun: [], warmRun: [], cmdTrue: [], plot: [] }
async function poolReady(tpl) {
  for (let i = 0; i < 600; i++) {
    const r = await fetch(api + '/ember/pools', { headers: { 'X-API-Key': key } })
    const ps = await r.json()
    if (ps.some(p => p.templateID === tpl && p.kind === 'restored' && p.ready > 0)) return
    await new Promise(res => setTimeout(res, 100))
  }
  throw new Error('the pool of ' + tpl + ' stayed empty')
}
const plot = 'import matplotlib.pyplot as plt\nplt.figure()\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()'
for (let i = 0; i < n; i++) {
  await poolReady('base')
  let t0 = performance.now()
  const b = await Sandbox.create('base')
  out.createBase.push(performance.now() - t0)
  await b.kill()

  await poolReady('code-interpreter-v1')
  t0 = performance.now()
  const s = await Sandbox.create('code-interpreter-v1')
  const t1 = performance.now()
  const first = await s.runCode('1+1')
  const t2 = performance.now()
  if (first.text !== '2') throw new Error('runCode(1+1) gave ' + JSON.stringify(first))
  out.createCI.push(t1 - t0); out.firstRun.push(t2 - t1)
  for (let j = 0; j < 5; j++) {
    let u = performance.now()
    await s.runCode('1+1')
    out.warmRun.push(performance.now() - u)
    u = performance.now()
    await s.commands.run('true')
    out.cmdTrue.push(performance.now() - u)
  }
  const u = performance.now()
  const p = await s.runCode(plot)
  out.plot.push(performance.now() - u)
  if (!p.results.some(r => r.png)) throw new Error('no PNG: ' + JSON.stringify(p))
  await s.kill()
}
console.log(JSON.stringify(out))
`

const codeInterpIterations = 20

// BenchmarkCodeInterpreter: E2B's Code Interpreter SDK against ember (issue 20's targets):
// Sandbox.create() of code-interpreter-v1 from the warm pool against base's, runCode('1+1') on
// a warm context against commands.run('true'), the first runCode after a create, and a
// matplotlib plot returned as a PNG. The template is built on the benchmark's node first (its
// build time is printed). EMBER_BENCH_URL and EMBER_BENCH_KEY point it at a running daemon
// instead (which builds the template on its first create if it lacks it).
func BenchmarkCodeInterpreter(b *testing.B) {
	sdkDir := filepath.Join(testutil.RepoRoot(), "test", "sdk")
	_, err := os.Stat(filepath.Join(sdkDir, "node_modules", "@e2b", "code-interpreter"))
	testutil.Need(b, err == nil, "test/sdk/node_modules/@e2b/code-interpreter is missing (cd test/sdk && npm ci)")
	_, err = exec.LookPath("node")
	testutil.Need(b, err == nil, "node is not installed")
	url, key := os.Getenv("EMBER_BENCH_URL"), os.Getenv("EMBER_BENCH_KEY")
	if url == "" {
		n := getNode(b, 2)
		url, key = n.url, n.key
		t0 := time.Now()
		if _, err := n.Builds.EnsureBuiltin(context.Background(), codeinterp.TemplateName, nil); err != nil {
			b.Fatalf("build %s: %v", codeinterp.TemplateName, err)
		}
		fmt.Printf("\n%s ready in %s (a build when the node had none)\n", codeinterp.TemplateName, time.Since(t0).Round(time.Second))
	}
	fmt.Printf("\n== E2B Code Interpreter through @e2b/code-interpreter (%d iterations, medians and p99) ==\n", codeInterpIterations)
	cmd := exec.Command("node", "--input-type=module", "-e", codeInterpScript)
	cmd.Dir = sdkDir
	cmd.Env = append(os.Environ(), "E2B_API_URL="+url, "E2B_SANDBOX_URL="+url, "E2B_API_KEY="+key,
		"E2B_DOMAIN=ember.local", "ITERATIONS="+strconv.Itoa(codeInterpIterations))
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
	d := map[string]dist{}
	for k, v := range raw {
		for _, f := range v {
			d[k] = append(d[k], time.Duration(f*float64(time.Millisecond)))
		}
	}
	report(b, "Sandbox.create() code-interpreter-v1 (pool)", d["createCI"])
	report(b, "  baseline: Sandbox.create() base (pool)", d["createBase"])
	report(b, "first runCode('1+1') after create", d["firstRun"])
	report(b, "runCode('1+1'), warm context", d["warmRun"])
	report(b, "  baseline: commands.run('true')", d["cmdTrue"])
	report(b, "matplotlib plot as PNG (runCode)", d["plot"])
}
