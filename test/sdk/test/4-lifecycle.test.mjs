// Lifecycle checks of E2B-PROTOCOL.md §4 and §2.2: 29 (pause), 30 (resume via connect),
// snapshots (createSnapshot, listSnapshots, create from a snapshot, deleteSnapshot) and fork.
// They run only with EMBER_SDK_LIFECYCLE=1; otherwise they are reported as skipped.
import { after, before, describe, test } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox } from 'e2b'
import {
  COMPAT_CREATE_OPTS,
  HOOK_TIMEOUT,
  LIFECYCLE_SKIP,
  SandboxTracker,
  TEST_TIMEOUT,
  collectPages,
} from './helpers.mjs'

const sandboxes = new SandboxTracker()
after(() => sandboxes.killAll(), { timeout: HOOK_TIMEOUT })

describe('pause and resume', { skip: LIFECYCLE_SKIP, timeout: HOOK_TIMEOUT * 4 }, () => {
  /** @type {Sandbox} */
  let sbx
  let sleepPid
  let paused = false

  before(async () => {
    sbx = await sandboxes.create('base', COMPAT_CREATE_OPTS)
  }, { timeout: HOOK_TIMEOUT })

  test('29 pause: state paused, second pause false, envd unreachable, listed as paused', { timeout: HOOK_TIMEOUT }, async () => {
    const id = sbx.sandboxId
    await sbx.files.write('/tmp/compat/persist.txt', 'survives')
    const sleeper = await sbx.commands.run('sleep 600', { background: true, timeoutMs: 0 })
    sleepPid = sleeper.pid
    await sleeper.disconnect()

    assert.equal(await sbx.pause(), true)
    paused = true
    assert.equal(await Sandbox.pause(id), false)
    assert.equal((await Sandbox.getInfo(id)).state, 'paused')
    assert.equal(await sbx.isRunning(), false)

    const listed = (await collectPages(Sandbox.list({ query: { state: ['paused'] } }))).flat()
    const me = listed.find((s) => s.sandboxId === id)
    assert.ok(me, `paused list ${JSON.stringify(listed.map((s) => s.sandboxId))} lacks ${id}`)
    assert.equal(me.state, 'paused')
    for (const s of listed) assert.equal(s.state, 'paused', `state filter leaked ${s.sandboxId} (${s.state})`)
  })

  test('30 resume: connect resumes with files intact; connect on a running sandbox resolves', { timeout: HOOK_TIMEOUT }, async (t) => {
    assert.ok(paused, 'check 29 did not pause the sandbox')
    const id = sbx.sandboxId
    const again = await Sandbox.connect(id, { timeoutMs: 300_000 })
    assert.equal(again.sandboxId, id)
    assert.equal((await again.getInfo()).state, 'running')
    assert.equal(await again.isRunning(), true)
    assert.equal(await again.files.read('/tmp/compat/persist.txt'), 'survives')
    const r = await again.commands.run('cat /tmp/compat/persist.txt')
    assert.equal(r.stdout, 'survives')

    // Optional in the reference (memory snapshots): the background process survived.
    const procs = await again.commands.list()
    t.diagnostic(`sleep pid ${sleepPid} ${procs.some((p) => p.pid === sleepPid) ? 'survived' : 'did not survive'} pause/resume`)

    const twice = await Sandbox.connect(id)
    assert.equal(twice.sandboxId, id)
    assert.equal(await twice.isRunning(), true)
    // The original handle keeps working after resume (same id and access token).
    assert.equal(await sbx.files.read('/tmp/compat/persist.txt'), 'survives')
  })
})

describe('snapshots', { skip: LIFECYCLE_SKIP, timeout: HOOK_TIMEOUT * 4 }, () => {
  test('snapshot: create, list, start a sandbox from it, delete', { timeout: HOOK_TIMEOUT * 2 }, async () => {
    const src = await sandboxes.create('base', COMPAT_CREATE_OPTS)
    await src.files.write('/tmp/snap/s.txt', 'from-snapshot')

    const snap = await src.createSnapshot()
    assert.equal(typeof snap.snapshotId, 'string')
    assert.notEqual(snap.snapshotId, '')
    assert.ok(Array.isArray(snap.names), `names: ${JSON.stringify(snap.names)}`)

    let deleted = false
    try {
      const all = (await collectPages(Sandbox.listSnapshots())).flat()
      assert.ok(
        all.some((s) => s.snapshotId === snap.snapshotId),
        `listSnapshots ${JSON.stringify(all.map((s) => s.snapshotId))} lacks ${snap.snapshotId}`,
      )
      const bySource = (await collectPages(Sandbox.listSnapshots({ sandboxId: src.sandboxId }))).flat()
      assert.ok(
        bySource.some((s) => s.snapshotId === snap.snapshotId),
        `listSnapshots({sandboxId}) ${JSON.stringify(bySource.map((s) => s.snapshotId))} lacks ${snap.snapshotId}`,
      )
      const own = (await collectPages(src.listSnapshots())).flat()
      assert.ok(own.some((s) => s.snapshotId === snap.snapshotId), 'sbx.listSnapshots() lacks the snapshot')

      const child = await sandboxes.create(snap.snapshotId, { timeoutMs: 120_000 })
      assert.notEqual(child.sandboxId, src.sandboxId)
      assert.equal(await child.files.read('/tmp/snap/s.txt'), 'from-snapshot')
      assert.equal(await child.kill(), true)

      assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), true)
      deleted = true
      assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), false)
      const left = (await collectPages(Sandbox.listSnapshots())).flat()
      assert.ok(!left.some((s) => s.snapshotId === snap.snapshotId), 'deleted snapshot is still listed')
    } finally {
      if (!deleted) await Sandbox.deleteSnapshot(snap.snapshotId).catch(() => {})
    }
  })
})

describe('fork', { skip: LIFECYCLE_SKIP, timeout: HOOK_TIMEOUT * 4 }, () => {
  test('fork: three children see the parent file, writes stay private', { timeout: HOOK_TIMEOUT * 2 }, async () => {
    const parent = await sandboxes.create('base', COMPAT_CREATE_OPTS)
    await parent.files.write('/tmp/fork/p.txt', 'parent')

    const kids = await Sandbox.fork(parent.sandboxId, { count: 3 })
    for (const k of kids) if (k instanceof Sandbox) sandboxes.add(k)
    assert.equal(kids.length, 3)
    for (const [i, k] of kids.entries()) {
      assert.ok(k instanceof Sandbox, `fork ${i} failed: ${k?.constructor?.name}: ${k?.message}`)
    }
    const ids = kids.map((k) => k.sandboxId)
    assert.equal(new Set([...ids, parent.sandboxId]).size, 4, `ids not distinct: ${parent.sandboxId} -> ${ids}`)

    for (const k of kids) {
      assert.equal(await k.files.read('/tmp/fork/p.txt'), 'parent', `child ${k.sandboxId}`)
    }
    await kids[0].files.write('/tmp/fork/c.txt', 'child0')
    assert.equal(await kids[0].files.read('/tmp/fork/c.txt'), 'child0')
    for (const other of [kids[1], kids[2], parent]) {
      assert.equal(await other.files.exists('/tmp/fork/c.txt'), false, `${other.sandboxId} sees child 0's write`)
    }

    // Forking leaves the parent running under the same id.
    assert.equal(await parent.isRunning(), true)
    assert.equal((await parent.getInfo()).state, 'running')
  })
})
