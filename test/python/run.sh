#!/usr/bin/env bash
# Runs Python against a real ember daemon that test/sdk/run.sh starts and stops (same
# environment: E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY; Mode B with TLS when EMBER_SDK_MODEB=1).
#
#   test/python/run.sh                 ember's own Python tests (test/python/test_*.py)
#   test/python/run.sh --e2b-suite     E2B's Python SDK suite (its README: <kit>/README.txt),
#                                      in Mode B, volume tests on; results in $OUT_DIR
#
# The SDK: `import e2b` when the interpreter has it, else the kit (E2B's SDK 2.34.0 with its
# test suite and the pure-Python packages it needs) at $E2B_PYTHON_KIT (default
# <repo>/../shared/e2b-python, or <repo>/../../shared/e2b-python for a worktree).
# The other variables are test/sdk/run.sh's (EMBER_BIN, EMBER_DATA_DIR, EMBER_SERVE_FLAGS, ...).
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$HERE/../.." && pwd)"

if [[ "${1:-}" == --inner ]]; then
  # Inside test/sdk/run.sh: the daemon runs, E2B_* are set.
  shift
  mode="$1"
  shift
  KIT="${E2B_PYTHON_KIT:-}"
  for k in "$REPO_ROOT/../shared/e2b-python" "$REPO_ROOT/../../shared/e2b-python"; do
    [[ -n "$KIT" ]] || { [[ -f "$k/env.sh" ]] && KIT="$(cd "$k" && pwd)"; }
  done
  if [[ "${EMBER_SDK_MODEB:-0}" == 1 ]]; then
    # The SDK's httpx trusts the daemon's CA; names under the test domain resolve to loopback
    # in the test process only (the kit's e2b_resolver; *.localhost needs none).
    # The kit's e2b_netguard allows names under E2B_DOMAIN only when it has no port: allow them.
    export SSL_CERT_FILE="$EMBER_CA_FILE" E2B_RESOLVE_DOMAIN="${EMBER_TEST_DOMAIN%%:*}"
    [[ "$EMBER_TEST_DOMAIN" == *.localhost* ]] || export E2B_NET_ALLOW="${E2B_NET_ALLOW:+$E2B_NET_ALLOW,}.${EMBER_TEST_DOMAIN%%:*}"
  fi
  case "$mode" in
    own)
      PY=python3
      if ! python3 -c 'import e2b' 2>/dev/null; then
        [[ -n "$KIT" ]] || { echo "python: no 'import e2b' and no E2B Python kit (set E2B_PYTHON_KIT)" >&2; exit 1; }
        # shellcheck disable=SC1091
        . "$KIT/env.sh"
      fi
      status=0
      for f in "$HERE"/test_*.py; do
        "$PY" "$f" "$@" || status=1
      done
      exit "$status"
      ;;
    e2b)
      [[ -n "$KIT" ]] || { echo "python: no E2B Python kit (set E2B_PYTHON_KIT)" >&2; exit 1; }
      export OUT_DIR="${OUT_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/e2b-python.XXXXXX")}"
      # Volumes are served: their tests run (ENABLE_VOLUME_TESTS=0 skips them, as upstream's do).
      export ENABLE_VOLUME_TESTS="${ENABLE_VOLUME_TESTS:-1}"
      "$KIT/run.sh" "$@"
      status=$?
      echo "python: E2B suite summary: $OUT_DIR/summary.txt"
      tail -n 1 "$OUT_DIR/summary.txt" 2>/dev/null
      exit "$status"
      ;;
  esac
  exit 2
fi

mode=own
if [[ "${1:-}" == --e2b-suite ]]; then
  mode=e2b
  shift
  # *.localhost: the kit's netguard resolves those names to loopback in every test process
  # (xdist workers and asyncio included).
  export EMBER_SDK_MODEB=1 EMBER_SDK_TEST_DOMAIN="${EMBER_SDK_TEST_DOMAIN:-ember.localhost}"
fi
export EMBER_TEST_CMD="bash '$HERE/run.sh' --inner $mode \"\$@\""
exec bash "$REPO_ROOT/test/sdk/run.sh" "$@"
