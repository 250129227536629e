#!/usr/bin/env bash
# Runs the E2B SDK compatibility suite (the unmodified `e2b` npm package, pinned in
# package-lock.json) against a real ember daemon that this script starts and stops.
#
# Environment:
#   EMBER_BIN            ember binary (default: <repo>/bin/ember)
#   EMBER_DATA_DIR       data dir holding the built `base` template (default: a fresh temp dir;
#                        the daemon then builds `base` itself, which is slow)
#   EMBER_READY_TIMEOUT  seconds to wait for the daemon to answer HTTP (default: 60)
#   EMBER_SDK_LIFECYCLE  1 = also run the pause/resume/snapshot/fork tests
#   EMBER_SDK_KEEP_LOG   1 = keep the daemon log even when the tests pass
#   EMBER_SDK_MODEB      1 = also set up Mode B (TLS + host routing) for test/5-modeb.test.mjs;
#                        on by itself when an argument names a *modeb* test file. The daemon then
#                        also serves HTTPS (--tls-listen, local CA) for --domain ember.test[:port];
#                        the tests trust its CA (NODE_EXTRA_CA_CERTS) and resolve *.ember.test to
#                        127.0.0.1 in-process (test/resolver.cjs). Nothing else changes.
#   EMBER_SDK_TEST_DOMAIN  the domain in Mode B (default ember.test; test/python uses
#                        ember.localhost, which the Python kit's netguard resolves to loopback)
#   EMBER_SDK_TLS_PORT   the HTTPS port in Mode B (default: a free one, named in the domain;
#                        443 = the portless form https://<port>-<id>.ember.test)
#   EMBER_CACHE_DIR      holds debootstrap/debootstrap-bookworm-*.tar (default: <repo>/.cache), the
#                        base layer of the image that the local registry serves (below)
#   EMBER_REQUIRE_ALL    1 = a test whose prerequisite is missing (the local registry) fails
#                        instead of skipping
#   EMBER_SDK_PORT       the daemon's HTTP port on 127.0.0.1 (default: a free one)
#   EMBER_NODE_ID, EMBER_CIDR  read by the daemon itself (as --node-id, --cidr; also accepted in
#                        EMBER_SERVE_FLAGS): a node id of its own keeps its netns, nftables table
#                        and cgroups apart from other daemons on the host
#   EMBER_SERVE_FLAGS    more `ember serve` flags
#   EMBER_TEST_CMD       a bash command line run instead of `node --test` (the arguments follow it
#                        as "$@"), with the same environment; in Mode B also EMBER_CA_FILE (the
#                        daemon's CA). test/python/run.sh runs the Python tests this way.
#
# At exit the script deletes the nftables table, network namespaces and (empty) cgroup parents of
# its daemon's node id (table inet ember[_<id>], netns e<id>x-* / emb-*, cgroup ember[-<id>])
# unless they existed before it started, or sandboxes of a data dir it was given still run
# (the daemon leaves its warm pool running for the next daemon on that data dir to adopt).
#
# Before the daemon, when it runs the default file list or a *template-image* test, the script
# starts a local OCI registry on loopback (test/sdk/registry, built
# with go) holding test/app:v1; the tests get its address as E2B_TEST_REGISTRY=host:port and the
# daemon reaches it over plain HTTP (EMBER_INSECURE_REGISTRIES), allowed on loopback
# (EMBER_REGISTRY_ALLOW). If it cannot start, the tests get
# E2B_TEST_REGISTRY_ERROR instead, and the image tests skip (or fail under EMBER_REQUIRE_ALL=1).
# Arguments, if any, are passed to `node --test` instead of the default file list, e.g.
#   test/sdk/run.sh test/3-files.test.mjs        (paths relative to test/sdk)
#   test/sdk/run.sh --test-name-pattern=pty test/2-commands.test.mjs
# Exit status: the test runner's, or 1 if the daemon could not be started.
set -uo pipefail

