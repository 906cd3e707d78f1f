# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The non-blocking link and region hand-over the tier is built on (no vLLM objects needed)."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client.ops import NamespaceSpec
from kvstored_client.vllm.driver import DaemonLink, LinkState, outcome
from kvstored_client.vllm.region import RegionNotShareable, region_file
from tests.support.data import payload

CHUNK = 256 << 10


def test_region_without_a_path_reaches_the_daemon_as_an_fd(vllm_daemon):
    """A memfd has no path the daemon could open: only the fd sent over the session socket works."""
    fd = os.memfd_create("vllm-primary-stand-in")
    os.ftruncate(fd, 8 * CHUNK)
    mapping = mmap.mmap(fd, 8 * CHUNK)
    rows = np.frombuffer(mapping, dtype=np.uint8).reshape(8, CHUNK)
    view = memoryview(rows[2:])  # a view that starts inside the file
    with pytest.raises(RegionNotShareable):
        region_file(view)  # no path, no fd offered
    region = region_file(view, [fd])
    assert region.base_offset == 2 * CHUNK

    keys = [bytes([i]) * 36 for i in range(3)]
    for i, key in enumerate(keys):
        rows[2 + i] = payload(key, CHUNK)
    link = DaemonLink(vllm_daemon.socket, "test-driver", region_fd=region.fd, region_name="memfd")
    spec = NamespaceSpec(model="test/driver", dtype="uint8", chunk_bytes=CHUNK, layout="memfd", key_bytes=36)
    ns = link.namespace(spec)
    assert link.settle(10, (ns,))

    def transfer(method: str, offsets: list[int]):
        request = pb.RegionTransferRequest(
            session_id=link.session_id, namespace_id=ns, region_id=link.region_id, keys=keys, offsets=offsets
        )
        result = outcome(link.call(method, request, timeout=10))
        assert result.ok, result.error
        return result.response

    assert transfer("StoreFromRegion", [region.base_offset + i * CHUNK for i in range(3)]).stored == 3
    assert transfer("LoadToRegion", [region.base_offset + (3 + i) * CHUNK for i in range(3)]).loaded == 3
    for i, key in enumerate(keys):
        assert np.array_equal(rows[5 + i], payload(key, CHUNK))
    link.close()
    os.close(region.fd)
    del rows, view
    mapping.close()
    os.close(fd)


def test_unreachable_daemon_never_blocks_or_raises(tmp_path):
    link = DaemonLink(tmp_path / "nothing.sock", "test-driver")
    assert link.poll() is False
    assert link.state is LinkState.DOWN
    assert link.settle(5) is False  # returns at once: nothing is listening
    assert link.counters.failures >= 1


def test_entry_point_registers_the_tier_and_the_spec():
    """What vLLM does in every process: load_general_plugins() finds our entry point."""
    from importlib.metadata import entry_points

    import vllm.plugins
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    (ours,) = [ep for ep in entry_points(group=vllm.plugins.DEFAULT_PLUGINS_GROUP) if ep.name == "kvstored"]
    assert ours.value == "kvstored_client.vllm.plugin:register"
    vllm.plugins.plugins_loaded = False  # as in a fresh process
    vllm.plugins.load_general_plugins()
    ours.load()()  # a second load (vLLM may load plugins more than once) is harmless
    assert SecondaryTierFactory.get_tier_class({"type": "kvstored"}).__name__ == "KvstoredTierManager"
    assert (
        OffloadingSpecFactory.get_spec_cls({"spec_name": "KvstoredOffloadingSpec"}).__name__ == "KvstoredOffloadingSpec"
    )
