#!/usr/bin/env bash
# Installs the S3-compatible server that ember's S3 snapshot tests run against: the Versity S3
# Gateway (versitygw, posix backend: objects are plain files in a directory), built from its Go
# module at a pinned version into <repo>/.cache/bin. It is a tool binary, not a dependency of
# ember's go.mod. Idempotent: does nothing when the pinned version is already there.
# A cold build takes about 3.5 minutes on 2 cores (module download + compile); a warm one seconds.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=/dev/null
[ -f "$root/scripts/versions.env" ] && . "$root/scripts/versions.env"
VERSITYGW_MODULE=${VERSITYGW_MODULE:-github.com/versity/versitygw/cmd/versitygw}
VERSITYGW_VERSION=${VERSITYGW_VERSION:-v1.8.0}

export PATH=$PATH:/usr/local/go/bin
bindir="$root/.cache/bin"
bin="$bindir/versitygw"

if [ -x "$bin" ] && go version -m "$bin" 2>/dev/null | grep -Eq "^[[:space:]]+mod[[:space:]]+github.com/versity/versitygw[[:space:]]+$VERSITYGW_VERSION([[:space:]]|$)"; then
	echo "setup-s3: versitygw $VERSITYGW_VERSION already in $bindir"
	exit 0
fi

mkdir -p "$bindir"
echo "setup-s3: installing $VERSITYGW_MODULE@$VERSITYGW_VERSION into $bindir"
start=$(date +%s)
# Outside the repo, so ember's go.mod and go.sum are neither read nor touched.
(cd / && GOBIN="$bindir" GOFLAGS= go install "$VERSITYGW_MODULE@$VERSITYGW_VERSION")
echo "setup-s3: done in $(($(date +%s) - start))s"
