// Filesystem checks of E2B-PROTOCOL.md §4: 14-25 (write, read, binary/empty, multi-file write,
// relative paths and owners, list, exists/getInfo, makeDir, rename, remove, watch, signed
// URLs). They share one sandbox and build on each other's files under /tmp/compat.
import { after, before, describe, test } from 'node:test'
import assert from 'node:assert/strict'
import { FileNotFoundError, FilesystemEventType } from 'e2b'
import {
  COMPAT_CREATE_OPTS,
  HOOK_TIMEOUT,
  SandboxTracker,
  TEST_TIMEOUT,
  isError,
  waitFor,
} from './helpers.mjs'

const sandboxes = new SandboxTracker()

describe('filesystem', { timeout: TEST_TIMEOUT * 14 }, () => {
  /** @type {import('e2b').Sandbox} */
  let sbx

  before(async () => {
    sbx = await sandboxes.create('base', COMPAT_CREATE_OPTS)
  }, { timeout: HOOK_TIMEOUT })
  after(() => sandboxes.killAll(), { timeout: HOOK_TIMEOUT })

  test('14 write creates parent dirs and returns WriteInfo', { timeout: TEST_TIMEOUT }, async () => {
    const info = await sbx.files.write('/tmp/compat/a.txt', 'hello file')
    assert.equal(info.name, 'a.txt')
    assert.equal(info.path, '/tmp/compat/a.txt')
    assert.equal(info.type, 'file')
  })

  test('15 read as text and bytes; a command sees the same content', { timeout: TEST_TIMEOUT }, async () => {
    assert.equal(await sbx.files.read('/tmp/compat/a.txt'), 'hello file')

    const bytes = await sbx.files.read('/tmp/compat/a.txt', { format: 'bytes' })
    assert.ok(bytes instanceof Uint8Array, `got ${bytes?.constructor?.name}`)
    assert.equal(bytes.length, 10)
    assert.equal(new TextDecoder().decode(bytes), 'hello file')

    const r = await sbx.commands.run('cat /tmp/compat/a.txt')
    assert.equal(r.stdout, 'hello file')
  })

  test('16 binary and empty files round-trip', { timeout: TEST_TIMEOUT }, async () => {
    const all = new Uint8Array(256).map((_, i) => i)
    await sbx.files.write('/tmp/compat/bin.dat', all.buffer)
    const back = await sbx.files.read('/tmp/compat/bin.dat', { format: 'bytes' })
    assert.equal(back.length, 256)
    assert.deepEqual([...back], [...all])

    await sbx.files.write('/tmp/compat/empty.txt', '')
    assert.equal(await sbx.files.read('/tmp/compat/empty.txt'), '')
    const emptyBytes = await sbx.files.read('/tmp/compat/empty.txt', { format: 'bytes' })
    assert.equal(emptyBytes.length, 0)
  })

  test('17 multi-file write', { timeout: TEST_TIMEOUT }, async () => {
    const infos = await sbx.files.write([
      { path: '/tmp/compat/m1.txt', data: '1' },
      { path: '/tmp/compat/m2.txt', data: '2' },
    ])
    assert.ok(Array.isArray(infos), `got ${JSON.stringify(infos)}`)
    assert.equal(infos.length, 2)
    assert.deepEqual(infos.map((i) => i.path).sort(), ['/tmp/compat/m1.txt', '/tmp/compat/m2.txt'])
    assert.equal(await sbx.files.read('/tmp/compat/m1.txt'), '1')
    assert.equal(await sbx.files.read('/tmp/compat/m2.txt'), '2')
  })

  test('18 relative paths resolve to the home dir; owners follow the user', { timeout: TEST_TIMEOUT }, async () => {
    const rel = await sbx.files.write('rel.txt', 'r')
    assert.equal(rel.path, '/home/user/rel.txt')
    assert.equal((await sbx.files.getInfo('/home/user/rel.txt')).owner, 'user')
    assert.equal(await sbx.files.read('/home/user/rel.txt'), 'r')

    await sbx.files.write('/tmp/compat/root.txt', 'x', { user: 'root' })
    assert.equal((await sbx.files.getInfo('/tmp/compat/root.txt')).owner, 'root')
  })

  test('19 list a directory, and with depth 2', { timeout: TEST_TIMEOUT }, async () => {
    const entries = await sbx.files.list('/tmp/compat')
    const a = entries.find((e) => e.name === 'a.txt')
    assert.ok(a, `a.txt not in ${JSON.stringify(entries.map((e) => e.path))}`)
    assert.equal(a.type, 'file')
    assert.equal(a.size, 10)
    assert.equal(a.path, '/tmp/compat/a.txt')

    const deep = await sbx.files.list('/tmp', { depth: 2 })
    const paths = deep.map((e) => e.path)
    assert.ok(paths.includes('/tmp/compat/a.txt'), `/tmp/compat/a.txt not in ${JSON.stringify(paths)}`)
    const dir = deep.find((e) => e.path === '/tmp/compat')
    assert.ok(dir, `/tmp/compat not in ${JSON.stringify(paths)}`)
    assert.equal(dir.type, 'dir')
  })

  test('20 exists and getInfo', { timeout: TEST_TIMEOUT }, async () => {
    assert.equal(await sbx.files.exists('/tmp/compat/a.txt'), true)
    assert.equal(await sbx.files.exists('/tmp/compat/nope'), false)

    const info = await sbx.files.getInfo('/tmp/compat/a.txt')
    assert.equal(info.type, 'file')
    assert.equal(info.size, 10)
    assert.ok(info.modifiedTime instanceof Date && !isNaN(info.modifiedTime), `modifiedTime ${info.modifiedTime}`)
    assert.match(info.permissions, /^-[r-][w-][xsS-][r-][w-][xsS-][r-][w-][xtT-]$/)
    assert.equal(info.permissions, '-rw-r--r--')
  })

  test('21 makeDir creates nested dirs, then reports it exists', { timeout: TEST_TIMEOUT }, async () => {
    assert.equal(await sbx.files.makeDir('/tmp/compat/d1/d2'), true)
    assert.equal(await sbx.files.makeDir('/tmp/compat/d1/d2'), false)
    assert.equal((await sbx.files.getInfo('/tmp/compat/d1/d2')).type, 'dir')
  })

  test('22 rename moves a file', { timeout: TEST_TIMEOUT }, async () => {
    const e = await sbx.files.rename('/tmp/compat/a.txt', '/tmp/compat/b.txt')
    assert.equal(e.path, '/tmp/compat/b.txt')
    assert.equal(e.name, 'b.txt')
    assert.equal(await sbx.files.exists('/tmp/compat/a.txt'), false)
    assert.equal(await sbx.files.read('/tmp/compat/b.txt'), 'hello file')
  })

  test('23 remove; reading a removed file is FileNotFoundError', { timeout: TEST_TIMEOUT }, async () => {
    await sbx.files.remove('/tmp/compat/b.txt')
    await assert.rejects(sbx.files.read('/tmp/compat/b.txt'), isError(FileNotFoundError))
    assert.equal(await sbx.files.exists('/tmp/compat/b.txt'), false)
  })

  test('24 watchDir reports writes, recursively with relative names', { timeout: TEST_TIMEOUT }, async () => {
    const wanted = new Set([FilesystemEventType.CREATE, FilesystemEventType.WRITE])

    const events = []
    const w = await sbx.files.watchDir('/tmp/compat', (e) => {
      events.push(e)
    })
    try {
      await sbx.files.write('/tmp/compat/w.txt', 'watched')
      await waitFor(() => events.some((e) => e.name === 'w.txt' && wanted.has(e.type)), {
        timeoutMs: 5_000,
        what: `a create/write event for w.txt (got ${JSON.stringify(events)})`,
      })
    } finally {
      await w.stop()
    }

    await sbx.files.makeDir('/tmp/compat/d1') // normally made by check 21 already
    const rev = []
    const rw = await sbx.files.watchDir('/tmp/compat', (e) => {
      rev.push(e)
    }, { recursive: true })
    try {
      await sbx.files.write('/tmp/compat/d1/x.txt', 'deep')
      await waitFor(() => rev.some((e) => e.name === 'd1/x.txt' && wanted.has(e.type)), {
        timeoutMs: 5_000,
        what: `a create/write event named d1/x.txt (got ${JSON.stringify(rev)})`,
      })
    } finally {
      await rw.stop()
    }
  })

  test('25 signed uploadUrl and downloadUrl work without SDK headers', { timeout: TEST_TIMEOUT }, async () => {
    const up = await sbx.uploadUrl('/tmp/compat/up.txt')
    assert.match(up, /[?&]signature=v1_/, `uploadUrl ${up} carries no signature (no envdAccessToken?)`)
    const form = new FormData()
    form.append('file', new Blob(['via-url']), 'up.txt')
    const res = await fetch(up, { method: 'POST', body: form })
    const body = await res.text()
    assert.ok(res.ok, `POST ${up} -> ${res.status} ${body}`)

    const down = await sbx.downloadUrl('/tmp/compat/up.txt')
    assert.match(down, /[?&]signature=v1_/)
    const got = await fetch(down)
    const text = await got.text()
    assert.ok(got.ok, `GET ${down} -> ${got.status} ${text}`)
    assert.equal(text, 'via-url')

    // The upload landed where the SDK sees it.
    assert.equal(await sbx.files.read('/tmp/compat/up.txt'), 'via-url')

    // A tampered signature must not be accepted.
    const bad = down.replace(/signature=v1_[^&]*/, 'signature=v1_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA')
    const denied = await fetch(bad)
    await denied.arrayBuffer()
    assert.ok(!denied.ok, `GET with a forged signature -> ${denied.status}, want an error`)
  })
})
