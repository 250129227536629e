// A template built FROM AN IMAGE in a local registry through the unmodified SDK (issue 10):
// Template().fromImage('<registry>/test/app:v1') with RUN, ENV and COPY steps and a start and
// ready command, built with Template.build; a sandbox of the result sees the image's Env and
// WorkingDir, its layer's file, the steps' results, and runs as `user`; a rebuild is cached; a
// tag the registry does not have fails the build with an error naming the image.
//
// run.sh starts the registry (test/sdk/registry: the cached debootstrap rootfs plus a layer with
// /opt/app/hello.txt, Env APP_MODE=from-image, WorkingDir /opt/app) and exports its address as
// E2B_TEST_REGISTRY; the daemon reaches it over plain HTTP (EMBER_INSECURE_REGISTRIES). Without
// it the tests skip, or fail under EMBER_REQUIRE_ALL=1.
import { after, before, describe, test } from 'node:test'
import assert from 'node:assert/strict'
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import path from 'node:path'
import { BuildError, Sandbox, Template, waitForFile } from 'e2b'
import { HOOK_TIMEOUT, SandboxTracker, TEST_TIMEOUT } from './helpers.mjs'

const BUILD_TIMEOUT = 600_000
const REGISTRY = process.env.E2B_TEST_REGISTRY ?? ''
const missing = REGISTRY ? '' : `no local registry (${process.env.E2B_TEST_REGISTRY_ERROR ?? 'E2B_TEST_REGISTRY is not set'})`
const REQUIRE_ALL = process.env.EMBER_REQUIRE_ALL === '1'
// Skipped without the registry, unless every prerequisite is required: then the tests run and
// the first one fails with the reason.
const skip = missing && !REQUIRE_ALL ? missing : false
const IMAGE = `${REGISTRY}/test/app:v1`
const HELLO = 'hello from the image layer\n' // test/sdk/registry/main.go HelloText

const sandboxes = new SandboxTracker()
// Unique per run, so that the step cache of a reused data dir cannot serve the first build.
const nonce = Math.random().toString(36).slice(2, 10)
const alias = `sdk-img-${nonce}`

describe('template build from an image in a local registry', { skip, timeout: BUILD_TIMEOUT * 3 }, () => {
  let ctxDir
  let built

  before(() => {
    ctxDir = mkdtempSync(path.join(tmpdir(), 'ember-sdk-img-'))
    writeFileSync(path.join(ctxDir, 'copied.txt'), `copied from the build context ${nonce}\n`)
  })
  after(async () => {
    await sandboxes.killAll()
    rmSync(ctxDir, { recursive: true, force: true })
    for (const name of [alias, `${alias}-missing`]) {
      await Sandbox.deleteSnapshot(name).catch(() => {})
    }
  }, { timeout: HOOK_TIMEOUT })

  function template() {
    return Template({ fileContextPath: ctxDir })
      .fromImage(IMAGE)
      // Relative paths: the image's WorkingDir (/opt/app, owned by uid 1000 in the image layer).
      .runCmd(`echo ${nonce} > ran.txt && whoami >> ran.txt && pwd >> ran.txt && echo "$APP_MODE" >> ran.txt`)
      .setEnvs({ STEP_VAR: 'from-a-step' })
      .copy('copied.txt', '/opt/app/')
      .setStartCmd('echo started > /tmp/started.txt; sleep infinity', waitForFile('/tmp/started.txt'))
  }

  test('Template.build from the image with steps streams its logs', { timeout: BUILD_TIMEOUT }, async () => {
    assert.ok(!missing, missing)
    const logs = []
    built = await Template.build(template(), alias, { onBuildLogs: (e) => logs.push(e) })
    assert.equal(built.name, alias)
    const messages = logs.map((e) => e.message)
    assert.ok(messages.some((m) => m.includes(`FROM image ${IMAGE}`) && !m.includes('CACHED')), `no FROM image line in ${JSON.stringify(messages)}`)
    assert.ok(messages.some((m) => m.includes(`RUN echo ${nonce}`) && !m.includes('CACHED')), 'no RUN line')
    assert.ok(messages.some((m) => m.startsWith("Uploaded 'copied.txt'")), 'the COPY file was not uploaded')
  })

  test("a sandbox of it sees the image's env, workdir and layer, and the steps' results", { timeout: TEST_TIMEOUT }, async () => {
    assert.ok(built, 'the build failed')
    const sbx = sandboxes.add(await Sandbox.create(alias))
    const r = await sbx.commands.run('pwd; whoami; echo "$APP_MODE $STEP_VAR"; cat hello.txt ran.txt copied.txt /tmp/started.txt; stat -c %U copied.txt')
    assert.equal(r.stdout, [
      '/opt/app', 'user', 'from-image from-a-step', HELLO.trimEnd(),
      nonce, 'user', '/opt/app', 'from-image',
      `copied from the build context ${nonce}`, 'started', 'user', '',
    ].join('\n'))
    assert.equal(await sbx.files.read('/opt/app/hello.txt'), HELLO)
  })

  test('a rebuild with unchanged steps is cached, the image included', { timeout: BUILD_TIMEOUT }, async () => {
    assert.ok(built, 'the build failed')
    const logs = []
    const t0 = Date.now()
    const again = await Template.build(template(), alias, { onBuildLogs: (e) => logs.push(e) })
    const ms = Date.now() - t0
    const messages = logs.map((e) => e.message)
    assert.ok(messages.some((m) => m.startsWith('CACHED') && m.includes(`FROM image ${IMAGE}`)), `the image was pulled again: ${JSON.stringify(messages)}`)
    assert.ok(messages.some((m) => m.startsWith('CACHED') && m.includes(`RUN echo ${nonce}`)), 'the RUN step ran again')
    assert.ok(messages.some((m) => m.startsWith("Skipping upload of 'copied.txt'")), 'the COPY file was uploaded again')
    assert.notEqual(again.buildId, built.buildId)
    console.log(`cached rebuild from the image took ${ms} ms`)
  })

  test('a tag the registry does not have fails the build, naming the image', { timeout: BUILD_TIMEOUT }, async () => {
    assert.ok(!missing, missing)
    const ref = `${REGISTRY}/test/app:no-such-tag`
    const name = `${alias}-missing`
    await assert.rejects(Template.build(Template().fromImage(ref).runCmd('true'), name), (err) => {
      assert.ok(err instanceof BuildError, `not a BuildError: ${err}`)
      assert.ok(err.message.includes(REGISTRY) && err.message.includes('test/app'), `the error does not name the image: ${err.message}`)
      return true
    })
    assert.equal(await Template.exists(name), false)
  })
})
