// E2B's Code Interpreter against ember: the unmodified @e2b/code-interpreter (pinned in
// package-lock.json) on the `code-interpreter-v1` template, which ember builds itself on the
// first create that names it (its default template) and then restores like any other. Also
// E2B's CLI (@e2b/cli, pinned) listing templates and sandboxes, and `ember sandbox shell`
// driven through a real terminal (tmux).
import { after, before, describe, test } from 'node:test'
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { existsSync } from 'node:fs'
import { dirname, join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { promisify } from 'node:util'
import { Sandbox } from '@e2b/code-interpreter'
import { HOOK_TIMEOUT, LIFECYCLE_SKIP, SandboxTracker, TEST_TIMEOUT, sleep, waitFor } from './helpers.mjs'

const run = promisify(execFile)
const SDK_DIR = join(dirname(fileURLToPath(import.meta.url)), '..')
const EMBER_BIN = process.env.EMBER_BIN || join(SDK_DIR, '..', '..', 'bin', 'ember')
// The first create builds the template (apt inside a build sandbox, then a checkpoint).
const BUILD_TIMEOUT = 30 * 60_000
const CREATE_OPTS = Object.freeze({ timeoutMs: 600_000, envs: { SUITE_VAR: 'hello-env' } })

const sandboxes = new SandboxTracker()
after(() => sandboxes.killAll(), { timeout: HOOK_TIMEOUT })

/** @type {Sandbox} */
let sbx
before(async () => {
  const t0 = Date.now()
  sbx = sandboxes.add(await Sandbox.create({ ...CREATE_OPTS, requestTimeoutMs: BUILD_TIMEOUT }))
  // The build, when this create made it, is in the figure (the daemon log has its steps).
  console.log(`# first Sandbox.create() of code-interpreter-v1: ${((Date.now() - t0) / 1000).toFixed(1)} s`)
}, { timeout: BUILD_TIMEOUT + 60_000 })

describe('code interpreter', { timeout: HOOK_TIMEOUT * 4 }, () => {
  test('the default template is code-interpreter-v1, listed under its name', { timeout: TEST_TIMEOUT }, async () => {
    const info = await Sandbox.getInfo(sbx.sandboxId)
    assert.equal(info.templateId, 'code-interpreter-v1')
  })

  test('state is kept between runs; the last expression is the result', { timeout: TEST_TIMEOUT }, async () => {
    const a = await sbx.runCode('x = 41\nx')
    assert.equal(a.text, '41')
    const b = await sbx.runCode('x += 1\nx')
    assert.equal(b.text, '42')
    assert.ok(b.executionCount > a.executionCount, `execution counts ${a.executionCount}, ${b.executionCount}`)
    assert.equal((await sbx.runCode("'a string'")).text, 'a string')
    assert.equal(b.error, undefined)
  })

  test('print is streamed as it happens (callbacks), stdout and stderr apart', { timeout: TEST_TIMEOUT }, async () => {
    const seen = []
    const t0 = Date.now()
    const ex = await sbx.runCode(
      "import sys, time\nprint('first', flush=True)\ntime.sleep(1.5)\nprint('oops', file=sys.stderr)\nprint('second')",
      {
        onStdout: (m) => seen.push(['out', m.line, Date.now() - t0]),
        onStderr: (m) => seen.push(['err', m.line, Date.now() - t0]),
      },
    )
    const took = Date.now() - t0
    assert.deepEqual(ex.logs.stdout, ['first\n', 'second\n'])
    assert.deepEqual(ex.logs.stderr, ['oops\n'])
    const first = seen.find((s) => s[1] === 'first\n')
    assert.ok(first, `callbacks: ${JSON.stringify(seen)}`)
    assert.ok(took - first[2] >= 1000, `'first' arrived at ${first[2]} ms of ${took} ms: not streamed`)
    assert.ok(seen.some((s) => s[0] === 'err' && s[1] === 'oops\n'), JSON.stringify(seen))
  })

  test('a matplotlib figure comes back as a PNG result', { timeout: TEST_TIMEOUT }, async () => {
    const results = []
    const ex = await sbx.runCode(
      'import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.title("squares")\nplt.show()',
      { onResult: (r) => results.push(r) },
    )
    assert.equal(ex.error, undefined, JSON.stringify(ex.error))
    const png = ex.results.find((r) => r.png)
    assert.ok(png, `results: ${JSON.stringify(ex.results.map((r) => r.formats()))}`)
    const bytes = Buffer.from(png.png, 'base64')
    assert.equal(bytes.subarray(1, 4).toString(), 'PNG')
    assert.ok(bytes.length > 1000, `a PNG of ${bytes.length} bytes`)
    assert.equal(results.length, ex.results.length, 'onResult for every result')
  })

  // E2B's chart extraction: the figure's data next to its PNG (the SDK's Result.chart).
  test('a line chart: title, labels, units, datetime and linear scales, ticks, the lines as points', { timeout: TEST_TIMEOUT }, async () => {
    const ex = await sbx.runCode(`import datetime, matplotlib.pyplot as plt
days = [datetime.datetime(2023, 9, 1) + datetime.timedelta(days=i) for i in range(10)]
plt.figure()
plt.plot(days, [i * i for i in range(10)], label='squares')
plt.plot(days, [2 * i for i in range(10)], label='doubles')
plt.xlabel('Day (d)'); plt.ylabel('Amount (kg)'); plt.title('Growth')
plt.show()`)
    assert.equal(ex.error, undefined, JSON.stringify(ex.error))
    const r = ex.results.find((r) => r.chart)
    assert.ok(r && r.png, `results: ${JSON.stringify(ex.results.map((r) => r.formats()))}`)
    const c = r.chart
    assert.equal(c.type, 'line')
    assert.equal(c.title, 'Growth')
    assert.deepEqual([c.x_label, c.y_label, c.x_unit, c.y_unit], ['Day (d)', 'Amount (kg)', 'd', 'kg'])
    assert.deepEqual([c.x_scale, c.y_scale], ['datetime', 'linear'])
    assert.ok(c.x_ticks.length > 0 && c.x_ticks.every((t) => typeof t === 'string' && !isNaN(new Date(t))), JSON.stringify(c.x_ticks))
    assert.ok(c.y_ticks.every((t) => typeof t === 'number'), JSON.stringify(c.y_ticks))
    assert.equal(c.x_tick_labels.length, c.x_ticks.length)
    assert.deepEqual(c.elements.map((e) => e.label), ['squares', 'doubles'])
    const sq = c.elements[0].points
    assert.equal(sq.length, 10)
    assert.equal(new Date(sq[3][0]).toISOString(), '2023-09-04T00:00:00.000Z')
    assert.equal(sq[3][1], 9)
  })

  test('scatter, bar, pie and box-and-whisker charts, and a superchart of several axes', { timeout: TEST_TIMEOUT }, async () => {
    const chartOf = async (code) => {
      const ex = await sbx.runCode(`import matplotlib.pyplot as plt\n${code}\nplt.show()`)
      assert.equal(ex.error, undefined, JSON.stringify(ex.error))
      const r = ex.results.find((r) => r.chart)
      assert.ok(r && r.png, `results: ${JSON.stringify(ex.results.map((r) => r.formats()))}`)
      return r.chart
    }
    const scatter = await chartOf("plt.figure()\nplt.scatter([1, 2, 3], [4, 5, 6], label='a')\nplt.scatter([1, 2], [7, 8], label='b')\nplt.title('Dots')")
    assert.equal(scatter.type, 'scatter')
    assert.equal(scatter.title, 'Dots')
    assert.deepEqual(scatter.elements, [{ label: 'a', points: [[1, 4], [2, 5], [3, 6]] }, { label: 'b', points: [[1, 7], [2, 8]] }])

    const bar = await chartOf("fig, ax = plt.subplots()\nax.bar(['A', 'B', 'C'], [10, 20.5, 30], label='2024')\nax.set_title('Sales')\nax.set_ylabel('Units')")
    assert.equal(bar.type, 'bar')
    assert.equal(bar.title, 'Sales')
    assert.equal(bar.y_label, 'Units')
    // A bar's value is a string (the SDKs' BarData); an empty axis label is null, as E2B's.
    assert.equal(bar.x_label, null)
    assert.deepEqual(bar.elements, [{ label: 'A', value: '10', group: '2024' }, { label: 'B', value: '20.5', group: '2024' }, { label: 'C', value: '30', group: '2024' }])

    const pie = await chartOf("fig, ax = plt.subplots()\nax.pie([90, 10], labels=['No', 'Yes'], autopct='%1.1f%%', startangle=90)\nplt.title('Early?')")
    assert.equal(pie.type, 'pie')
    assert.equal(pie.title, 'Early?')
    assert.deepEqual(pie.elements, [{ label: 'No', angle: 324, radius: 1 }, { label: 'Yes', angle: 36, radius: 1 }])

    // ax.boxplot: the quartiles, whiskers and outliers of each box (matplotlib's: linear
    // percentiles, whiskers at 1.5 IQR). x_* name the category axis, also of a horizontal one.
    const box = await chartOf("fig, ax = plt.subplots()\nax.boxplot([list(range(1, 10)), list(range(1, 10)) + [40]], labels=['A', 'B'])\nax.set_title('Spread')\nax.set_xlabel('Group')\nax.set_ylabel('Size (cm)')")
    assert.equal(box.type, 'box_and_whisker')
    assert.deepEqual([box.title, box.x_label, box.y_label, box.x_unit, box.y_unit], ['Spread', 'Group', 'Size (cm)', null, 'cm'])
    assert.deepEqual(box.elements, [
      { label: 'A', min: 1, first_quartile: 3, median: 5, third_quartile: 7, max: 9, outliers: [] },
      { label: 'B', min: 1, first_quartile: 3.25, median: 5.5, third_quartile: 7.75, max: 9, outliers: [40] },
    ])
    const hbox = await chartOf("fig, ax = plt.subplots()\nax.boxplot([[1, 2, 3, 4, 5]], labels=['only'], vert=False, patch_artist=True)\nax.set_xlabel('Value')\nax.set_ylabel('Name')")
    assert.equal(hbox.type, 'box_and_whisker')
    assert.deepEqual([hbox.x_label, hbox.y_label], ['Name', 'Value'])
    assert.deepEqual(hbox.elements, [{ label: 'only', min: 1, first_quartile: 2, median: 3, third_quartile: 4, max: 5, outliers: [] }])

    const sup = await chartOf("fig, (a, b) = plt.subplots(1, 2)\na.plot([1, 2], [3, 4], label='l')\nb.bar(['x', 'y'], [1, 2])\nfig.suptitle('Both')")
    assert.equal(sup.type, 'superchart')
    assert.equal(sup.title, 'Both')
    assert.deepEqual(sup.elements.map((e) => e.type), ['line', 'bar'])
  })

  test('a pandas DataFrame comes back as text, HTML and data', { timeout: TEST_TIMEOUT }, async () => {
    const ex = await sbx.runCode("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})")
    const r = ex.results.find((r) => r.isMainResult)
    assert.ok(r, JSON.stringify(ex))
    assert.match(r.text, /a\s+b/)
    assert.match(r.html, /<table/)
    assert.deepEqual(r.data, { a: [1, 2], b: ['x', 'y'] })
    assert.ok(r.formats().includes('html') && r.formats().includes('data'), r.formats().join(','))
  })

  test("an exception is E2B's error object (name, value, traceback) and onError", { timeout: TEST_TIMEOUT }, async () => {
    const errs = []
    const ex = await sbx.runCode('def f():\n    return 1 / 0\nf()', { onError: (e) => errs.push(e) })
    assert.equal(ex.error.name, 'ZeroDivisionError')
    assert.equal(ex.error.value, 'division by zero')
    assert.match(ex.error.traceback, /ZeroDivisionError/)
    assert.equal(errs.length, 1)
    // The context goes on.
    assert.equal((await sbx.runCode('x')).text, '42')
  })

  test('a timeout interrupts the kernel and leaves the context usable', { timeout: TEST_TIMEOUT }, async () => {
    const t0 = Date.now()
    await assert.rejects(sbx.runCode('import time\ntime.sleep(60)\nx = 0', { timeoutMs: 2_000 }), (e) => {
      assert.equal(e.name, 'TimeoutError', `${e.name}: ${e.message}`)
      return true
    })
    // The interrupted cell never reached `x = 0`, and the next run does not wait for the sleep.
    const after = await sbx.runCode('x')
    assert.equal(after.text, '42')
    assert.ok(Date.now() - t0 < 20_000, `the context answered after ${Date.now() - t0} ms`)
  })

  test('env vars: per call, and the sandbox envs given at create', { timeout: TEST_TIMEOUT }, async () => {
    const code = "import os\nos.environ.get('CALL_VAR', 'unset')"
    assert.equal((await sbx.runCode(code, { envs: { CALL_VAR: 'per-call' } })).text, 'per-call')
    assert.equal((await sbx.runCode(code)).text, 'unset')
    assert.equal((await sbx.runCode("import os\nos.environ.get('SUITE_VAR')")).text, 'hello-env')
  })

  test("a call without the sandbox's access token: envd's refused /envs is asked once, not on every call", { timeout: TEST_TIMEOUT }, async () => {
    // The server's own code (its module, loaded in the kernel) with a bash context of its own,
    // against the sandbox's real envd: three calls without a token, /envs counted.
    const ex = await sbx.runCode(`import http.client, importlib.util, json
spec = importlib.util.spec_from_file_location('ember_ci_server', '/opt/ember/code-interpreter/server.py')
srv = importlib.util.module_from_spec(spec)
spec.loader.exec_module(srv)
c = http.client.HTTPConnection('127.0.0.1', 49983)
c.request('GET', '/envs')
refused = c.getresponse().status
c.close()
asked, request = [], http.client.HTTPConnection.request
def counting(self, method, url, *a, **k):
    asked.append(url)
    return request(self, method, url, *a, **k)
http.client.HTTPConnection.request = counting
out = []
try:
    ctx = srv.BashContext('bash', '/tmp')
    for _ in range(3):
        ctx.execute('echo hi', {}, None, out.append, lambda: False)
    ctx.stop()
finally:
    http.client.HTTPConnection.request = request
print(json.dumps({'refused': refused, 'asked': asked.count('/envs'), 'out': [m['text'] for m in out if m['type'] == 'stdout']}))`)
    assert.equal(ex.error, undefined, JSON.stringify(ex.error))
    const r = JSON.parse(ex.logs.stdout.join(''))
    assert.equal(r.refused, 401, 'envd answers /envs without the token')
    assert.deepEqual(r.out, ['hi\n', 'hi\n', 'hi\n'])
    assert.equal(r.asked, 1, `/envs asked ${r.asked} times in 3 calls`)
  })

  test('contexts: create with a cwd, isolated state, list, restart, remove', { timeout: TEST_TIMEOUT }, async () => {
    const ctx = await sbx.createCodeContext({ cwd: '/tmp', language: 'python' })
    assert.ok(ctx.id, JSON.stringify(ctx))
    assert.equal(ctx.cwd, '/tmp')
    assert.equal(ctx.language, 'python')
    assert.equal((await sbx.runCode('import os\nos.getcwd()', { context: ctx })).text, '/tmp')
    const iso = await sbx.runCode('x', { context: ctx })
    assert.equal(iso.error?.name, 'NameError', 'a new context does not see the default one')
    await sbx.runCode('y = 5', { context: ctx })
    assert.equal((await sbx.runCode('y * 2', { context: ctx })).text, '10')
    assert.ok((await sbx.listCodeContexts()).some((c) => c.id === ctx.id))
    await sbx.restartCodeContext(ctx)
    assert.equal((await sbx.runCode('y', { context: ctx })).error?.name, 'NameError', 'restart clears the state')
    await sbx.removeCodeContext(ctx)
    assert.ok(!(await sbx.listCodeContexts()).some((c) => c.id === ctx.id))
    // A short requestTimeoutMs: the SDK leaves its request timer running when a call fails,
    // which keeps this test process alive for that long after the last test.
    await assert.rejects(sbx.runCode('1', { context: ctx, requestTimeoutMs: 5_000 }))
    assert.equal((await sbx.runCode('x')).text, '42', 'the default context is untouched')
  })

  test('bash: state kept between runs, output streamed, exit status as the error, env vars, contexts', { timeout: TEST_TIMEOUT }, async () => {
    const seen = []
    const a = await sbx.runCode('n=41; cd /tmp; echo start; echo warn >&2', { language: 'bash', onStdout: (m) => seen.push(m.line) })
    assert.deepEqual(a.logs.stdout, ['start\n'])
    assert.deepEqual(a.logs.stderr, ['warn\n'])
    assert.deepEqual(seen, ['start\n'])
    assert.equal(a.error, undefined)
    const b = await sbx.runCode('n=$((n+1)); echo "$n $(pwd) $SUITE_VAR $CALL_VAR"', { language: 'bash', envs: { CALL_VAR: 'per-call' } })
    assert.deepEqual(b.logs.stdout, ['42 /tmp hello-env per-call\n'])
    assert.deepEqual((await sbx.runCode('echo "[$CALL_VAR]"', { language: 'bash' })).logs.stdout, ['[]\n'])
    const c = await sbx.runCode('ls /nonexistent', { language: 'bash' })
    assert.equal(c.error?.name, 'Error')
    assert.equal(c.error?.value, '2')
    // A bash context of its own, with its cwd; the Python context is untouched.
    const ctx = await sbx.createCodeContext({ language: 'bash', cwd: '/usr' })
    assert.equal(ctx.language, 'bash')
    assert.deepEqual((await sbx.runCode('pwd; echo "[$n]"', { context: ctx })).logs.stdout, ['/usr\n', '[]\n'])
    await sbx.removeCodeContext(ctx)
    assert.equal((await sbx.runCode('x')).text, '42')
  })

  test('a language without a kernel here is refused', { timeout: TEST_TIMEOUT }, async () => {
    await assert.rejects(sbx.runCode('1', { language: 'r', requestTimeoutMs: 5_000 }), /400/)
  })
})

describe('code interpreter in the loop', { skip: LIFECYCLE_SKIP, timeout: HOOK_TIMEOUT * 4 }, () => {
  test('pause and resume keep the kernel state', { timeout: HOOK_TIMEOUT }, async () => {
    const s = sandboxes.add(await Sandbox.create(CREATE_OPTS))
    await s.runCode('import numpy as np\nz = np.arange(7)')
    assert.equal(await s.pause(), true)
    const again = await Sandbox.connect(s.sandboxId)
    assert.equal((await again.runCode('int(z.sum() * 2)')).text, '42')
  })

  test('a snapshot keeps the kernel state: a sandbox created from it goes on from there', { timeout: HOOK_TIMEOUT }, async () => {
    const s = sandboxes.add(await Sandbox.create(CREATE_OPTS))
    await s.runCode("state = {'step': 1}")
    const snap = await s.createSnapshot()
    try {
      await s.runCode("state['step'] = 2")
      const back = sandboxes.add(await Sandbox.create(snap.snapshotId, { timeoutMs: 120_000 }))
      assert.equal((await back.runCode("state['step']")).text, '1', 'the snapshot is the state at its time')
      assert.equal((await s.runCode("state['step']")).text, '2')
    } finally {
      await Sandbox.deleteSnapshot(snap.snapshotId).catch(() => {})
    }
  })

  test('fork: every child has the variable, and the children diverge', { timeout: HOOK_TIMEOUT }, async () => {
    const parent = sandboxes.add(await Sandbox.create(CREATE_OPTS))
    await parent.runCode('w = 1')
    const kids = await Sandbox.fork(parent.sandboxId, { count: 2 })
    for (const k of kids) {
      assert.ok(k instanceof Sandbox, `fork failed: ${k?.message}`)
      sandboxes.add(k)
      assert.equal((await k.runCode('w')).text, '1', `child ${k.sandboxId}`)
    }
    await kids[0].runCode('w = 100')
    assert.equal((await kids[0].runCode('w')).text, '100')
    assert.equal((await kids[1].runCode('w')).text, '1')
    assert.equal((await parent.runCode('w')).text, '1')
  })
})

describe('CLIs', { timeout: HOOK_TIMEOUT * 2 }, () => {
  const cliEnv = { ...process.env, E2B_ACCESS_TOKEN: '', NO_COLOR: '1', FORCE_COLOR: '0' }
  const e2b = join(SDK_DIR, 'node_modules', '.bin', 'e2b')

  test('e2b template list shows the name, vCPUs, RAM and disk', { timeout: TEST_TIMEOUT }, async () => {
    const { stdout } = await run(e2b, ['template', 'list', '--format', 'json'], { env: cliEnv })
    const list = JSON.parse(stdout.slice(stdout.indexOf('[')))
    const ci = list.find((t) => t.templateID === 'code-interpreter-v1')
    assert.ok(ci, stdout)
    assert.deepEqual(ci.aliases, ['code-interpreter-v1'])
    assert.ok(ci.cpuCount > 0 && ci.memoryMB > 0 && ci.diskSizeMB > 0, JSON.stringify(ci))
    const pretty = (await run(e2b, ['template', 'list'], { env: cliEnv })).stdout
    const row = pretty.split('\n').find((l) => l.includes('code-interpreter-v1'))
    assert.ok(row, pretty)
    assert.match(row, new RegExp(`code-interpreter-v1.*code-interpreter-v1.*\\b${ci.cpuCount}\\b.*\\b${ci.memoryMB}\\b`))
    assert.match(row, new RegExp(`\\b${ci.diskSizeMB}\\b`))
  })

  test('e2b sandbox list shows the sandbox with its vCPUs and RAM', { timeout: TEST_TIMEOUT }, async () => {
    const { stdout } = await run(e2b, ['sandbox', 'list', '--format', 'json'], { env: cliEnv })
    const list = JSON.parse(stdout.slice(stdout.indexOf('[')))
    const mine = list.find((s) => s.sandboxId === sbx.sandboxId)
    assert.ok(mine, stdout)
    assert.equal(mine.templateId, 'code-interpreter-v1')
    assert.ok(mine.cpuCount > 0 && mine.memoryMB > 0, JSON.stringify(mine))
  })

  /**
   * Runs `command` in a tmux session of 100x30 (a real terminal), types into it and reads the
   * screen: a command and its output, the size (stty), a resize of the window, python, and exit.
   * Returns the screen after `exit 7`.
   */
  async function throughTmux(t, name, command) {
    const tmux = await run('tmux', ['-V']).then(() => true, () => false)
    if (!tmux) {
      if (process.env.EMBER_REQUIRE_ALL === '1') assert.fail('tmux is required (scripts/setup.sh installs it)')
      t.skip('tmux is missing')
      return null
    }
    const session = `ember-${name}-${process.pid}`
    const socket = ['-L', session]
    await run('tmux', [...socket, 'new-session', '-d', '-s', session, '-x', '100', '-y', '30',
      `${command}; echo "CLI-EXIT=$?"; sleep 600`], { env: { ...process.env, NO_COLOR: '1' } })
    const pane = async () => (await run('tmux', [...socket, 'capture-pane', '-p', '-t', session])).stdout
    const keys = (...k) => run('tmux', [...socket, 'send-keys', '-t', session, ...k])
    try {
      await waitFor(async () => /\$ *$/m.test(await pane()), { timeoutMs: 30_000, what: 'the prompt' })
      await keys('echo hi-$((6*7))', 'Enter')
      await waitFor(async () => (await pane()).includes('hi-42'), { timeoutMs: 20_000, what: 'the shell to echo' })
      await keys('stty size', 'Enter')
      await waitFor(async () => (await pane()).includes('30 100'), { timeoutMs: 10_000, what: 'the first size' })
      await run('tmux', [...socket, 'resize-window', '-t', session, '-x', '120', '-y', '40'])
      await sleep(500)
      await keys('stty size', 'Enter')
      await waitFor(async () => (await pane()).includes('40 120'), { timeoutMs: 10_000, what: 'the new size' })
      await keys('python3 -c "import numpy; print(numpy.__name__)"', 'Enter')
      await waitFor(async () => /^numpy\s*$/m.test(await pane()), { timeoutMs: 20_000, what: 'python in the shell' })
      await keys('exit 7', 'Enter')
      return await waitFor(async () => { const p = await pane(); return p.includes('CLI-EXIT=') && p }, { timeoutMs: 15_000, what: 'the CLI to exit' })
    } catch (e) {
      console.error(await pane().catch(() => ''))
      throw e
    } finally {
      await run('tmux', [...socket, 'kill-server']).catch(() => {})
    }
  }

  test('ember sandbox shell: a terminal through tmux, with resize and the exit code', { timeout: TEST_TIMEOUT }, async (t) => {
    assert.ok(existsSync(EMBER_BIN), `${EMBER_BIN} is missing (make build)`)
    const screen = await throughTmux(t, 'shell', `${EMBER_BIN} --url ${process.env.E2B_API_URL} sandbox shell ${sbx.sandboxId}`)
    if (screen) assert.match(screen, /CLI-EXIT=7/)
  })

  test('e2b sandbox connect: the same terminal through E2B\'s CLI', { timeout: TEST_TIMEOUT }, async (t) => {
    const screen = await throughTmux(t, 'connect', `${e2b} sandbox connect ${sbx.sandboxId}`)
    if (screen) assert.match(screen, /CLI-EXIT=\d+/)
  })
})
