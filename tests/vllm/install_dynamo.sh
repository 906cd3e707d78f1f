#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
# Install Dynamo's router (ai-dynamo-runtime 1.6.1) into its own venv for the router tests.
#
# The wheel's Rust core (dynamo._core: the standalone KV indexer, KvRouter, RadixTree) imports
# and runs on CPU without etcd or NATS; --no-deps keeps its Python dependencies (CUDA, pydantic
# ...) out. Its own venv keeps it apart from vLLM's pins. Idempotent.
#   usage: tests/vllm/install_dynamo.sh    (VENV=the project venv; the router's goes under it)
set -euo pipefail

cd "$(dirname "$0")/../.."
VENV=${VENV:-.venv}
DYN="$VENV/dynamo-1.6.1"
PY="$DYN/bin/python"

if [ -x "$PY" ] && "$PY" -c 'import dynamo._core' 2>/dev/null; then
    echo "ai-dynamo-runtime 1.6.1 is installed in $DYN"
    exit 0
fi
python3 -m venv "$DYN"
"$PY" -m pip install -q --disable-pip-version-check --no-deps "ai-dynamo-runtime==1.6.1"
"$PY" -c 'import dynamo._core' || { echo "install_dynamo.sh: dynamo._core does not import" >&2; exit 1; }
echo "ai-dynamo-runtime 1.6.1 installed in $DYN"
