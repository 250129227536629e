// Mode B (E2B-PROTOCOL.md §1.5): only E2B_DOMAIN is set, no E2B_API_URL or E2B_SANDBOX_URL, so
// the unmodified SDK talks to https://api.<domain> and https://49983-<id>.<domain>, and
// getHost(port) / getMcpUrl() name https://<port>-<id>.<domain>. run.sh sets it up when this file
// is named (or with EMBER_SDK_MODEB=1): the daemon gets --tls-listen and --domain, the test
// trusts the daemon's local CA (NODE_EXTRA_CA_CERTS) and resolves *.<domain> to 127.0.0.1 inside
// its own process (resolver.cjs); the host's DNS is untouched.
import { after, before, describe, test } from 'node:test'
import assert from 'node:assert/strict'
import tls from 'node:tls'
import { Sandbox } from 'e2b'
import { HOOK_TIMEOUT, LIFECYCLE_SKIP, SandboxTracker, TEST_TIMEOUT, sleep } from './helpers.mjs'

const MODEB = process.env.EMBER_SDK_MODEB === '1' && !!process.env.EMBER_TEST_DOMAIN
const SKIP = MODEB ? false : 'Mode B not set up (run.sh does it when 5-modeb is named, or with EMBER_SDK_MODEB=1)'
const DOMAIN = process.env.EMBER_TEST_DOMAIN
if (MODEB) {
  // Mode B proper: the SDK builds every URL from the domain. (helpers.mjs checked these were
  // set; this process no longer needs them.)
  delete process.env.E2B_API_URL
  delete process.env.E2B_SANDBOX_URL
  process.env.E2B_DOMAIN = DOMAIN
}

const sandboxes = new SandboxTracker()
after(() => sandboxes.killAll(), { timeout: HOOK_TIMEOUT })

const PAGE = '<h1>ember mode b</h1>\n'

/** Starts `python3 -m http.server 8080` serving PAGE as /index.html, in the background. */
async function startWebServer(sbx) {
  await sbx.files.write('/tmp/www/index.html', PAGE)
  const server = await sbx.commands.run('cd /tmp/www && exec python3 -m http.server 8080', { background: true, timeoutMs: 0 })
  await server.disconnect()
}

/** GETs url with the test's own fetch (it trusts the CA through NODE_EXTRA_CA_CERTS). */
async function get(url, timeoutMs = 30_000) {
  const res = await fetch(url, { signal: AbortSignal.timeout(timeoutMs) })
  return { status: res.status, body: await res.text() }
}

/** Opens a TLS connection to host[:port] (443 implied, as in the SDK's URLs) and reports the peer. */
function tlsPeer(hostPort) {
  const m = /^(.*?)(?::(\d+))?$/.exec(hostPort)
  return new Promise((resolve, reject) => {
    const sock = tls.connect({ host: m[1], servername: m[1], port: Number(m[2] ?? 443), ALPNProtocols: ['h2', 'http/1.1'] }, () => {
      const cert = sock.getPeerCertificate()
      resolve({ authorized: sock.authorized, authorizationError: sock.authorizationError, alpn: sock.alpnProtocol,
        issuer: cert.issuer?.O ?? '', subjectaltname: cert.subjectaltname ?? '' })
      sock.end()
    })
    sock.setTimeout(10_000, () => sock.destroy(new Error(`TLS to ${hostPort} timed out`)))
    sock.on('error', reject)
  })
}

/** Polls url until it answers 200 (the guest server may need a moment to bind). */
async function getWhenUp(url, timeoutMs = 20_000) {
  const deadline = Date.now() + timeoutMs
  for (;;) {
    let last
    try {
      last = await get(url)
      if (last.status === 200) return last
    } catch (err) {
      last = err
    }
    if (Date.now() > deadline) assert.fail(`${url} not up after ${timeoutMs} ms: ${JSON.stringify(last?.status ?? String(last))}`)
    await sleep(200)
  }
}

