# ember — two commands matter: `make run` (set up everything, serve with the base template) and
# `make test` (every test and linter; what CI runs). Both must be run as root.
SHELL := /bin/bash
export PATH := $(PATH):/usr/local/go/bin:$(CURDIR)/.cache/bin
GO ?= go
DATA_DIR ?= $(CURDIR)/data
LISTEN ?= 127.0.0.1:3000
# Pinned versions (STATICCHECK_VERSION, ...): one place, shared with scripts/setup.sh.
include scripts/versions.env
FUZZTIME ?= 20s

.PHONY: setup build run test lint unit fuzz e2e sdk python sdk-python bench bench-basic proto check-protos clean

setup:
	bash scripts/setup.sh

build:
	mkdir -p bin
	CGO_ENABLED=0 $(GO) build -o bin/envd ./cmd/envd
	$(GO) build -o bin/ember ./cmd/ember

# One command: set up, build the `base` template on first start, serve the E2B API on $(LISTEN).
run: setup
	bin/ember serve --listen $(LISTEN) --data-dir $(DATA_DIR) --cache-dir $(CURDIR)/.cache --templates base

# Every test: linters, Go tests (real runsc, netns, S3 server), a short fuzz run, the SDK suite.
test: setup lint
	EMBER_REQUIRE_ALL=1 EMBER_CACHE_DIR=$(CURDIR)/.cache $(GO) test -p 1 -count=1 -timeout 40m ./...
	$(GO) test -count=1 -tags ember_runsc ./tools/runscmem/
	$(MAKE) fuzz
	EMBER_REQUIRE_ALL=1 $(MAKE) sdk

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	@[ -x .cache/bin/staticcheck ] || GOBIN=$(CURDIR)/.cache/bin $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)
	.cache/bin/staticcheck ./...
	$(GO) vet -tags ember_runsc ./tools/runscmem/
	.cache/bin/staticcheck -tags ember_runsc ./tools/runscmem/
	bash scripts/gen-proto.sh --check

fuzz:
	$(GO) test -run '^$$' -fuzz FuzzControlPlaneDecode -fuzztime $(FUZZTIME) ./internal/api

# The SDK suite runs on the default configuration (warm pool on), then Mode B (TLS, host
# routing), then its create and lifecycle files once more with the pool off (every create
# restores the template's checkpoint). The three daemons share one data directory, so the base
# template is built once and each start adopts what the one before left. EMBER_RUNSC_LOGS=1: a
# sandbox that fails to start or restore keeps its sandbox's log too (<data-dir>/logs/failed).
SDK_ENV = EMBER_SDK_LIFECYCLE=1 EMBER_RUNSC_LOGS=1 EMBER_READY_TIMEOUT=900 EMBER_BIN=$(CURDIR)/bin/ember EMBER_CACHE_DIR=$(CURDIR)/.cache
sdk: build
	@d=$$(mktemp -d /tmp/ember-sdk-data.XXXXXX); st=0; \
	$(SDK_ENV) EMBER_DATA_DIR=$$d EMBER_SERVE_FLAGS="--templates base,code-interpreter-v1" bash test/sdk/run.sh || st=$$?; \
	[ $$st -ne 0 ] || $(SDK_ENV) EMBER_DATA_DIR=$$d EMBER_SDK_MODEB=1 bash test/sdk/run.sh test/5-modeb.test.mjs || st=$$?; \
	[ $$st -ne 0 ] || $(SDK_ENV) EMBER_DATA_DIR=$$d EMBER_SERVE_FLAGS="--pool-size 0" bash test/sdk/run.sh test/1-sandbox.test.mjs test/4-lifecycle.test.mjs || st=$$?; \
	[ $$st -ne 0 ] || $(SDK_ENV) EMBER_DATA_DIR=$$d bash test/python/run.sh || st=$$?; \
	bash scripts/remove-data-dir.sh $$d; exit $$st

# ember's own Python tests alone (E2B's Python SDK against a real daemon; also part of `sdk`).
# PY_DATA_DIR keeps a data dir (and its base template) between runs.
python: build
	@d=$${PY_DATA_DIR:-$$(mktemp -d /tmp/ember-py-data.XXXXXX)}; st=0; \
	$(SDK_ENV) EMBER_DATA_DIR=$$d bash test/python/run.sh || st=$$?; \
	[ -n "$(PY_DATA_DIR)" ] || { bash scripts/remove-data-dir.sh $$d; }; exit $$st

# E2B's Python SDK suite (2.34.0, from ../shared/e2b-python: its README.txt) against a daemon in
# Mode B (TLS, host routing), volume tests on (ENABLE_VOLUME_TESTS=0 skips them). Results (summary.txt with
# pass/fail counts and each failure's first line) in $(PY_OUT) (default: a temp dir, named at
# the end). Not part of `make test`: it takes about half an hour.
sdk-python: build
	@d=$${PY_DATA_DIR:-$$(mktemp -d /tmp/ember-py-data.XXXXXX)}; st=0; \
	$(SDK_ENV) EMBER_DATA_DIR=$$d OUT_DIR=$(PY_OUT) bash test/python/run.sh --e2b-suite || st=$$?; \
	[ -n "$(PY_DATA_DIR)" ] || { bash scripts/remove-data-dir.sh $$d; }; exit $$st

bench-basic: build
	EMBER_CACHE_DIR=$(CURDIR)/.cache $(GO) test -run '^$$' -bench 'BenchmarkBasic' -benchtime 1x -timeout 30m ./bench/

bench: build
	EMBER_CACHE_DIR=$(CURDIR)/.cache $(GO) test -run '^$$' -bench . -benchtime 1x -timeout 180m ./bench/

proto:
	bash scripts/gen-proto.sh

clean:
	rm -rf bin
