#!/usr/bin/env bash
# ember's set-up, idempotent: the Debian packages ember needs, runsc built from the pinned
# gvisor.dev/gvisor module, the S3 server used by the snapshot-store tests, the SDK suite's npm
# packages, and ember's own binaries. Everything lands in the repo's ignored .cache/ and bin/.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=versions.env
source scripts/versions.env
export PATH="$PATH:/usr/local/go/bin"
command -v go >/dev/null || { echo "setup: Go is not installed (expected /usr/local/go/bin/go)"; exit 1; }

if [ "$(id -u)" -ne 0 ]; then
	echo "setup: run as root (apt-get, network namespaces and runsc need it)"; exit 1
fi

pkgs=(debootstrap nftables iproute2 runc busybox-static ca-certificates tar btrfs-progs xfsprogs protobuf-compiler libprotobuf-dev tmux)
# What E2B's Python SDK kit (../shared/e2b-python, README.txt) needs from Debian: the Python tests
# (test/python, `make sdk`, `make sdk-python`) run the SDK with them.
pkgs+=(python3-httpx python3-httpcore python3-h2 python3-attr python3-dateutil python3-packaging
	python3-typing-extensions python3-wcmatch python3-rich python3-protobuf python3-pytest
	python3-pytest-asyncio python3-pytest-xdist python3-dotenv python3-pytest-timeout python3-socksio)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ "${#missing[@]}" -gt 0 ]; then
	echo "setup: installing Debian packages: ${missing[*]}"
	apt-get update -q
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
fi
# Volumes in a cluster: each node mounts the cluster's S3 bucket with s3fs-fuse
# (internal/volume/shared.go), Debian's package pinned to S3FS_VERSION (versions.env): installed,
# or moved to that version (up or down), when dpkg has another one.
if [ "$(dpkg-query -W -f '${Status} ${Version}' s3fs 2>/dev/null)" != "install ok installed $S3FS_VERSION" ]; then
	echo "setup: installing s3fs=$S3FS_VERSION"
	[ "${#missing[@]}" -gt 0 ] || apt-get update -q
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --allow-downgrades "s3fs=$S3FS_VERSION"
fi
[ "$(dpkg-query -W -f '${Version}' s3fs)" = "$S3FS_VERSION" ] || { echo "setup: s3fs is not at $S3FS_VERSION"; exit 1; }

mkdir -p .cache/bin
# runsc is built from the pinned gvisor.dev/gvisor module with seccomp programs precompiled by
# ember's tools/seccompgen (without them runsc compiles its filters at every start and restore).
# The generator is linked against the same gvisor version (go.mod; it checks) and built with
# runsc's GOARCH and CGO_ENABLED=0. The go command refuses overlays of module-cache files, so the
# build runs in a copy of the module's source with the generated files overlaid on its stubs.
# The overlay also adds one file of ember's own to runsc's package main (tools/runscmem, build tag
# ember_runsc): the sentry and gofer set their Go GC from the bundle's annotations at start.
# Rebuilt when the version, the build flags, the generator, the added file, the modules the
# generator links or the Go toolchain change.
runsc_flags=(-trimpath -tags ember_runsc -ldflags "-s -w -X gvisor.dev/gvisor/runsc/version.version=${RUNSC_VERSION##*-}")
runsc_stamp="$RUNSC_VERSION ${runsc_flags[*]} seccompgen=$({ cat tools/seccompgen/*.go tools/runscmem/ember_memory.go; go list -deps -f '{{with .Module}}{{.Path}}@{{.Version}}{{end}}' ./tools/seccompgen | sort -u; } | sha256sum | cut -c1-16) $(go env GOVERSION)"
if [ "$(cat .cache/bin/runsc.version 2>/dev/null)" != "$runsc_stamp" ] || [ ! -x .cache/bin/runsc ]; then
	echo "setup: building runsc $RUNSC_VERSION with precompiled seccomp filters (about 3-5 minutes)"
	src=$(go mod download -json "${RUNSC_MODULE%/runsc}@$RUNSC_VERSION" | grep '"Dir":' | cut -d'"' -f4)
	[ -d "$src" ] || { echo "setup: ${RUNSC_MODULE%/runsc}@$RUNSC_VERSION: no module source"; exit 1; }
	rm -rf .cache/src/gvisor .cache/seccomp
	mkdir -p .cache/src
	cp -r "$src" .cache/src/gvisor
	chmod -R u+w .cache/src/gvisor
	CGO_ENABLED=0 go build -o .cache/bin/seccompgen ./tools/seccompgen
	.cache/bin/seccompgen -gvisor-dir .cache/src/gvisor -gvisor-version "$RUNSC_VERSION" -out .cache/seccomp \
		-add runsc/ember_memory.go=tools/runscmem/ember_memory.go
	(cd .cache/src/gvisor && CGO_ENABLED=0 go build -overlay "$OLDPWD/.cache/seccomp/overlay.json" "${runsc_flags[@]}" \
		-o "$OLDPWD/.cache/bin/runsc" ./runsc)
	echo "$runsc_stamp" > .cache/bin/runsc.version
