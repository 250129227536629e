// Secrets through the JS SDK (E2B's Secret API, issue 22 item 2): Secret.create/getInfo/list/
// exists/update/destroy and Secret.fill. Values are write-only: no answer carries one. (Their use
// at egress, a rule's header resolved by the node's egress proxy, is test/e2e's
// TestEgressProxy: it needs an upstream the test owns.)
import { after, describe, test } from 'node:test'
import assert from 'node:assert/strict'
import { Secret, SecretError, SecretNotFoundError } from 'e2b'
import { HOOK_TIMEOUT, TEST_TIMEOUT } from './helpers.mjs'

const name = `sdk-secret-${Date.now().toString(36)}`
const value = `sk-sdk-${Math.random().toString(36).slice(2)}`

describe('secrets', { timeout: TEST_TIMEOUT * 3 }, () => {
  after(async () => {
    await Secret.destroy(name).catch(() => {})
  }, { timeout: HOOK_TIMEOUT })

  test('create, getInfo, list, exists; values never come back', { timeout: TEST_TIMEOUT }, async () => {
    const s = await Secret.create(name, value, { metadata: { env: 'test' } })
    assert.equal(s.name, name)
    assert.equal(s.version, 1)
    assert.deepEqual(s.metadata, { env: 'test' })
    assert.ok(s.secretId)
    assert.ok(s.createdAt instanceof Date && !Number.isNaN(s.createdAt.getTime()))
    assert.ok(!JSON.stringify(s).includes(value))
    const byId = await Secret.getInfo(s.secretId)
    assert.equal(byId.name, name)
    const byName = await Secret.getInfo(name)
    assert.equal(byName.secretId, s.secretId)
    const p = Secret.list({ limit: 100 })
    const all = []
    while (p.hasNext) all.push(...await p.nextItems())
    const mine = all.find((x) => x.secretId === s.secretId)
    assert.ok(mine)
    assert.ok(!JSON.stringify(all).includes(value))
    assert.equal(await Secret.exists(name), true)
    assert.equal(await Secret.exists('no-such-secret'), false)
    await assert.rejects(Secret.create(name, 'again'), SecretError)
    await assert.rejects(Secret.getInfo('no-such-secret'), SecretNotFoundError)
  })

  test('update makes a new version; destroy; fill formats the placeholder', { timeout: TEST_TIMEOUT }, async () => {
    const u = await Secret.update(name, `${value}-2`, { metadata: { env: 'prod' } })
    assert.equal(u.version, 2)
    assert.deepEqual(u.metadata, { env: 'prod' })
    await assert.rejects(Secret.update('no-such-secret', 'x'), SecretNotFoundError)
    // A value that would inject a header when used in a rule is refused.
    await assert.rejects(Secret.update(name, 'a\r\nX-Evil: 1'), SecretError)
    assert.equal(Secret.fill(name), `\${e2b.secrets.${name}}`)
    assert.equal(await Secret.destroy(name), true)
    assert.equal(await Secret.destroy(name), false)
    assert.equal(await Secret.exists(name), false)
  })
})
