// Control-plane checks of E2B-PROTOCOL.md §4: 1-3 (create, health, info), 26-28 (timeout,
// metrics, list), 31 (kill) and 32 (auth). The tests share one sandbox and run in order.
import { after, describe, test } from 'node:test'
import assert from 'node:assert/strict'
import { AuthenticationError, Sandbox, SandboxNotFoundError } from 'e2b'
import {
  COMPAT_CREATE_OPTS,
  HOOK_TIMEOUT,
  SandboxTracker,
  TEST_TIMEOUT,
  collectPages,
  isError,
} from './helpers.mjs'

const sandboxes = new SandboxTracker()

describe('sandbox control plane', { timeout: TEST_TIMEOUT * 10 }, () => {
  /** @type {Sandbox} */
  let sbx

  after(() => sandboxes.killAll(), { timeout: HOOK_TIMEOUT })

  function shared() {
    assert.ok(sbx, 'the shared sandbox was not created (check 1 failed)')
    return sbx
  }

  test('01 create: Sandbox.create returns a sandbox with an id', { timeout: HOOK_TIMEOUT }, async () => {
    sbx = await sandboxes.create('base', COMPAT_CREATE_OPTS)
    assert.equal(typeof sbx.sandboxId, 'string')
    assert.notEqual(sbx.sandboxId, '')
  })

  test('02 health: isRunning is true', { timeout: TEST_TIMEOUT }, async () => {
    assert.equal(await shared().isRunning(), true)
  })

  test('03 info: getInfo reports id, state, metadata, template and times', { timeout: TEST_TIMEOUT }, async () => {
    const info = await shared().getInfo()
    assert.equal(info.sandboxId, sbx.sandboxId)
    assert.equal(info.state, 'running')
    assert.equal(info.metadata?.suite, 'compat')
    assert.equal(typeof info.templateId, 'string')
    assert.notEqual(info.templateId, '')
    assert.ok(info.startedAt instanceof Date && !isNaN(info.startedAt), `startedAt: ${info.startedAt}`)
    assert.ok(info.endAt instanceof Date && !isNaN(info.endAt), `endAt: ${info.endAt}`)
    assert.ok(info.endAt > info.startedAt, `endAt ${info.endAt.toISOString()} <= startedAt ${info.startedAt.toISOString()}`)

    // The static form goes through the same endpoint.
    const same = await Sandbox.getInfo(sbx.sandboxId)
    assert.equal(same.sandboxId, sbx.sandboxId)
  })

  test('26 setTimeout: endAt moves to about now + 60 s', { timeout: TEST_TIMEOUT }, async () => {
    const s = shared()
    try {
      await s.setTimeout(60_000)
      const info = await s.getInfo()
      const left = info.endAt.getTime() - Date.now()
      assert.ok(left >= 45_000 && left <= 75_000, `endAt - now = ${left} ms, want 45-75 s`)
    } finally {
      // Give the later checks room again (this also exercises extending).
      await s.setTimeout(300_000)
    }
    const info = await s.getInfo()
    const left = info.endAt.getTime() - Date.now()
    assert.ok(left >= 280_000 && left <= 320_000, `after re-extending: endAt - now = ${left} ms, want about 300 s`)
  })

  test('27 metrics: getMetrics returns an array of well-formed entries', { timeout: TEST_TIMEOUT }, async () => {
    const metrics = await shared().getMetrics()
    assert.ok(Array.isArray(metrics), `getMetrics returned ${typeof metrics}`)
    for (const m of metrics) {
      assert.equal(typeof m.cpuCount, 'number', `cpuCount in ${JSON.stringify(m)}`)
      assert.ok(!Number.isNaN(m.cpuCount))
      assert.ok(m.timestamp instanceof Date && !isNaN(m.timestamp), `timestamp in ${JSON.stringify(m)}`)
    }
  })

  test('28 list: paginated Sandbox.list filtered by metadata and state', { timeout: HOOK_TIMEOUT }, async () => {
    const s = shared()
    // A second matching sandbox, so that limit:1 needs at least two pages (X-Next-Token).
    const other = await sandboxes.create('base', {
      metadata: { suite: 'compat', role: 'list-second' },
      timeoutMs: 120_000,
    })

    const pages = await collectPages(
      Sandbox.list({ query: { metadata: { suite: 'compat' }, state: ['running'] }, limit: 1 }),
    )
    const items = pages.flat()
    for (const [i, page] of pages.entries()) {
      assert.ok(page.length <= 1, `page ${i} has ${page.length} items with limit 1`)
    }
    for (const item of items) {
      assert.equal(item.metadata?.suite, 'compat', `listed ${item.sandboxId} with metadata ${JSON.stringify(item.metadata)}`)
      assert.equal(item.state, 'running', `listed ${item.sandboxId} in state ${item.state}`)
    }
    const ids = items.map((i) => i.sandboxId)
    assert.ok(ids.includes(s.sandboxId), `list ${JSON.stringify(ids)} lacks ${s.sandboxId}`)
    assert.ok(ids.includes(other.sandboxId), `list ${JSON.stringify(ids)} lacks ${other.sandboxId}`)
    assert.ok(pages.filter((p) => p.length > 0).length >= 2, `expected at least 2 non-empty pages, got ${pages.length}`)
    assert.equal(new Set(ids).size, ids.length, `a sandbox appeared on two pages: ${JSON.stringify(ids)}`)

    // A metadata filter that matches nothing returns nothing.
    const none = (await collectPages(Sandbox.list({ query: { metadata: { suite: 'no-such-suite-x9' } } }))).flat()
    assert.deepEqual(none.map((i) => i.sandboxId), [])

    assert.equal(await other.kill(), true)
  })

  test('31 kill: kill, second kill, getInfo and isRunning after kill', { timeout: TEST_TIMEOUT }, async () => {
    const s = shared()
    const id = s.sandboxId
    assert.equal(await s.kill(), true)
    assert.equal(await Sandbox.kill(id), false)
    await assert.rejects(Sandbox.getInfo(id), isError(SandboxNotFoundError))
    assert.equal(await s.isRunning(), false)
  })

  test('32 auth: an unknown API key is rejected with AuthenticationError', { timeout: TEST_TIMEOUT }, async () => {
    const badKey = 'e2b_00000000000000000000000000000000deadbeef'
    assert.notEqual(badKey, process.env.E2B_API_KEY)
    await assert.rejects(
      Sandbox.create('base', { apiKey: badKey, timeoutMs: 60_000 }).then((leaked) => {
        sandboxes.add(leaked) // the server accepted the key: clean up, then fail
        return leaked
      }),
      isError(AuthenticationError),
    )
  })
})