fi
# Check that runsc really runs a sandbox here (systrap platform, no KVM needed) and loads its
# precompiled seccomp program rather than compiling one.
check=$(mktemp -d /tmp/ember-setup-check.XXXXXX)
if ! out=$(timeout 60 .cache/bin/runsc --root "$check/root" --platform=systrap --network=none --ignore-cgroups --debug --debug-log="$check/" do /bin/echo runsc-ok 2>&1) || [[ "$out" != *runsc-ok* ]]; then
	echo "setup: runsc does not run here: $out"; rm -rf "$check"; exit 1
fi
if ! grep -q "Loaded precompiled seccomp instructions" "$check"/*.boot.txt; then
	echo "setup: runsc compiled its seccomp filters instead of loading precompiled ones:"
	grep -h "precompiled" "$check"/*.boot.txt | head -3
	rm -rf "$check"; exit 1
fi
rm -rf "$check"
if ! go version -m .cache/bin/runsc | grep -q -- '-tags=ember_runsc'; then
	echo "setup: .cache/bin/runsc was built without ember's addition (tools/runscmem)"; exit 1
fi
echo "setup: $(.cache/bin/runsc --version | head -1) works"

if [ -f scripts/setup-s3.sh ]; then bash scripts/setup-s3.sh; fi

# etcd (cluster mode): a plain `go install go.etcd.io/etcd/server/v3@V` refuses (its go.mod has
# replace directives), so a three-line wrapper module around etcd's own main builds it.
if [ "$(cat .cache/bin/etcd.version 2>/dev/null)" != "$ETCD_VERSION" ] || [ ! -x .cache/bin/etcd ]; then
	grep -q "go.etcd.io/etcd/server/v3 $ETCD_VERSION\$" scripts/etcd/go.mod || { echo "setup: scripts/etcd/go.mod does not pin etcd $ETCD_VERSION"; exit 1; }
	echo "setup: building etcd $ETCD_VERSION from the Go module proxy (about 1-2 minutes)"
	(cd scripts/etcd && CGO_ENABLED=0 GOFLAGS=-mod=readonly go build -trimpath -ldflags "-s -w" -o ../../.cache/bin/etcd.tmp .)
	mv .cache/bin/etcd.tmp .cache/bin/etcd
	echo "$ETCD_VERSION" > .cache/bin/etcd.version
fi
echo "setup: $(.cache/bin/etcd --version | head -1)"

# The linter `make lint` runs, built from its module at the pinned version.
if [ "$(cat .cache/bin/staticcheck.version 2>/dev/null)" != "$STATICCHECK_VERSION" ] || [ ! -x .cache/bin/staticcheck ]; then
	echo "setup: building staticcheck $STATICCHECK_VERSION"
	GOBIN="$PWD/.cache/bin" go install "honnef.co/go/tools/cmd/staticcheck@$STATICCHECK_VERSION"
	echo "$STATICCHECK_VERSION" > .cache/bin/staticcheck.version
fi

# Installed again whenever the lockfile changed (a checkout that had the SDK suite's packages
# before a new one was pinned, such as @e2b/code-interpreter).
if [ -f test/sdk/package-lock.json ]; then
	lock_sum=$(sha256sum test/sdk/package-lock.json | cut -c1-16)
	if [ ! -d test/sdk/node_modules/e2b ] || [ "$(cat test/sdk/node_modules/.ember-lock 2>/dev/null)" != "$lock_sum" ]; then
		echo "setup: npm ci (test/sdk)"
		(cd test/sdk && npm ci --no-audit --no-fund --loglevel=error)
		echo "$lock_sum" > test/sdk/node_modules/.ember-lock
	fi
fi

mkdir -p bin
CGO_ENABLED=0 go build -o bin/envd ./cmd/envd
go build -o bin/ember ./cmd/ember
echo "setup: built bin/ember and bin/envd"
