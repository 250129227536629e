// Shared helpers for the SDK compatibility suite (E2B-PROTOCOL.md §4).
//
// The suite talks to a real ember daemon through the unmodified `e2b` SDK; run.sh starts the
// daemon and exports E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY and E2B_DOMAIN. Nothing here
// mocks the server.
import assert from 'node:assert/strict'
import { Sandbox } from 'e2b'

for (const name of ['E2B_API_KEY', 'E2B_API_URL', 'E2B_SANDBOX_URL']) {
  if (!process.env[name]) {
    throw new Error(`${name} is not set: run this suite through test/sdk/run.sh`)
  }
}
if ((process.env.E2B_DEBUG ?? '').toLowerCase() === 'true') {
  throw new Error('E2B_DEBUG=true makes the SDK skip the control plane; unset it')
}

/** Pause/resume/snapshot/fork tests run only when the lead turns them on. */
export const LIFECYCLE = process.env.EMBER_SDK_LIFECYCLE === '1'
export const LIFECYCLE_SKIP = LIFECYCLE ? false : 'lifecycle issue pending (set EMBER_SDK_LIFECYCLE=1)'

/** Per-test and per-hook timeouts: creating a sandbox can take a few seconds here. */
export const TEST_TIMEOUT = 120_000
export const HOOK_TIMEOUT = 180_000

/** The create call of check 1; every shared sandbox is made the same way. */
export const COMPAT_CREATE_OPTS = Object.freeze({
  metadata: { suite: 'compat' },
  envs: { SUITE_VAR: 'hello-env' },
  timeoutMs: 300_000,
})

/**
 * Tracks sandboxes created by one test file so they are killed even when a test fails.
 * Usage: const sandboxes = new SandboxTracker(); after(() => sandboxes.killAll())
 */
export class SandboxTracker {
  #ids = new Set()

  /** Records a sandbox (or an id) and returns it unchanged. */
  add(sbx) {
    this.#ids.add(typeof sbx === 'string' ? sbx : sbx.sandboxId)
    return sbx
  }

  /** Creates a sandbox of `template` and records it. */
  async create(template = 'base', opts = COMPAT_CREATE_OPTS) {
    return this.add(await Sandbox.create(template, opts))
  }

  /** Kills every recorded sandbox; a sandbox that is already gone is fine. */
  async killAll() {
    const ids = [...this.#ids]
    this.#ids.clear()
    const results = await Promise.allSettled(ids.map((id) => Sandbox.kill(id)))
    results.forEach((r, i) => {
      if (r.status === 'rejected') {
        console.error(`cleanup: killing sandbox ${ids[i]} failed: ${r.reason}`)
      }
    })
  }
}

/** Polls `fn` until it returns a truthy value or `timeoutMs` passes; returns that value. */
export async function waitFor(fn, { timeoutMs = 5_000, intervalMs = 50, what = 'condition' } = {}) {
  const deadline = Date.now() + timeoutMs
  for (;;) {
    const v = await fn()
    if (v) return v
    if (Date.now() > deadline) {
      assert.fail(`timed out after ${timeoutMs} ms waiting for ${what}`)
    }
    await sleep(intervalMs)
  }
}

export function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms))
}

/** Returns a predicate for assert.rejects that checks the error class and then runs `more`. */
export function isError(cls, more = () => {}) {
  return (err) => {
    assert.ok(
      err instanceof cls,
      `expected ${cls.name}, got ${err?.constructor?.name}: ${err?.message}`,
    )
    more(err)
    return true
  }
}

/** Collects every item of an SDK paginator (Sandbox.list, Sandbox.listSnapshots). */
export async function collectPages(paginator, { maxPages = 1000 } = {}) {
  const pages = []
  while (paginator.hasNext) {
    pages.push(await paginator.nextItems())
    assert.ok(pages.length <= maxPages, `paginator did not end after ${maxPages} pages`)
  }
  return pages
}

export const enc = (s) => new TextEncoder().encode(s)
