# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Dynamo 1.6.1's deployment path, run in Dynamo's own venv (install_dynamo.sh): a worker that
relays a kvstored daemon's ZMQ stream with KvEventPublisher(zmq_endpoint=...), and a KvRouter
over the same in-memory discovery and ZMQ event plane answering get_overlap_scores.

Line protocol on stdin/stdout (JSON): it prints {"ready": worker_id} once serving, then answers
each line {"token_ids": [...]} with the router's get_overlap_scores result.
    usage: python dynamo_kvrouter.py ZMQ_ENDPOINT MODEL BLOCK_SIZE
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from dynamo._core import (
    DistributedRuntime,
    KvEventPublisher,
    KvRouter,
    KvRouterConfig,
    ModelInput,
    ModelType,
    WorkerType,
    register_model,
)


async def _generate(request: Any, context: Any = None) -> Any:  # routing only: nothing generates
    yield {"token_ids": [], "finish_reason": "stop"}


async def main(zmq_endpoint: str, model: str, block_size: int) -> None:
    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, "mem", "tcp", event_plane="zmq")
    endpoint = runtime.endpoint("kvstored.worker.generate")
    serving = asyncio.ensure_future(endpoint.serve_endpoint(_generate))  # a Rust future
    await register_model(
        ModelInput.Tokens,
        ModelType.Chat | ModelType.Completions,
        endpoint,
        model,
        model,
        worker_type=WorkerType.Aggregated,
        kv_cache_block_size=block_size,
        skip_model_assets=True,
    )
    publisher = KvEventPublisher(endpoint, kv_block_size=block_size, zmq_endpoint=zmq_endpoint)
    router = KvRouter(endpoint, block_size, KvRouterConfig())
    client = await endpoint.client()
    workers = await client.wait_for_instances()
    print(json.dumps({"ready": workers}), flush=True)
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            scores = await router.get_overlap_scores(json.loads(line)["token_ids"], include_shared=False)
            print(json.dumps(scores, default=str), flush=True)
    finally:
        publisher.shutdown()
        serving.cancel()
        runtime.shutdown()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
