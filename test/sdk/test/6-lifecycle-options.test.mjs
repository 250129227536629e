// Lifecycle options of E2B's SDK (issue 9 item 2): a filesystem-only pause (keepMemory: false)
// keeps files but not processes, on timeout and on an explicit pause; onTimeout 'pause' with
// autoResume false waits for connect; the combinations E2B refuses are refused by the server
// too (400, the SDK's wording), even for a client that does not validate them itself.
import { after, describe, test } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox } from 'e2b'
import { HOOK_TIMEOUT, LIFECYCLE_SKIP, SandboxTracker, TEST_TIMEOUT } from './helpers.mjs'

const sandboxes = new SandboxTracker()
after(() => sandboxes.killAll(), { timeout: HOOK_TIMEOUT })

const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

async function waitForState(id, want, ms = 30_000) {
  const deadline = Date.now() + ms
  let last
  while (Date.now() < deadline) {
    last = (await Sandbox.getInfo(id)).state
    if (last === want) return
    await sleep(250)
  }
  assert.fail(`sandbox ${id} is ${last}, not ${want}, after ${ms} ms`)
}

/** Starts a sleeper and returns its pid. */
async function sleeper(sbx) {
  const h = await sbx.commands.run('sleep 600', { background: true, timeoutMs: 0 })
  const pid = h.pid
  await h.disconnect()
  return pid
}

/** Whether the sleeper still runs: its pid holds `sleep 600` (a new boot reuses low pids). */
async function alive(sbx, pid) {
  const r = await sbx.commands.run(`tr '\\0' ' ' < /proc/${pid}/cmdline 2>/dev/null | grep -q '^sleep 600' && echo alive || echo gone`)
  return r.stdout.trim() === 'alive'
}

describe('lifecycle options', { skip: LIFECYCLE_SKIP, timeout: HOOK_TIMEOUT * 4 }, () => {
  test('pause({keepMemory:false}) keeps files, not processes; connect boots it on its files', { timeout: TEST_TIMEOUT }, async () => {
    const sbx = sandboxes.add(await Sandbox.create('base', { timeoutMs: 300_000 }))
    await sbx.files.write('/home/user/fs-only.txt', 'kept on disk')
    const pid = await sleeper(sbx)
    assert.equal(await sbx.pause({ keepMemory: false }), true)
    assert.equal((await Sandbox.getInfo(sbx.sandboxId)).state, 'paused')
    const back = await Sandbox.connect(sbx.sandboxId)
    assert.equal(await back.files.read('/home/user/fs-only.txt'), 'kept on disk')
    assert.equal(await alive(back, pid), false, 'a process survived a filesystem-only pause')
    // A new boot is a working sandbox: commands, and writes next to the kept files.
    await back.files.write('/home/user/after.txt', 'new')
    assert.equal((await back.commands.run('cat /home/user/fs-only.txt /home/user/after.txt')).stdout, 'kept on disknew')
  })

  test("onTimeout {action:'pause', keepMemory:false}: paused on timeout with its files only", { timeout: TEST_TIMEOUT }, async () => {
    const sbx = sandboxes.add(await Sandbox.create('base', {
      timeoutMs: 3_000,
      lifecycle: { onTimeout: { action: 'pause', keepMemory: false } },
    }))
    await sbx.files.write('/home/user/t.txt', 'timeout-kept')
    const pid = await sleeper(sbx)
    await waitForState(sbx.sandboxId, 'paused')
    const info = await Sandbox.getInfo(sbx.sandboxId)
    assert.equal(info.lifecycle?.onTimeout ?? 'pause', 'pause')
    const back = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 60_000 })
    assert.equal(await back.files.read('/home/user/t.txt'), 'timeout-kept')
    assert.equal(await alive(back, pid), false)
  })

  test("onTimeout 'pause' with autoResume false: memory kept, only connect wakes it", { timeout: TEST_TIMEOUT }, async () => {
    const sbx = sandboxes.add(await Sandbox.create('base', {
      timeoutMs: 3_000,
      lifecycle: { onTimeout: 'pause', autoResume: false },
    }))
    const pid = await sleeper(sbx)
    await waitForState(sbx.sandboxId, 'paused')
    // Traffic does not wake it.
    await assert.rejects(sbx.commands.run('true', { requestTimeoutMs: 10_000 }))
    assert.equal((await Sandbox.getInfo(sbx.sandboxId)).state, 'paused')
    const back = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 60_000 })
    assert.equal(await alive(back, pid), true, 'a memory pause lost a process')
  })

  test('the combinations E2B refuses are refused by the SDK and by the server', { timeout: TEST_TIMEOUT }, async () => {
    await assert.rejects(
      Sandbox.create('base', { lifecycle: { onTimeout: { action: 'kill', keepMemory: false } } }),
      /keepMemory is only allowed when action is 'pause'/)
    await assert.rejects(
      Sandbox.create('base', { lifecycle: { onTimeout: { action: 'pause', keepMemory: false }, autoResume: true } }),
      /filesystem-only snapshot cannot be auto-resumed/)
    // A client that sends them anyway (raw API) gets a 400 with the same wording.
    for (const [body, msg] of [
      [{ templateID: 'base', autoPause: false, autoPauseMemory: false }, /keepMemory is only allowed/],
      [{ templateID: 'base', autoPause: false, autoResume: { enabled: true } }, /autoResume can only be true/],
      [{ templateID: 'base', autoPause: true, autoPauseMemory: false, autoResume: { enabled: true } }, /cannot be auto-resumed/],
    ]) {
      const res = await fetch(`${process.env.E2B_API_URL}/v2/sandboxes`, {
        method: 'POST',
        headers: { 'X-API-Key': process.env.E2B_API_KEY, 'Content-Type': 'application/json' },
        body: JSON.stringify(body),
      })
      const json = await res.json()
      assert.equal(res.status, 400, JSON.stringify(json))
      assert.equal(json.code, 400)
      assert.match(json.message, msg)
    }
  })
})
