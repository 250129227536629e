// Process checks of E2B-PROTOCOL.md §4: 4-13 (run, envs/cwd/user, exit codes, streaming,
// stdin, list, kill, reconnect, timeout, PTY). They share one sandbox created like check 1.
import { after, before, describe, test } from 'node:test'
import assert from 'node:assert/strict'
import { CommandExitError, TimeoutError } from 'e2b'
import {
  COMPAT_CREATE_OPTS,
  HOOK_TIMEOUT,
  SandboxTracker,
  TEST_TIMEOUT,
  enc,
  isError,
  waitFor,
} from './helpers.mjs'

const sandboxes = new SandboxTracker()

describe('commands and pty', { timeout: TEST_TIMEOUT * 12 }, () => {
  /** @type {import('e2b').Sandbox} */
  let sbx
  /** Background `sleep 30` shared by checks 9 and 10. */
  let sleeper

  before(async () => {
    sbx = await sandboxes.create('base', COMPAT_CREATE_OPTS)
  }, { timeout: HOOK_TIMEOUT })
  after(() => sandboxes.killAll(), { timeout: HOOK_TIMEOUT })

  test('04 foreground command: echo hello', { timeout: TEST_TIMEOUT }, async () => {
    const r = await sbx.commands.run('echo hello')
    assert.equal(r.exitCode, 0)
    assert.equal(r.stdout, 'hello\n')
    assert.equal(r.stderr, '')
  })

  test('05 envs, cwd and user; default user and home', { timeout: TEST_TIMEOUT }, async () => {
    const r = await sbx.commands.run('echo "$SUITE_VAR $X"; pwd; whoami', {
      envs: { X: 'y' },
      cwd: '/tmp',
      user: 'root',
    })
    assert.equal(r.exitCode, 0)
    assert.equal(r.stdout, 'hello-env y\n/tmp\nroot\n')

    const d = await sbx.commands.run('whoami; echo $HOME')
    assert.equal(d.exitCode, 0)
    assert.equal(d.stdout, 'user\n/home/user\n')
  })

  test('06 non-zero exit rejects with CommandExitError', { timeout: TEST_TIMEOUT }, async () => {
    await assert.rejects(
      sbx.commands.run('echo err >&2; exit 3'),
      isError(CommandExitError, (err) => {
        assert.equal(err.exitCode, 3)
        assert.equal(err.stderr, 'err\n')
        assert.equal(err.stdout, '')
      }),
    )
  })

  test('07 streaming: output arrives incrementally', { timeout: TEST_TIMEOUT }, async () => {
    const out = []
    const errs = []
    const t0 = Date.now()
    const r = await sbx.commands.run(
      'for i in 1 2 3; do echo $i; echo e$i >&2; sleep 0.3; done',
      {
        onStdout: (d) => out.push({ d, at: Date.now() - t0 }),
        onStderr: (d) => errs.push({ d, at: Date.now() - t0 }),
      },
    )
    const end = Date.now() - t0
    assert.equal(r.exitCode, 0)
    assert.ok(out.length >= 2, `want >= 2 stdout callbacks, got ${out.length}: ${JSON.stringify(out)}`)
    assert.equal(out.map((c) => c.d).join(''), '1\n2\n3\n')
    assert.equal(errs.map((c) => c.d).join(''), 'e1\ne2\ne3\n')
    assert.equal(r.stdout, '1\n2\n3\n')
    assert.equal(r.stderr, 'e1\ne2\ne3\n')
    // A server that buffers until exit delivers every chunk at the end; the first '1' must
    // arrive while the loop still has about 0.9 s of sleeping to do.
    assert.ok(
      end - out[0].at >= 300,
      `first stdout chunk at ${out[0].at} ms, command done at ${end} ms: output was not flushed as produced`,
    )
  })

  test('08 background command with stdin, sendStdin and closeStdin', { timeout: TEST_TIMEOUT }, async () => {
    let got = ''
    const h = await sbx.commands.run('cat', {
      background: true,
      stdin: true,
      onStdout: (d) => {
        got += d
      },
    })
    assert.equal(typeof h.pid, 'number')
    try {
      await sbx.commands.sendStdin(h.pid, 'ping\n')
      await waitFor(() => got === 'ping\n', { timeoutMs: 5_000, what: `'ping\\n' on stdout (got ${JSON.stringify(got)})` })
      await h.closeStdin()
      const r = await h.wait()
      assert.equal(r.exitCode, 0)
      assert.equal(r.stdout, 'ping\n')
    } finally {
      if (h.exitCode === undefined) await sbx.commands.kill(h.pid).catch(() => {})
    }
  })

  test('09 list processes shows a background command', { timeout: TEST_TIMEOUT }, async () => {
    sleeper = await sbx.commands.run('sleep 30', { background: true })
    const procs = await sbx.commands.list()
    const p = procs.find((x) => x.pid === sleeper.pid)
    assert.ok(p, `pid ${sleeper.pid} not in ${JSON.stringify(procs)}`)
    assert.equal(p.cmd, '/bin/bash')
    assert.deepEqual(p.args, ['-l', '-c', 'sleep 30'])
  })

  test('10 kill a command; a second kill returns false', { timeout: TEST_TIMEOUT }, async () => {
    assert.ok(sleeper, 'check 9 did not start the background command')
    assert.equal(await sbx.commands.kill(sleeper.pid), true)
    await assert.rejects(
      sleeper.wait(),
      isError(CommandExitError, (err) => {
        assert.notEqual(err.exitCode, 0, `killed command exit code ${err.exitCode}`)
      }),
    )
    assert.equal(await sbx.commands.kill(sleeper.pid), false)
  })

  test('11 disconnect does not kill; connect by pid gets the result', { timeout: TEST_TIMEOUT }, async () => {
    const h = await sbx.commands.run('sleep 1; echo done', { background: true })
    await h.disconnect()
    const c = await sbx.commands.connect(h.pid)
    const r = await c.wait()
    assert.equal(r.exitCode, 0)
    assert.ok(r.stdout.includes('done'), `stdout ${JSON.stringify(r.stdout)}`)
  })

  test('12 command timeout rejects with TimeoutError', { timeout: TEST_TIMEOUT }, async () => {
    const t0 = Date.now()
    await assert.rejects(sbx.commands.run('sleep 5', { timeoutMs: 1_000 }), isError(TimeoutError))
    const took = Date.now() - t0
    assert.ok(took < 4_500, `timeout fired after ${took} ms, want about 1 s`)
  })

  test('13 pty: input, resize and kill', { timeout: TEST_TIMEOUT }, async () => {
    const dec = new TextDecoder()
    let out = ''
    const p = await sbx.pty.create({
      cols: 80,
      rows: 24,
      onData: (d) => {
        out += dec.decode(d, { stream: true })
      },
    })
    assert.equal(typeof p.pid, 'number')
    let killed = false
    try {
      await sbx.pty.sendInput(p.pid, enc('echo pty-$((40+2))\n'))
      await waitFor(() => out.includes('pty-42'), { timeoutMs: 10_000, what: `pty-42 in pty output ${JSON.stringify(out)}` })

      await sbx.pty.resize(p.pid, { cols: 120, rows: 40 })
      await sbx.pty.sendInput(p.pid, enc('stty size\n'))
      await waitFor(() => out.includes('40 120'), { timeoutMs: 10_000, what: `'40 120' in pty output ${JSON.stringify(out)}` })

      assert.equal(await sbx.pty.kill(p.pid), true)
      killed = true
    } finally {
      if (!killed) await sbx.pty.kill(p.pid).catch(() => {})
    }
  })
})
