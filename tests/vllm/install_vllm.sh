#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
# Install vllm==0.33.0 into the project venv for the vLLM integration tests, on a CPU machine.
#
# vLLM's own requirements pull torch 2.14 with CUDA (gigabytes) and GPU kernels. The tests only
# need vLLM's Python KV-offload code, so vllm goes in with --no-deps, followed by exactly the
# packages that code imports (kv_offload.*, tiering.*, the offloading connector's events and
# metrics, distributed.kv_events, plugins). torch stays at 2.13.0 (CPU): every install below is
# constrained to it. The only symptom of the torch mismatch is a log line about vllm._C.
#
# Idempotent, and fast when everything is there (checks metadata, imports nothing).
#   usage: tests/vllm/install_vllm.sh            (VENV=path to use another venv; default .venv)
set -euo pipefail

cd "$(dirname "$0")/../.."
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)
[ -x "$PY" ] || { echo "install_vllm.sh: no venv at $VENV (run 'make setup' first)" >&2; exit 1; }

# Modules the packages installed below provide (import names).
MODULES="msgspec psutil cbor2 zmq regex pydantic aiohttp requests cachetools cloudpickle cpuinfo pybase64
partial_json_parser PIL openai openai_harmony fastapi transformers xgrammar tvm_ffi llguidance"

ready() {  # versions and module presence, without importing vllm (that takes seconds)
    "$PY" -c '
import importlib.metadata as md, importlib.util, sys
ok = md.version("vllm") == "0.33.0" and md.version("torch").split("+")[0] == "2.13.0"
sys.exit(0 if ok and all(importlib.util.find_spec(m) for m in sys.argv[1].split()) else 1)
' "$MODULES" 2>/dev/null
}

imports() {  # the real test: what the integration and its tests import
    "$PY" -c 'import vllm.v1.kv_offload.tiering.spec, vllm.v1.kv_offload.tiering.fs.manager, vllm.plugins
import vllm.distributed.kv_events, vllm.distributed.kv_transfer.kv_connector.v1.offloading.events'
}

if ready; then
    echo "vllm 0.33.0 is installed in $VENV"
    exit 0
fi

constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==2.13.0" >"$constraints"

"${PIP[@]}" --no-deps "vllm==0.33.0"
# What vllm's kv_offload / tiering / kv_events / plugin modules import, directly or through
# vllm.config, vllm.envs and vllm.entrypoints (which vllm.config reaches).
"${PIP[@]}" -c "$constraints" \
    msgspec psutil cbor2 pyzmq regex pydantic aiohttp requests cachetools cloudpickle py-cpuinfo \
    pybase64 partial_json_parser "pillow>=13" "openai>=2.25.0" "oss-harmony>=0.0.11" \
    "fastapi>=0.133,<0.137" "transformers>=5.16.1,<5.21.0"
# Imported at module level on the same paths (structured output); their own requirements are
# CUDA builds that importing them does not need.
"${PIP[@]}" --no-deps "xgrammar==0.2.8" "apache-tvm-ffi==0.1.11" "llguidance>=1.7,<1.8"

if ! ready || ! imports; then
    echo "install_vllm.sh: vllm 0.33.0 still does not import (see above)" >&2
    exit 1
fi
echo "vllm 0.33.0 installed in $VENV"
