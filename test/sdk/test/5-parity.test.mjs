// E2B parity checks (issue 9): envd 0.6 features the SDK gates on (file metadata, watch entry
// info, network-mount watching), validation order and E2B's error messages, filesystem details
// (symlinks, remove of a missing path, non-seekable files), template alias lookup, and a kill
// ending the streams of other clients.
import { after, before, describe, test } from 'node:test'
import assert from 'node:assert/strict'
import {
  AuthenticationError,
  FileNotFoundError,
  FilesystemEventType,
  InvalidArgumentError,
  NotFoundError,
  Sandbox,
  SandboxError,
  SandboxNotFoundError,
  Template,
} from 'e2b'
import {
  COMPAT_CREATE_OPTS,
  HOOK_TIMEOUT,
  SandboxTracker,
  TEST_TIMEOUT,
  isError,
  sleep,
  waitFor,
} from './helpers.mjs'

const sandboxes = new SandboxTracker()

describe('parity', { timeout: TEST_TIMEOUT * 16 }, () => {
  /** @type {import('e2b').Sandbox} */
  let sbx

  before(async () => {
    sbx = await sandboxes.create('base', COMPAT_CREATE_OPTS)
  }, { timeout: HOOK_TIMEOUT })
  after(() => sandboxes.killAll(), { timeout: HOOK_TIMEOUT })

  test('envd advertises 0.6.4 (metadata, watch entry info, network mounts)', async () => {
    const info = await sbx.getInfo()
    assert.equal(info.envdVersion, '0.6.4')
  })

  test('write with metadata: multipart, octet-stream, multi-file; surfaced by getInfo and list', { timeout: TEST_TIMEOUT }, async () => {
    const w = await sbx.files.write('/tmp/meta/a.txt', 'a', { metadata: { Author: 'ann', purpose: 'test' } })
    assert.deepEqual(w.metadata, { author: 'ann', purpose: 'test' })

    const o = await sbx.files.write('/tmp/meta/b.txt', 'b', { metadata: { k: 'v' }, useOctetStream: true })
    assert.deepEqual(o.metadata, { k: 'v' })

    const many = await sbx.files.writeFiles(
      [{ path: '/tmp/meta/c1.txt', data: 'c1' }, { path: '/tmp/meta/c2.txt', data: 'c2' }],
      { metadata: { batch: '1' } },
    )
    assert.equal(many.length, 2)
    for (const f of many) assert.deepEqual(f.metadata, { batch: '1' })

    assert.deepEqual((await sbx.files.getInfo('/tmp/meta/a.txt')).metadata, { author: 'ann', purpose: 'test' })
    const listed = Object.fromEntries((await sbx.files.list('/tmp/meta')).map((e) => [e.name, e.metadata]))
    assert.deepEqual(listed['b.txt'], { k: 'v' })
    assert.deepEqual(listed['c2.txt'], { batch: '1' })

    // The xattrs are real: the guest sees them too.
    const r = await sbx.commands.run(`python3 -c "import os; print(os.getxattr('/tmp/meta/a.txt', 'user.e2b.author').decode())"`)
    assert.equal(r.stdout.trim(), 'ann')
  })

  test('metadata survives rename, shows up when set through xattrs, and an overwrite clears it', { timeout: TEST_TIMEOUT }, async () => {
    await sbx.files.write('/home/user/meta-src.txt', 'x', { metadata: { owner: 'me' } })
    const moved = await sbx.files.rename('/home/user/meta-src.txt', '/home/user/meta-dst.txt')
    assert.deepEqual(moved.metadata, { owner: 'me' })

    await sbx.files.write('/home/user/direct.txt', 'd')
    await sbx.commands.run(`python3 -c "import os; os.setxattr('/home/user/direct.txt', 'user.e2b.color', b'blue'); os.setxattr('/home/user/direct.txt', 'user.other', b'x')"`)
    assert.deepEqual((await sbx.files.getInfo('/home/user/direct.txt')).metadata, { color: 'blue' })

    const again = await sbx.files.write('/home/user/meta-dst.txt', 'y')
    assert.equal(again.metadata, undefined)
    assert.equal((await sbx.files.getInfo('/home/user/meta-dst.txt')).metadata, undefined)
    await sbx.files.write('/home/user/direct.txt', 'd2', { metadata: { size: 'L' } })
    assert.deepEqual((await sbx.files.getInfo('/home/user/direct.txt')).metadata, { size: 'L' })
  })

  test('watchDir with includeEntry and allowNetworkMounts', { timeout: TEST_TIMEOUT }, async () => {
    await sbx.files.makeDir('/tmp/watch-entry')
    const events = []
    const handle = await sbx.files.watchDir('/tmp/watch-entry', (e) => events.push(e), {
      includeEntry: true,
      allowNetworkMounts: true,
    })
    try {
      await sbx.files.write('/tmp/watch-entry/new.txt', 'hello')
      const ev = await waitFor(
        () => events.find((e) => e.name === 'new.txt' && e.type === FilesystemEventType.CREATE),
        { what: 'create event' },
      )
      assert.ok(ev.entry, 'create event carries the entry')
      assert.equal(ev.entry.path, '/tmp/watch-entry/new.txt')
      assert.equal(ev.entry.type, 'file')
    } finally {
      await handle.stop()
    }
  })

  test('fork checks count before the sandbox id (400, not 404)', { timeout: TEST_TIMEOUT }, async () => {
    await assert.rejects(
      Sandbox.fork('no-such-id', { count: 0 }),
      isError(SandboxError, (err) => {
        assert.ok(!(err instanceof NotFoundError), `got ${err.constructor.name}: ${err.message}`)
        assert.equal(err.statusCode, 400)
        assert.match(err.message, /^400: Count must be at least 1/)
      }),
    )
  })

  test('signed URLs: E2B messages for expired and invalid signatures', { timeout: TEST_TIMEOUT }, async () => {
    await sbx.files.write('/tmp/signed.txt', 'signed')
    const expired = await sbx.downloadUrl('/tmp/signed.txt', { useSignatureExpiration: -10_000 })
    let res = await fetch(expired)
    assert.equal(res.status, 401)
    assert.deepEqual(await res.json(), { code: 401, message: 'signature is already expired' })

    const url = new URL(await sbx.downloadUrl('/tmp/signed.txt'))
    url.searchParams.set('signature', 'v1_' + 'A'.repeat(43))
    res = await fetch(url)
    assert.equal(res.status, 401)
    assert.deepEqual(await res.json(), { code: 401, message: 'invalid signature' })
  })

  test('getInfo of a symlink: absolute target, the target type', { timeout: TEST_TIMEOUT }, async () => {
    await sbx.files.write('/home/user/link-target.txt', 'target')
    await sbx.commands.run('cd /home/user && ln -sfn link-target.txt rel-link && mkdir -p d && ln -sfn d dir-link')
    const f = await sbx.files.getInfo('/home/user/rel-link')
    assert.equal(f.symlinkTarget, '/home/user/link-target.txt')
    assert.equal(f.type, 'file')
    const d = await sbx.files.getInfo('dir-link')
    assert.equal(d.symlinkTarget, '/home/user/d')
    assert.equal(d.type, 'dir')
    const listed = (await sbx.files.list('/home/user')).find((e) => e.name === 'rel-link')
    assert.equal(listed?.type, 'file')
  })

  test('remove of a missing path succeeds', { timeout: TEST_TIMEOUT }, async () => {
    await sbx.files.remove('/tmp/definitely/not/here')
  })

  test('read of non-seekable files streams their content', { timeout: TEST_TIMEOUT }, async () => {
    const want = (await sbx.commands.run('cat /proc/sys/kernel/random/boot_id')).stdout
    assert.equal(await sbx.files.read('/proc/sys/kernel/random/boot_id'), want)
    assert.match(await sbx.files.read('/proc/self/status'), /^Name:/)
  })

  test('errors the SDK surfaces carry E2B envd/API codes and messages', { timeout: TEST_TIMEOUT }, async () => {
    await sbx.files.write('/tmp/errs/file.txt', 'f')
    assert.equal(await sbx.files.makeDir('/tmp/errs'), false)
    await assert.rejects(sbx.files.makeDir('/tmp/errs/file.txt'), isError(InvalidArgumentError, (err) =>
      assert.match(err.message, /path already exists but it is not a directory: \/tmp\/errs\/file.txt/)))
    await assert.rejects(sbx.files.list('/tmp/errs/file.txt'), isError(InvalidArgumentError, (err) =>
      assert.match(err.message, /path is not a directory: \/tmp\/errs\/file.txt/)))
    await assert.rejects(sbx.files.getInfo('/tmp/errs/missing'), isError(FileNotFoundError, (err) =>
      assert.match(err.message, /file not found: lstat \/tmp\/errs\/missing: no such file or directory/)))
    await assert.rejects(sbx.commands.run('true', { user: 'no-such-user' }), isError(AuthenticationError, (err) =>
      assert.match(err.message, /invalid username: 'no-such-user'/)))
    await assert.rejects(Sandbox.getInfo('nosuchsandbox'), isError(SandboxNotFoundError))
    await assert.rejects(Sandbox.create('no-such-template', { timeoutMs: 60_000 }), isError(SandboxError, (err) => {
      assert.equal(err.statusCode, 404)
      assert.equal(err.message, "404: template 'no-such-template' not found")
    }))
  })

  test('Template.exists: true for base, false for an unknown alias', { timeout: TEST_TIMEOUT }, async () => {
    assert.equal(await Template.exists('base'), true)
    assert.equal(await Template.exists('no-such-template-alias'), false)
  })

  test('kill from another client ends a running command stream at once', { timeout: TEST_TIMEOUT }, async () => {
    const victim = await sandboxes.create('base', COMPAT_CREATE_OPTS)
    const run = victim.commands.run('sleep 60; echo done')
    const outcome = run.then(() => 'resolved', (err) => err)
    await sleep(1_000) // the stream is established
    const t0 = Date.now()
    assert.equal(await Sandbox.kill(victim.sandboxId), true)
    const err = await Promise.race([outcome, sleep(10_000).then(() => 'still running')])
    assert.ok(err instanceof SandboxError, `expected the run to reject, got ${err}`)
    assert.ok(Date.now() - t0 < 10_000)
  })
})
