// Volumes through the JS SDK (E2B's Volume API, issue 22 item 1): Volume.create/connect/list/
// destroy, the content API with the volume's token, and volumeMounts at create. The content
// API is on the control plane's address (E2B_VOLUME_API_URL; run.sh sets only E2B_API_URL).
import { after, describe, test } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox, Volume, VolumeError, VolumeNotFoundError, VolumePathNotFoundError } from 'e2b'
import { HOOK_TIMEOUT, SandboxTracker, TEST_TIMEOUT } from './helpers.mjs'

process.env.E2B_VOLUME_API_URL ??= process.env.E2B_API_URL

const sandboxes = new SandboxTracker()
const name = `sdk-vol-${Date.now().toString(36)}`

describe('volumes', { timeout: TEST_TIMEOUT * 10 }, () => {
  /** @type {Volume} */
  let vol

  after(async () => {
    await sandboxes.killAll()
    if (vol) await Volume.destroy(vol.volumeId).catch(() => {})
  }, { timeout: HOOK_TIMEOUT })

  test('create, connect, list; a duplicate name is refused', { timeout: TEST_TIMEOUT }, async () => {
    vol = await Volume.create(name)
    assert.equal(vol.name, name)
    assert.ok(vol.volumeId)
    assert.ok(vol.token)
    const again = await Volume.connect(vol.volumeId)
    assert.equal(again.name, name)
    assert.equal(again.token, vol.token)
    const info = await Volume.getInfo(vol.volumeId)
    assert.equal(info.volumeId, vol.volumeId)
    const list = await Volume.list()
    assert.ok(list.some((v) => v.volumeId === vol.volumeId && v.name === name))
    await assert.rejects(Volume.create(name), (e) => e instanceof VolumeError && /already exists/.test(e.message))
    await assert.rejects(Volume.getInfo('no-such-volume'), VolumeNotFoundError)
  })

  test('content API: write, read, stat, list, make dir, metadata, remove', { timeout: TEST_TIMEOUT }, async () => {
    const w = await vol.writeFile('/hello.txt', 'hello from the sdk', { mode: 0o640, uid: 1000, gid: 1000 })
    assert.equal(w.path, '/hello.txt')
    assert.equal(w.mode, 0o640)
    assert.equal(await vol.readFile('/hello.txt'), 'hello from the sdk')
    await assert.rejects(vol.writeFile('/hello.txt', 'x', { force: false }), VolumeError)
    await vol.makeDir('/a/b', { force: true })
    const d = await vol.getInfo('/a/b')
    assert.equal(d.type, 'directory')
    const names = (await vol.list('/')).map((e) => e.name).sort()
    assert.deepEqual(names, ['a', 'hello.txt'])
    const m = await vol.updateMetadata('/hello.txt', { mode: 0o600 })
    assert.equal(m.mode, 0o600)
    assert.equal(await vol.exists('/nope'), false)
    await assert.rejects(vol.readFile('/nope'), VolumePathNotFoundError)
    await assert.rejects(vol.getInfo('/../etc/passwd'), VolumeError)
    await vol.remove('/a')
    assert.equal(await vol.exists('/a'), false)
  })

  test('volumeMounts: two sandboxes share the volume, destroy refused while mounted', { timeout: HOOK_TIMEOUT }, async () => {
    const a = sandboxes.add(await Sandbox.create('base', { volumeMounts: { '/mnt/vol': vol }, timeoutMs: 300_000 }))
    const b = sandboxes.add(await Sandbox.create('base', { volumeMounts: { '/data': name }, timeoutMs: 300_000 }))
    const info = await a.getInfo()
    assert.deepEqual(info.volumeMounts, [{ name, path: '/mnt/vol' }])
    assert.equal((await a.commands.run('cat /mnt/vol/hello.txt', { user: 'root' })).stdout, 'hello from the sdk')
    await b.commands.run('echo from-b > /data/b.txt')
    assert.equal((await a.commands.run('cat /mnt/vol/b.txt')).stdout, 'from-b\n')
    assert.equal(await vol.readFile('/b.txt'), 'from-b\n')
    await assert.rejects(Volume.destroy(vol.volumeId), (e) => e instanceof VolumeError && /in use/.test(e.message))
    await sandboxes.killAll()
    assert.equal(await Volume.destroy(vol.volumeId), true)
    assert.equal(await Volume.destroy(vol.volumeId), false)
    vol = undefined
  })
})
