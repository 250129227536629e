// Preloaded (NODE_OPTIONS=--require) by run.sh for the Mode B test: inside this Node process
// only, the test's sandbox domain (EMBER_TEST_DOMAIN, e.g. "ember.test:8443" -> "ember.test")
// and every name under it resolve to 127.0.0.1, so https://<port>-<id>.<domain> reaches the
// daemon's TLS listener without touching the host's DNS configuration. Other names resolve
// as usual.
'use strict'
const dns = require('node:dns')

const host = (process.env.EMBER_TEST_DOMAIN || '').toLowerCase().replace(/:\d+$/, '').replace(/\.$/, '')

function ours(name) {
  if (!host || typeof name !== 'string') return false
  const n = name.toLowerCase().replace(/\.$/, '')
  return n === host || n.endsWith('.' + host)
}

const LOOPBACK = { address: '127.0.0.1', family: 4 }

if (host) {
  const lookup = dns.lookup
  dns.lookup = function emberTestLookup(hostname, options, callback) {
    if (!ours(hostname)) return lookup.apply(this, arguments)
    if (typeof options === 'function') {
      callback = options
      options = {}
    }
    const all = typeof options === 'object' && options !== null && options.all
    process.nextTick(() => (all ? callback(null, [LOOPBACK]) : callback(null, LOOPBACK.address, LOOPBACK.family)))
  }
  const plookup = dns.promises.lookup
  dns.promises.lookup = async function emberTestLookup(hostname, options) {
    if (!ours(hostname)) return plookup.call(this, hostname, options)
    return options && options.all ? [LOOPBACK] : LOOPBACK
  }
}