SDK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SDK_DIR/../.." && pwd)"
EMBER_BIN="${EMBER_BIN:-$REPO_ROOT/bin/ember}"
READY_TIMEOUT="${EMBER_READY_TIMEOUT:-60}"

log() { printf 'sdk-run: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

[[ -x "$EMBER_BIN" ]] || die "EMBER_BIN=$EMBER_BIN is not an executable (build it first: make build)"
command -v node >/dev/null || die "node is not installed"

if [[ -z "${EMBER_TEST_CMD:-}" && ! -d "$SDK_DIR/node_modules/e2b" ]]; then
  log "installing the pinned SDK (npm ci)"
  (cd "$SDK_DIR" && npm ci --no-audit --no-fund --loglevel=error) || die "npm ci failed"
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/ember-sdk.XXXXXX")"
DAEMON_LOG="$WORK/ember.log"
CREATED_DATA_DIR=""
if [[ -z "${EMBER_DATA_DIR:-}" ]]; then
  EMBER_DATA_DIR="$WORK/data"
  CREATED_DATA_DIR="$EMBER_DATA_DIR"
  mkdir -p "$EMBER_DATA_DIR"
  log "EMBER_DATA_DIR not set: using fresh $EMBER_DATA_DIR (base template will be built, slow)"
fi

# A free loopback port (the kernel picks it; a tiny race with other processes is acceptable).
PORT="${EMBER_SDK_PORT:-}"
[[ -n "$PORT" ]] || PORT="$(node -e 'const s=require("net").createServer();s.listen(0,"127.0.0.1",()=>{console.log(s.address().port);s.close()})')" \
  || die "could not pick a free port"
BASE_URL="http://127.0.0.1:$PORT"

MODEB="${EMBER_SDK_MODEB:-0}"
for arg in "$@"; do [[ "$arg" == *modeb* ]] && MODEB=1; done
TLS_FLAGS=()
if [[ "$MODEB" == 1 ]]; then
  TLS_PORT="${EMBER_SDK_TLS_PORT:-$(node -e 'const s=require("net").createServer();s.listen(0,"127.0.0.1",()=>{console.log(s.address().port);s.close()})')}" \
    || die "could not pick a free TLS port"
  TEST_DOMAIN="${EMBER_SDK_TEST_DOMAIN:-ember.test}"
  [[ "$TLS_PORT" == 443 ]] || TEST_DOMAIN="$TEST_DOMAIN:$TLS_PORT"
  TLS_FLAGS=(--tls-listen "127.0.0.1:$TLS_PORT" --domain "$TEST_DOMAIN")
fi

# The node-local names of the daemon's node id (internal/daemon NodeNames), for the clean-up at exit.
NODE_ID="${EMBER_NODE_ID:-}"
read -r -a SERVE_FLAGS <<<"${EMBER_SERVE_FLAGS:-}"
for i in "${!SERVE_FLAGS[@]}"; do
  case "${SERVE_FLAGS[$i]}" in
    --node-id=*) NODE_ID="${SERVE_FLAGS[$i]#--node-id=}" ;;
    --node-id) NODE_ID="${SERVE_FLAGS[$((i + 1))]:-}" ;;
  esac
