// Teams (issue 19): two teams through the unmodified SDK. Neither can see, connect to, exec
// in, kill, fork, snapshot or build from the other's sandboxes and snapshots; lists show only
// their own; a quota answers 429 naming it; the admin key (the one run.sh exports, the
// default team's) manages both teams.
import { after, before, describe, test } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox, NotFoundError, RateLimitError, SandboxNotFoundError } from 'e2b'
import { HOOK_TIMEOUT, TEST_TIMEOUT, collectPages } from './helpers.mjs'

const API = process.env.E2B_API_URL
const ADMIN = process.env.E2B_API_KEY

/** A control-plane call with a key, as the CLI makes it. */
async function call(key, method, path, body) {
  const res = await fetch(API + path, {
    method,
    headers: { 'X-API-Key': key, 'Content-Type': 'application/json' },
    body: body === undefined ? undefined : JSON.stringify(body),
  })
  const text = await res.text()
  return { status: res.status, body: text ? JSON.parse(text) : null }
}

describe('two teams', { timeout: HOOK_TIMEOUT * 3 }, () => {
  const teams = [] // {id, key}
  const made = [] // [sandbox, key]
  let a, b // Sandbox objects of team 0 and 1
  let snapA

  before(async () => {
    for (const name of [`t-a-${process.pid}`, `t-b-${process.pid}`]) {
      const r = await call(ADMIN, 'POST', '/ember/teams', { name })
      assert.equal(r.status, 201, JSON.stringify(r.body))
      teams.push({ id: r.body.teamID, key: r.body.apiKey.key })
    }
    a = await Sandbox.create('base', { apiKey: teams[0].key, metadata: { team: 'a' } })
    made.push([a, teams[0].key])
    b = await Sandbox.create('base', { apiKey: teams[1].key, metadata: { team: 'b' } })
    made.push([b, teams[1].key])
  }, { timeout: HOOK_TIMEOUT })

  after(async () => {
    for (const [s, key] of made) await Sandbox.kill(s.sandboxId, { apiKey: key }).catch(() => {})
    if (snapA) await Sandbox.deleteSnapshot(snapA, { apiKey: teams[0].key }).catch(() => {})
    for (const t of teams) await call(ADMIN, 'DELETE', `/ember/teams/${t.id}`)
  }, { timeout: HOOK_TIMEOUT })

  test('lists show only their own', { timeout: TEST_TIMEOUT }, async () => {
    for (const [i, own, other] of [[0, a, b], [1, b, a]]) {
      const ids = (await collectPages(Sandbox.list({ apiKey: teams[i].key }))).flat().map((s) => s.sandboxId)
      assert.ok(ids.includes(own.sandboxId), `team ${i} lists its own`)
      assert.ok(!ids.includes(other.sandboxId), `team ${i} does not list the other's`)
    }
  })

  test('neither sees, connects to, execs in, kills, forks or snapshots the other\'s', { timeout: TEST_TIMEOUT }, async () => {
    for (const [i, other] of [[0, b], [1, a]]) {
      const opts = { apiKey: teams[i].key }
      const id = other.sandboxId
      await assert.rejects(Sandbox.getInfo(id, opts), SandboxNotFoundError)
      await assert.rejects(Sandbox.connect(id, opts), (e) => e instanceof SandboxNotFoundError || e instanceof NotFoundError)
      await assert.rejects(Sandbox.setTimeout(id, 60_000, opts), (e) => e instanceof SandboxNotFoundError || e instanceof NotFoundError)
      await assert.rejects(Sandbox.createSnapshot(id, opts), SandboxNotFoundError)
      assert.equal(await Sandbox.pause(id, opts).catch((e) => e instanceof SandboxNotFoundError ? 'nf' : e), 'nf')
      const forks = await Sandbox.fork(id, { ...opts, count: 1 }).catch((e) => e)
      assert.ok(forks instanceof Error || forks.every((f) => f instanceof Error), `fork of the other's: ${forks}`)
      assert.equal(await Sandbox.kill(id, opts), false)
      // The answer is a missing sandbox's, word for word.
      const got = await call(teams[i].key, 'GET', `/sandboxes/${id}`)
      const missing = await call(teams[i].key, 'GET', '/sandboxes/aaaaaaaaaaaaaaaaaaaa')
      assert.equal(got.status, 404)
      assert.equal(got.body.message.replace(id, 'X'), missing.body.message.replace('aaaaaaaaaaaaaaaaaaaa', 'X'))
    }
    // Both still run, and exec works for their owners.
    for (const [i, own] of [[0, a], [1, b]]) {
      const s = await Sandbox.connect(own.sandboxId, { apiKey: teams[i].key })
      assert.equal((await s.commands.run('echo ok')).stdout.trim(), 'ok')
    }
  })

  test('a snapshot is its team\'s: not listed, created from or built from by the other', { timeout: TEST_TIMEOUT }, async () => {
    const snap = await Sandbox.createSnapshot(a.sandboxId, { apiKey: teams[0].key })
    snapA = snap.snapshotId
    const mine = (await collectPages(Sandbox.listSnapshots({ apiKey: teams[0].key }))).flat().map((s) => s.snapshotId)
    assert.ok(mine.includes(snapA))
    const theirs = (await collectPages(Sandbox.listSnapshots({ apiKey: teams[1].key }))).flat().map((s) => s.snapshotId)
    assert.ok(!theirs.includes(snapA))
    await assert.rejects(Sandbox.create(snapA, { apiKey: teams[1].key }), /not found/i)
    assert.equal(await Sandbox.deleteSnapshot(snapA, { apiKey: teams[1].key }), false)
    const tpls = await call(teams[1].key, 'GET', '/templates')
    assert.ok(!tpls.body.some((t) => t.templateID === snapA), 'not in the other team\'s templates')
    assert.ok(tpls.body.some((t) => t.templateID === 'base'), 'base is public')
    // A build from it, by the other team.
    const req = await call(teams[1].key, 'POST', '/v3/templates', { name: `from-${process.pid}` })
    assert.equal(req.status, 202, JSON.stringify(req.body))
    const start = await call(teams[1].key, 'POST', `/v2/templates/${req.body.templateID}/builds/${req.body.buildID}`, { fromTemplate: snapA, steps: [] })
    assert.equal(start.status, 404, JSON.stringify(start.body))
  })

  test('a quota answers 429 naming it; the other team is not held by it', { timeout: TEST_TIMEOUT }, async () => {
    const q = await call(ADMIN, 'PUT', `/ember/teams/${teams[1].id}/quota`, { sandboxes: 1 })
    assert.equal(q.status, 200, JSON.stringify(q.body))
    await assert.rejects(Sandbox.create('base', { apiKey: teams[1].key }),
      (e) => e instanceof RateLimitError && /concurrent E2B sandboxes \(1\).*quota sandboxes/.test(e.message))
    const more = await Sandbox.create('base', { apiKey: teams[0].key })
    made.push([more, teams[0].key])
    const u = await call(teams[1].key, 'GET', `/ember/teams/${teams[1].id}/usage`)
    assert.equal(u.body.usage.sandboxes, 1)
    assert.equal(u.body.quota.sandboxes, 1)
    await call(ADMIN, 'PUT', `/ember/teams/${teams[1].id}/quota`, {})
  })

  test('the admin key manages both teams; a team key manages none', { timeout: TEST_TIMEOUT }, async () => {
    const ls = await call(ADMIN, 'GET', '/ember/teams')
    for (const t of teams) assert.ok(ls.body.some((x) => x.teamID === t.id))
    const k = await call(ADMIN, 'POST', '/api-keys', { name: 'second', team: teams[1].id })
    assert.equal(k.status, 201)
    assert.equal(k.body.team, teams[1].id)
    const ids = (await collectPages(Sandbox.list({ apiKey: k.body.key }))).flat().map((s) => s.sandboxId)
    assert.ok(ids.includes(b.sandboxId) && !ids.includes(a.sandboxId))
    assert.equal((await call(teams[0].key, 'POST', '/ember/teams', { name: 'x' })).status, 403)
    assert.equal((await call(teams[0].key, 'DELETE', `/api-keys/${k.body.id}`)).status, 404)
    assert.equal((await call(ADMIN, 'DELETE', `/api-keys/${k.body.id}`)).status, 204)
  })
})
