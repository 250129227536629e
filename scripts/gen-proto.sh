#!/usr/bin/env bash
# Regenerates the Go code of envd's Connect services (api/gen/) from api/proto/.
#
#   scripts/gen-proto.sh           regenerate api/gen in place
#   scripts/gen-proto.sh --check   fail if regenerating would change anything in api/gen
#
# Generators are pinned: protoc-gen-go and protoc-gen-connect-go are built with `go install` into
# .cache/bin; protoc comes from Debian's protobuf-compiler (bookworm: 3.21.12), installed with
# apt-get when missing. The protoc version is written into the generated headers, so --check
# needs the same Debian suite.
set -euo pipefail

PROTOC_GEN_GO_VERSION=v1.36.12       # google.golang.org/protobuf, same as go.mod
PROTOC_GEN_CONNECT_GO_VERSION=v1.21.1 # connectrpc.com/connect, same as go.mod
PROTOC_WANT="libprotoc 3.21.12"

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export PATH="$root/.cache/bin:$PATH:/usr/local/go/bin"

check=0
case "${1:-}" in
  --check) check=1 ;;
  "") ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

bin="$root/.cache/bin"
mkdir -p "$bin"

install_go_tool() { # name module version
  local name=$1 mod=$2 ver=$3 stamp="$bin/.$1.version"
  if [[ -x "$bin/$name" && "$(cat "$stamp" 2>/dev/null)" == "$ver" ]]; then return; fi
  echo "installing $name $ver" >&2
  GOBIN="$bin" go install "$mod@$ver"
  echo "$ver" >"$stamp"
}
install_go_tool protoc-gen-go google.golang.org/protobuf/cmd/protoc-gen-go "$PROTOC_GEN_GO_VERSION"
install_go_tool protoc-gen-connect-go connectrpc.com/connect/cmd/protoc-gen-connect-go "$PROTOC_GEN_CONNECT_GO_VERSION"

if ! command -v protoc >/dev/null || [[ ! -f /usr/include/google/protobuf/timestamp.proto ]]; then
  echo "installing protoc (Debian protobuf-compiler, libprotobuf-dev)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq protobuf-compiler libprotobuf-dev >/dev/null ||
    { apt-get update -qq >/dev/null && apt-get install -y -qq protobuf-compiler libprotobuf-dev >/dev/null; }
fi
if [[ "$(protoc --version)" != "$PROTOC_WANT" ]]; then
  echo "warning: $(protoc --version) found, generated headers expect $PROTOC_WANT" >&2
fi

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

protoc \
  --proto_path=api/proto \
  --proto_path=/usr/include \
  --plugin=protoc-gen-go="$bin/protoc-gen-go" \
  --plugin=protoc-gen-connect-go="$bin/protoc-gen-connect-go" \
  --go_out="$out" --go_opt=module=github.com/ember-sandbox/ember \
  --connect-go_out="$out" --connect-go_opt=module=github.com/ember-sandbox/ember \
  process/process.proto filesystem/filesystem.proto

if [[ $check == 1 ]]; then
  if ! diff -r "$out/api/gen" api/gen; then
    echo "api/gen is out of date: run scripts/gen-proto.sh" >&2
    exit 1
  fi
  echo "api/gen is up to date"
  exit 0
fi

rm -rf api/gen
mkdir -p api
cp -r "$out/api/gen" api/gen
echo "generated api/gen"
