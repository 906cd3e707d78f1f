#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
# GPU check of the direct spec's data path (not part of CI): starts kvstored, stores CUDA KV blocks
# into its pool (pinned with cudaHostRegister) and loads them back through the direct spec's
# worker copy path, checks byte equality, prints GPU->shm / shm->GPU GiB/s beside plain
# pinned-memory cudaMemcpy. Needs one CUDA GPU and no vLLM. Takes about a minute (bounded at 280 s).
#
#   tests/gpu/run.sh [gpu_check.py options]        PYTHON=python3.12 to pick the interpreter
#   tests/gpu/run.sh --device cpu --layers 4 --blocks 64   (dry run of the same path, no GPU)
#
# Needs on that machine: torch (CUDA), numpy, grpcio, protobuf >= 7.35.1 (the generated code's
# version), uvloop, prometheus-client, grpcio-health-checking, grpcio-reflection, and the
# generated protobuf modules (client/kvstored_client/_gen/kvstored/v1/*_pb2*.py, made by
# `make setup`; git ignores them, so carry them). Missing Python packages can travel as wheels in
# .whl/ at the repository root: they are installed into a temporary directory first.
# tests/gpu/bundle.sh prepares both (run it where PyPI is reachable).
set -euo pipefail

cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

if [ -d .whl ] && compgen -G ".whl/*.whl" >/dev/null; then
    site=$(mktemp -d /tmp/kvstored-gpu-site.XXXXXX)
    trap 'rm -rf "$site"' EXIT
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD:$PWD/client${PYTHONPATH:+:$PYTHONPATH}"

# Preflight: say exactly what is missing instead of failing half-way.
"$PY" - <<'EOF'
import importlib, sys

missing = []
for module, package in [("torch", "torch"), ("numpy", "numpy"), ("grpc", "grpcio"), ("google.protobuf", "protobuf"),
                        ("uvloop", "uvloop"), ("prometheus_client", "prometheus-client"),
                        ("grpc_health.v1", "grpcio-health-checking"), ("grpc_reflection.v1alpha", "grpcio-reflection")]:
    try:
        importlib.import_module(module)
    except ImportError:
        missing.append(package)
if missing:
    sys.exit(f"gpu check: missing Python packages {missing}: put their wheels in .whl/ (see the device README)")
try:
    from kvstored_client._gen.kvstored.v1 import kvstored_pb2  # noqa: F401
except ImportError as exc:
    sys.exit(f"gpu check: generated protobuf code missing ({exc}): carry client/kvstored_client/_gen/kvstored/v1")
except Exception as exc:  # protobuf runtime older than the generated code
    import google.protobuf

    sys.exit(f"gpu check: protobuf {google.protobuf.__version__} cannot load the generated code ({exc}): "
             "carry a protobuf>=7.35.1 wheel in .whl/")
EOF

timeout 280 "$PY" tests/gpu/gpu_check.py "$@"