describe('Mode B: TLS and host routing', { skip: SKIP, timeout: HOOK_TIMEOUT * 3 }, () => {
  /** @type {Sandbox} */
  let sbx

  before(async () => {
    sbx = await sandboxes.create('base', { timeoutMs: 300_000 })
  }, { timeout: HOOK_TIMEOUT })

  test('create over https://api.<domain>; envd and commands over https://49983-<id>.<domain>', { timeout: TEST_TIMEOUT }, async () => {
    const id = sbx.sandboxId
    assert.equal(sbx.connectionConfig.apiUrl, `https://api.${DOMAIN}`)
    assert.equal(sbx.sandboxDomain, DOMAIN)
    assert.equal(sbx.envdApiUrl, `https://49983-${id}.${DOMAIN}`)
    const peer = await tlsPeer(`49983-${id}.${DOMAIN}`)
    assert.equal(peer.authorized, true, `certificate not trusted: ${peer.authorizationError}`)
    assert.equal(peer.alpn, 'h2')
    assert.match(peer.issuer, /ember local CA/)
    assert.ok(peer.subjectaltname.includes(`DNS:*.${DOMAIN.replace(/:\d+$/, '')}`), peer.subjectaltname)
    const r = await sbx.commands.run('echo -n mode-b; id -un')
    assert.equal(r.exitCode, 0)
    assert.equal(r.stdout, 'mode-buser\n')
    await sbx.files.write('/tmp/modeb/f.txt', 'over tls')
    assert.equal(await sbx.files.read('/tmp/modeb/f.txt'), 'over tls')
    assert.equal(await sbx.isRunning(), true)
    const info = await Sandbox.getInfo(id)
    assert.equal(info.state, 'running')
  })

  test('https://getHost(8080) reaches python3 -m http.server in the sandbox', { timeout: TEST_TIMEOUT }, async () => {
    const id = sbx.sandboxId
    const host = sbx.getHost(8080)
    assert.equal(host, `8080-${id}.${DOMAIN}`)
    assert.equal(sbx.getMcpUrl(), `https://50005-${id}.${DOMAIN}/mcp`)
    await startWebServer(sbx)
    const page = await getWhenUp(`https://${host}/index.html`)
    assert.equal(page.body, PAGE)
    // A port nothing listens on: the edge answers, the guest refuses.
    const closed = await get(`https://${sbx.getHost(8081)}/`)
    assert.equal(closed.status, 502)
  })

  test('signed downloadUrl/uploadUrl over https://49983-<id>.<domain>', { timeout: TEST_TIMEOUT }, async () => {
    const url = await sbx.downloadUrl('/tmp/modeb/f.txt')
    assert.ok(url.startsWith(`https://49983-${sbx.sandboxId}.${DOMAIN}/files?`), url)
    const got = await get(url)
    assert.equal(got.status, 200)
    assert.equal(got.body, 'over tls')
    const up = await sbx.uploadUrl('/tmp/modeb/up.txt')
    const form = new FormData()
    form.append('file', new Blob(['via-url']), 'up.txt')
    const res = await fetch(up, { method: 'POST', body: form, signal: AbortSignal.timeout(30_000) })
    await res.arrayBuffer()
    assert.ok(res.ok, `upload: ${res.status}`)
    assert.equal(await sbx.files.read('/tmp/modeb/up.txt'), 'via-url')
  })

  test('a paused sandbox without autoResume stays paused: its host answers 502', { skip: LIFECYCLE_SKIP, timeout: HOOK_TIMEOUT }, async () => {
    assert.equal(await sbx.pause(), true)
    const r = await get(`https://${sbx.getHost(8080)}/index.html`)
    assert.equal(r.status, 502)
    assert.equal((await Sandbox.getInfo(sbx.sandboxId)).state, 'paused')
  })
})

describe('Mode B: auto-resume through host routing', { skip: SKIP || LIFECYCLE_SKIP, timeout: HOOK_TIMEOUT * 3 }, () => {
  test('a request to https://getHost(8080) wakes a paused autoResume sandbox', { timeout: HOOK_TIMEOUT * 2 }, async () => {
    const sbx = await sandboxes.create('base', { timeoutMs: 300_000, lifecycle: { onTimeout: 'pause', autoResume: true } })
    const info = await sbx.getInfo()
    assert.deepEqual(info.lifecycle, { onTimeout: 'pause', autoResume: true })
    await startWebServer(sbx)
    const url = `https://${sbx.getHost(8080)}/index.html`
    assert.equal((await getWhenUp(url)).body, PAGE)

    assert.equal(await sbx.pause(), true)
    assert.equal((await Sandbox.getInfo(sbx.sandboxId)).state, 'paused')

    // The server process was kept in the paused memory image; traffic alone brings it back.
    const woken = await get(url, 60_000)
    assert.equal(woken.status, 200, `after pause: ${woken.status} ${woken.body}`)
    assert.equal(woken.body, PAGE)
    assert.equal((await Sandbox.getInfo(sbx.sandboxId)).state, 'running')
    // The SDK handle works again, over TLS, without connect().
    const r = await sbx.commands.run('cat /tmp/www/index.html')
    assert.equal(r.stdout, PAGE)
  })
})
