// E2B's template build API (issue 10, item 4) through the unmodified SDK: Template() with
// fromTemplate('base'), RUN/ENV/WORKDIR/USER/COPY steps and a start and ready command, built with
// Template.build; a sandbox of the result sees the env, workdir, user and copied file; a rebuild
// is cached; Template.exists, tags, Template.getBuildStatus; a failing step fails the build and
// leaves no template. The tests run in order and share the built template.
import { after, before, describe, test } from 'node:test'
import assert from 'node:assert/strict'
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import path from 'node:path'
import { BuildError, Sandbox, Template, waitForFile } from 'e2b'
import { HOOK_TIMEOUT, SandboxTracker, TEST_TIMEOUT } from './helpers.mjs'

const BUILD_TIMEOUT = 600_000
const sandboxes = new SandboxTracker()
// Unique per run: the step cache is keyed by content, so a fresh first step keeps the first build
// from hitting layers an earlier run left in a reused data dir.
const nonce = Math.random().toString(36).slice(2, 10)
const alias = `sdk-tpl-${nonce}`

describe('template build API', { timeout: BUILD_TIMEOUT * 3 }, () => {
  let ctxDir
  let built
  let firstLogs = []

  before(() => {
    ctxDir = mkdtempSync(path.join(tmpdir(), 'ember-sdk-tpl-'))
    writeFileSync(path.join(ctxDir, 'hello.txt'), `hello from the build context ${nonce}\n`)
    mkdirSync(path.join(ctxDir, 'conf', 'sub'), { recursive: true })
    writeFileSync(path.join(ctxDir, 'conf', 'a.conf'), 'a\n')
    writeFileSync(path.join(ctxDir, 'conf', 'sub', 'b.conf'), 'b\n')
  })
  after(async () => {
    await sandboxes.killAll()
    rmSync(ctxDir, { recursive: true, force: true })
    for (const name of [alias, `${alias}-fail`]) {
      await Sandbox.deleteSnapshot(name).catch(() => {})
    }
  }, { timeout: HOOK_TIMEOUT })

  function template() {
    return Template({ fileContextPath: ctxDir })
      .fromTemplate('base')
      .runCmd(`echo ${nonce} > /tmp/nonce`)
      .runCmd(['mkdir -p /opt/app', 'chown user:user /opt/app'], { user: 'root' })
      // Deletions of the parent's files: a whiteout, and an opaque directory.
      .runCmd(['rm /etc/motd', 'rm -rf /etc/skel', 'mkdir /etc/skel', 'touch /etc/skel/only'], { user: 'root' })
      .setEnvs({ GREETING: 'hi from the template' })
      .setWorkdir('/opt/app')
      .copy('hello.txt', '/opt/app/')
      .copy('conf', 'conf', { user: 'root', mode: 0o640 })
      .runCmd('echo "$GREETING" > greeting.txt && pwd > pwd.txt')
      .setUser('root')
      .runCmd('whoami > /opt/app/built-by')
      .setUser('user')
      .setStartCmd('echo started > /tmp/started.txt; sleep infinity', waitForFile('/tmp/started.txt'))
  }

  test('Template.build builds from base with steps and streams logs', { timeout: BUILD_TIMEOUT }, async () => {
    built = await Template.build(template(), alias, { onBuildLogs: (e) => firstLogs.push(e) })
    assert.equal(built.name, alias)
    assert.equal(typeof built.buildId, 'string')
    const messages = firstLogs.map((e) => e.message)
    assert.ok(messages.some((m) => m.includes(`RUN echo ${nonce}`)), `no RUN line in ${JSON.stringify(messages)}`)
    assert.ok(messages.some((m) => m.includes('COPY hello.txt /opt/app/')), 'no COPY line')
    assert.ok(!messages.some((m) => m.includes('CACHED') && m.includes(nonce)), 'the fresh step was cached')
    assert.ok(messages.some((m) => m.startsWith("Uploaded 'hello.txt'")), 'the COPY file was not uploaded')
  })

  test('a sandbox of the template sees its env, workdir, user, files and start command', { timeout: TEST_TIMEOUT }, async () => {
    assert.ok(built, 'the build failed')
    const sbx = sandboxes.add(await Sandbox.create(alias))
    const r = await sbx.commands.run('pwd; whoami; echo "$GREETING"; cat hello.txt greeting.txt pwd.txt built-by /tmp/started.txt; stat -c %U hello.txt; test -e /etc/motd || echo motd-gone; ls -A /etc/skel; stat -c "%U %a" conf/a.conf conf/sub/b.conf')
    assert.equal(r.stdout, [
      '/opt/app', 'user', 'hi from the template', `hello from the build context ${nonce}`, 'hi from the template',
      '/opt/app', 'root', 'started', 'user', 'motd-gone', 'only', 'root 640', 'root 640', '',
    ].join('\n'))
    assert.equal(await sbx.files.read('/opt/app/hello.txt'), `hello from the build context ${nonce}\n`)
  })

  test('Template.exists and Template.getBuildStatus', { timeout: TEST_TIMEOUT }, async () => {
    assert.equal(await Template.exists(alias), true)
    assert.equal(await Template.exists('base'), true)
    assert.equal(await Template.exists(`${alias}-nope`), false)
    const st = await Template.getBuildStatus(built)
    assert.equal(st.status, 'ready')
    assert.equal(st.buildID, built.buildId)
    assert.ok(st.logEntries.length > 0)
    const tail = await Template.getBuildStatus(built, { logsOffset: st.logEntries.length })
    assert.equal(tail.logEntries.length, 0)
  })

  test('a rebuild with unchanged steps is cached', { timeout: BUILD_TIMEOUT }, async () => {
    const logs = []
    const t0 = Date.now()
    const again = await Template.build(template(), alias, { onBuildLogs: (e) => logs.push(e) })
    const ms = Date.now() - t0
    const messages = logs.map((e) => e.message)
    assert.ok(messages.some((m) => m.includes('CACHED') && m.includes(`RUN echo ${nonce}`)), `no CACHED line in ${JSON.stringify(messages)}`)
    assert.ok(messages.some((m) => m.startsWith("Skipping upload of 'hello.txt'")), 'the COPY file was uploaded again')
    assert.notEqual(again.buildId, built.buildId)
    console.log(`cached rebuild took ${ms} ms`)
  })

  test('an appended step runs alone on the cached steps', { timeout: BUILD_TIMEOUT }, async () => {
    const logs = []
    const more = `${alias}-more`
    await Template.build(template().runCmd('echo appended > /opt/app/appended.txt'), more, { onBuildLogs: (e) => logs.push(e) })
    const messages = logs.map((e) => e.message)
    assert.ok(messages.some((m) => m.startsWith('CACHED') && m.includes('COPY hello.txt')), `the COPY step was not cached: ${JSON.stringify(messages)}`)
    assert.ok(messages.some((m) => !m.startsWith('CACHED') && m.includes('RUN echo appended')), 'the appended step did not run')
    const sbx = sandboxes.add(await Sandbox.create(more))
    const r = await sbx.commands.run('cat appended.txt hello.txt')
    assert.equal(r.stdout, `appended\nhello from the build context ${nonce}\n`)
    await Sandbox.deleteSnapshot(more).catch(() => {})
  })

  test('tags: assign, list, remove', { timeout: TEST_TIMEOUT }, async () => {
    const res = await Template.assignTags(`${alias}:latest`, ['stable', 'v1'])
    assert.deepEqual(res.tags, ['stable', 'v1'])
    let tags = (await Template.getTags(alias)).map((t) => t.tag).sort()
    assert.deepEqual(tags, ['stable', 'v1'])
    await Template.removeTags(alias, 'v1')
    tags = (await Template.getTags(alias)).map((t) => t.tag)
    assert.deepEqual(tags, ['stable'])
    const sbx = sandboxes.add(await Sandbox.create(`${alias}:stable`))
    assert.equal((await sbx.commands.run('cat hello.txt')).stdout, `hello from the build context ${nonce}\n`)
    await assert.rejects(Sandbox.create(`${alias}:v1`))
  })

  test("fromBaseImage() (E2B's e2bdev/base) builds on ember's base", { timeout: BUILD_TIMEOUT }, async () => {
    const name = `${alias}-base-image`
    await Template.build(Template().fromBaseImage().runCmd(`echo ${nonce} > marker.txt`), name)
    const sbx = sandboxes.add(await Sandbox.create(name))
    const r = await sbx.commands.run('pwd; whoami; cat marker.txt')
    assert.equal(r.stdout, `/home/user\nuser\n${nonce}\n`)
    await Sandbox.deleteSnapshot(name).catch(() => {})
  })

  test('a failing step fails the build with its message and leaves no template', { timeout: BUILD_TIMEOUT }, async () => {
    const bad = Template().fromTemplate('base').runCmd(`echo ${nonce}-fail`).runCmd('echo about to fail; exit 3')
    await assert.rejects(Template.build(bad, `${alias}-fail`), (err) => {
      assert.ok(err instanceof BuildError, `not a BuildError: ${err}`)
      assert.match(err.message, /exit status 3/)
      return true
    })
    assert.equal(await Template.exists(`${alias}-fail`), false)
  })
})