done
if [[ -n "$NODE_ID" ]]; then NFT_TABLE="ember_$NODE_ID" NETNS_PREFIX="e${NODE_ID}x-"; else NFT_TABLE="ember" NETNS_PREFIX="emb-"; fi
node_netns() { ip netns list 2>/dev/null | awk '{print $1}' | grep -F -- "$NETNS_PREFIX" | grep -E "^${NETNS_PREFIX}[0-9]+$"; }
# What existed before the daemon (another daemon's, on the same node id) is left alone.
NFT_TABLE_BEFORE=0
command -v nft >/dev/null && nft list table inet "$NFT_TABLE" >/dev/null 2>&1 && NFT_TABLE_BEFORE=1
NETNS_BEFORE="$(node_netns)"
# Its cgroup parent (<hierarchy>/ember[-<id>]), removed at exit when empty and new.
CGROUP_NAME="ember${NODE_ID:+-$NODE_ID}"
CGROUPS_BEFORE="$(ls -d /sys/fs/cgroup/"$CGROUP_NAME" /sys/fs/cgroup/*/"$CGROUP_NAME" 2>/dev/null)"
cleanup_node() {
  # Sandboxes the daemon left running (its warm pool) stay for the next daemon on this data
  # dir to adopt, in their netns: then nothing is deleted, unless the data dir is this script's.
  if [[ -z "$CREATED_DATA_DIR" ]] && pgrep -f -- "--root=$EMBER_DATA_DIR/runsc " >/dev/null; then
    log "sandboxes of $EMBER_DATA_DIR still run: their node's netns and nftables table stay"
    return 0
  fi
  if [[ "$NFT_TABLE_BEFORE" == 0 ]] && command -v nft >/dev/null && nft list table inet "$NFT_TABLE" >/dev/null 2>&1; then
    nft delete table inet "$NFT_TABLE" 2>/dev/null || log "could not delete nftables table inet $NFT_TABLE"
  fi
  local ns
  for ns in $(node_netns); do
    grep -qxF -- "$ns" <<<"$NETNS_BEFORE" && continue
    ip netns delete "$ns" 2>/dev/null || log "could not delete netns $ns"
  done
  local cg
  for cg in /sys/fs/cgroup/"$CGROUP_NAME" /sys/fs/cgroup/*/"$CGROUP_NAME"; do
    [[ -d "$cg" ]] || continue
    grep -qxF -- "$cg" <<<"$CGROUPS_BEFORE" && continue
    # Deepest first; rmdir fails on a cgroup that still holds a process.
    find "$cg" -depth -type d -exec rmdir {} \; 2>/dev/null
  done
}

DAEMON_PID=""
TEST_PID=""
REGISTRY_PID=""
stop_registry() {
  [[ -n "$REGISTRY_PID" ]] || return 0
  kill "$REGISTRY_PID" 2>/dev/null
  wait "$REGISTRY_PID" 2>/dev/null
  REGISTRY_PID=""
}
stop_daemon() {
  [[ -n "$DAEMON_PID" ]] || return 0
  if kill -0 "$DAEMON_PID" 2>/dev/null; then
    kill "$DAEMON_PID" 2>/dev/null
    for _ in $(seq 1 100); do
      kill -0 "$DAEMON_PID" 2>/dev/null || break
      sleep 0.1
    done
    if kill -0 "$DAEMON_PID" 2>/dev/null; then
      log "daemon $DAEMON_PID did not stop within 10 s: SIGKILL"
      kill -9 "$DAEMON_PID" 2>/dev/null
    fi
  fi
  wait "$DAEMON_PID" 2>/dev/null
  DAEMON_PID=""
}

STATUS=1
finish() {
  if [[ -n "$TEST_PID" ]] && kill -0 "$TEST_PID" 2>/dev/null; then
    kill "$TEST_PID" 2>/dev/null
    wait "$TEST_PID" 2>/dev/null
  fi
  stop_daemon
  cleanup_node
  stop_registry
  rm -rf "$WORK/registry" "$WORK/registry-blobs"
  # runsc keeps a namespace bind mount in its root dir; it would pin the data dir.
  umount "$EMBER_DATA_DIR/runsc/null-netns" 2>/dev/null || true
  if [[ "$STATUS" -ne 0 ]]; then
    if [[ -s "$DAEMON_LOG" ]]; then
      log "daemon log tail ($DAEMON_LOG):"
      tail -n 80 "$DAEMON_LOG" | sed 's/^/  | /' >&2
    fi
    if [[ -d "$EMBER_DATA_DIR/logs/failed" ]]; then
      log "runsc logs of failed starts/restores (the errors in the daemon log name them):"
      ls -1t "$EMBER_DATA_DIR/logs/failed" | head -n 5 | sed "s|^|  | $EMBER_DATA_DIR/logs/failed/|" >&2
    fi
    log "kept $WORK for inspection"
    [[ -n "$CREATED_DATA_DIR" ]] && mountpoint -q "$CREATED_DATA_DIR" &&
      log "its data dir is still the mounted layer filesystem: scripts/unmount-data-dir.sh $CREATED_DATA_DIR before removing it"
  elif [[ "${EMBER_SDK_KEEP_LOG:-0}" == 1 ]]; then
    log "daemon log: $DAEMON_LOG"
  else
    # Its own data dir: the layer filesystem mounted over it (and its loop device) goes too.
    [[ -n "$CREATED_DATA_DIR" ]] && { bash "$REPO_ROOT/scripts/unmount-data-dir.sh" "$CREATED_DATA_DIR"; rm -rf "$CREATED_DATA_DIR"; }
    rm -f "$DAEMON_LOG" "$WORK/registry.out" "$WORK/registry.err"
    rmdir "$WORK" 2>/dev/null
  fi
  exit "$STATUS"
}
trap finish EXIT
trap 'log "interrupted"; STATUS=130; exit 130' INT TERM

# The local registry (see the header), its blobs under $WORK/registry-blobs.
# Sets REGISTRY_ADDR, or REGISTRY_ERR when it cannot start.
REGISTRY_ADDR=""
REGISTRY_ERR=""
start_registry() {
  local gobin deadline
  gobin="$(command -v go || echo /usr/local/go/bin/go)"
  [[ -x "$gobin" ]] || { REGISTRY_ERR="go is not installed (it builds test/sdk/registry)"; return 1; }
  if ! (cd "$REPO_ROOT" && "$gobin" build -o "$WORK/registry" ./test/sdk/registry) 2>"$WORK/registry.err"; then
    REGISTRY_ERR="building test/sdk/registry failed: $(tail -n 5 "$WORK/registry.err")"
    return 1
  fi
  EMBER_CACHE_DIR="${EMBER_CACHE_DIR:-$REPO_ROOT/.cache}" "$WORK/registry" -blobs "$WORK/registry-blobs" >"$WORK/registry.out" 2>"$WORK/registry.err" &
  REGISTRY_PID=$!
  deadline=$((SECONDS + 120))
  until grep -q '^READY ' "$WORK/registry.out" 2>/dev/null; do
    if ! kill -0 "$REGISTRY_PID" 2>/dev/null; then
      wait "$REGISTRY_PID" 2>/dev/null
      REGISTRY_PID=""
      REGISTRY_ERR="the local registry exited: $(tail -n 5 "$WORK/registry.err")"
      return 1
    fi
    if (( SECONDS >= deadline )); then
      stop_registry
      REGISTRY_ERR="the local registry was not ready after 120 s"
      return 1
    fi
    sleep 0.2
  done
  REGISTRY_ADDR="$(sed -n 's/^READY //p' "$WORK/registry.out" | head -n 1)"
}
unset E2B_TEST_REGISTRY E2B_TEST_REGISTRY_ERROR
WANT_REGISTRY=$(( $# == 0 ))
for arg in "$@"; do [[ "$arg" == *template-image* ]] && WANT_REGISTRY=1; done
[[ -z "${EMBER_TEST_CMD:-}" ]] || WANT_REGISTRY=0 # the Python tests pull no test image
if [[ "$WANT_REGISTRY" != 1 ]]; then
  :
elif start_registry; then
  export E2B_TEST_REGISTRY="$REGISTRY_ADDR"
  export EMBER_INSECURE_REGISTRIES="${EMBER_INSECURE_REGISTRIES:+$EMBER_INSECURE_REGISTRIES,}$REGISTRY_ADDR"
  # A registry on loopback: refused unless the operator allows it (--registry-allow).
  export EMBER_REGISTRY_ALLOW="${EMBER_REGISTRY_ALLOW:+$EMBER_REGISTRY_ALLOW,}$REGISTRY_ADDR"
  log "local registry $REGISTRY_PID at $REGISTRY_ADDR (test/app:v1)"
else
  export E2B_TEST_REGISTRY_ERROR="$REGISTRY_ERR"
  log "no local registry: $REGISTRY_ERR"
fi

log "starting $EMBER_BIN serve --listen 127.0.0.1:$PORT --data-dir $EMBER_DATA_DIR ${TLS_FLAGS[*]}"
"$EMBER_BIN" serve --listen "127.0.0.1:$PORT" --data-dir "$EMBER_DATA_DIR" "${TLS_FLAGS[@]}" ${EMBER_SERVE_FLAGS:-} >"$DAEMON_LOG" 2>&1 &
DAEMON_PID=$!

# Ready = /health answers 200 (503 while the start-up templates build), and the API key file
# exists.
ready() {
  node -e '
    const ac = new AbortController(); setTimeout(() => ac.abort(), 2000).unref();
    fetch(process.argv[1], { signal: ac.signal }).then(r => r.arrayBuffer().then(() => process.exit(r.ok ? 0 : 1)), () => process.exit(1));
  ' "$BASE_URL/health" 2>/dev/null && [[ -s "$EMBER_DATA_DIR/api-key" ]]
}
deadline=$((SECONDS + READY_TIMEOUT))
until ready; do
  kill -0 "$DAEMON_PID" 2>/dev/null || { wait "$DAEMON_PID"; die "daemon exited (status $?) before it was ready"; }
  (( SECONDS < deadline )) || die "daemon not ready at $BASE_URL (or no $EMBER_DATA_DIR/api-key) after ${READY_TIMEOUT}s"
  sleep 0.5
done
log "daemon $DAEMON_PID ready at $BASE_URL"

E2B_API_KEY="$(tr -d '[:space:]' <"$EMBER_DATA_DIR/api-key")"
export E2B_API_KEY
export E2B_API_URL="$BASE_URL"
export E2B_SANDBOX_URL="$BASE_URL"
export E2B_DOMAIN="${E2B_DOMAIN:-ember.local}"
unset E2B_DEBUG E2B_ACCESS_TOKEN
if [[ "$MODEB" == 1 ]]; then
  CA_FILE="$EMBER_DATA_DIR/tls/ca.pem"
  [[ -s "$CA_FILE" ]] || die "Mode B: the daemon wrote no $CA_FILE"
  export EMBER_SDK_MODEB=1 EMBER_TEST_DOMAIN="$TEST_DOMAIN" E2B_DOMAIN="$TEST_DOMAIN"
  export NODE_EXTRA_CA_CERTS="$CA_FILE" EMBER_CA_FILE="$CA_FILE"
  export NODE_OPTIONS="${NODE_OPTIONS:+$NODE_OPTIONS }--require $SDK_DIR/test/resolver.cjs"
  log "Mode B: https://127.0.0.1:$TLS_PORT, domain $TEST_DOMAIN, CA $CA_FILE"
fi

cd "$SDK_DIR" || die "cd $SDK_DIR"
# In the background + wait, so that SIGINT/SIGTERM reach the trap at once.
if [[ -n "${EMBER_TEST_CMD:-}" ]]; then
  bash -c "$EMBER_TEST_CMD" ember-test "$@" &
else
  if [[ $# -gt 0 ]]; then
    args=("$@")
  else
    args=(test/*.test.mjs)
  fi
  node --test --test-concurrency=1 "${args[@]}" &
fi
TEST_PID=$!
wait "$TEST_PID"
STATUS=$?
TEST_PID=""
exit "$STATUS"
