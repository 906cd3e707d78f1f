# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
# kvstored developer entry points. `make run` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUN_STAMP := $(VENV)/.installed-run
STAMP := $(VENV)/.installed
GEN := client/kvstored_client/_gen/kvstored/v1
PROTOS := $(wildcard proto/kvstored/v1/*.proto)
# The daemon of `make run`: RAM tier + an fs tier under ./var (ignored by git). RUN_ARGS adds to
# these (a later --socket wins, another --tiers adds a tier); RUN_DEFAULT_ARGS= drops them.
RUN_DEFAULT_ARGS ?= --socket var/kvstored.sock --tiers kind=fs,root=var/fs,bytes=20GiB
RUN_ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup proto run test test-fast lint format bench system-deps vllm-deps clean

setup: $(STAMP) $(GEN)/kvstored_pb2.py

# The daemon alone (what `make run` needs) and the tools to look at it (kvstoredctl, grpcurl): no
# torch, no test tools; building the client generates the protobuf modules.
$(RUN_STAMP): pyproject.toml client/pyproject.toml client/setup.py setup.py kvstored/shm/_safecopy.c kvstored/peer/_rxframe.c client/kvstored_client/_ntcopy.c client/kvstored_client/_keyindex.c $(PROTOS)
	@test -x $(BIN)/python || $(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { \
		echo "kvstored needs Python >= 3.11; $(PYTHON) is $$($(PYTHON) -V 2>&1). On Ubuntu 22.04:" \
			"sudo add-apt-repository ppa:deadsnakes/ppa && sudo apt-get install python3.11 python3.11-venv" \
			"python3.11-dev, or uv python install 3.11; then: make $(MAKECMDGOALS) PYTHON=python3.11" >&2; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e ./client -e '.[tools]'
	touch $@

# Tests and benchmarks: torch first and pinned (an unpinned torch pulls a multi-GB CUDA build).
$(STAMP): $(RUN_STAMP)
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -e ./client -e '.[dev]'
	touch $@

proto $(GEN)/kvstored_pb2.py: $(PROTOS) | $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Ikvstored_client/_gen=proto \
		--python_out=client --pyi_out=client --grpc_python_out=client \
		$(patsubst proto/%,kvstored_client/_gen/%,$(PROTOS))

run: $(RUN_STAMP)
	mkdir -p var/fs
	$(BIN)/kvstored serve $(RUN_DEFAULT_ARGS) $(RUN_ARGS)

# Static checks (pyproject.toml): ruff lint and format, mypy; the daemon, the client, bench and tests.
LINTED := kvstored client bench tests
lint: setup
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/mypy

# Rewrites the sources as `make lint` wants them (ruff's fixes and its formatter).
format: setup
	$(BIN)/ruff check --fix $(LINTED)
	$(BIN)/ruff format $(LINTED)

# Exit code 5 (no tests collected) is a failure, not a pass.
test: lint setup system-deps vllm-deps
	$(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

# What a laptop runs without root, radosgw, ucxx, vLLM, network namespaces or the Debian tools
# of system-deps (the markers are in pyproject.toml; tests/support/needs.py has the same list).
# No lint, no sudo; `make test` stays what CI runs.
FAST_MARKERS := not (root or radosgw or ucxx or vllm or netns or system_deps)
test-fast: setup
	$(BIN)/python -m pytest -m "$(FAST_MARKERS)" $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

system-deps:
	./deploy/install-system-deps.sh

# vllm==0.33.0 without its CUDA dependencies, for the integration tests, and Dynamo's router in
# a venv of its own for the router tests (see the scripts).
vllm-deps: setup
	VENV=$(VENV) ./tests/vllm/install_vllm.sh
	VENV=$(VENV) ./tests/vllm/install_dynamo.sh

# Benchmarks (not tests): figures beside same-run baselines; JSON and the chart under results/.
# About 20 minutes on a 2-core VM; e.g. BENCH_MULTITURN_ARGS="--conversations 16,64,128,256" for less.
BENCH_MULTITURN_ARGS ?=
# The multi-node sweep (3 daemons, turns routed round-robin): BENCH_NODES_ARGS adds to its flags.
BENCH_NODES_ARGS ?= --conversations 64,128,256
bench: setup system-deps
	./deploy/install-system-deps.sh libibverbs1
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev,bench]'
	mkdir -p results
	$(BIN)/python -m bench.local_path --json results/local_path.json
	$(BIN)/python -m bench.tiers --json results/tiers.json
	$(BIN)/python -m bench.compare --json results/compare.json
	$(BIN)/python -m bench.multiturn --json results/multiturn.json --plot results/multiturn.png $(BENCH_MULTITURN_ARGS)
	$(BIN)/python -m bench.multiturn --nodes 3 --json results/multiturn-nodes.json --plot results/multiturn-nodes.png \
		$(BENCH_NODES_ARGS)
	$(BIN)/python -m bench.peer --json results/peer.json

clean:
	rm -rf $(VENV) var results $(GEN)/*_pb2*.py $(GEN)/*_pb2*.pyi kvstored/shm/*.so build
