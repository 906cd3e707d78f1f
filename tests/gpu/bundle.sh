#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
# Prepares what tests/gpu/run.sh needs on the GPU machine that a git checkout lacks: the generated
# protobuf modules (`make proto`) and, in .whl/, pure-Python wheels of the packages that machine
# does not have (grpcio-health-checking, grpcio-reflection, and protobuf at least as new as the
# generated code), at the versions this venv uses. Then carry .whl and
# client/kvstored_client/_gen/kvstored/v1 to that machine with the repository.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}

make proto >/dev/null
pins=$("$PY" -c 'from importlib.metadata import version as v
print(" ".join(f"{p}=={v(p)}" for p in ("grpcio-health-checking", "grpcio-reflection", "protobuf")))')
rm -rf .whl && mkdir .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --implementation py --abi none --platform any \
    --python-version 3.12 -d .whl $pins
ls -1 .whl
