# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""chunk_keys / namespace_id_for: content-addressed, chained, stable across processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kvstored_client.keys import chunk_keys, namespace_id_for

CT = 16  # tokens per chunk
NS = namespace_id_for("meta-llama/Llama-3.1-8B-Instruct", "bfloat16", 2 << 20, "tp1-pp1-rank0")
TOKENS = list(np.random.default_rng(7).integers(0, 128_000, 5 * CT + 7))  # 5 full chunks + a partial


def test_one_32_byte_key_per_full_chunk():
    keys = chunk_keys(TOKENS, CT, NS)
    assert len(keys) == 5
    assert all(isinstance(k, bytes) and len(k) == 32 for k in keys)
    assert len(set(keys)) == 5


@pytest.mark.parametrize("n", [0, 1, CT - 1])
def test_less_than_one_chunk_gets_no_key(n):
    assert chunk_keys(TOKENS[:n], CT, NS) == []


def test_partial_trailing_chunk_gets_no_key():
    full = chunk_keys(TOKENS[: 5 * CT], CT, NS)
    assert chunk_keys(TOKENS, CT, NS) == full  # the 7 trailing tokens add nothing
    assert chunk_keys(TOKENS[: 5 * CT + CT - 1], CT, NS) == full
    assert chunk_keys(TOKENS[: 4 * CT + 1], CT, NS) == full[:4]


def test_same_tokens_same_namespace_same_keys_in_process():
    assert chunk_keys(TOKENS, CT, NS) == chunk_keys(list(TOKENS), CT, NS)
    # The container type and integer width do not matter, only the token values.
    assert chunk_keys(np.asarray(TOKENS, dtype=np.int32), CT, NS) == chunk_keys(TOKENS, CT, NS)
    assert chunk_keys(tuple(int(t) for t in TOKENS), CT, NS) == chunk_keys(TOKENS, CT, NS)


def test_same_keys_in_another_process():
    script = (
        "import json, sys\n"
        "from kvstored_client.keys import chunk_keys, namespace_id_for\n"
        "args = json.loads(sys.argv[1])\n"
        "ns = namespace_id_for(*args['ns'])\n"
        "print(json.dumps({'ns': ns, 'keys': [k.hex() for k in chunk_keys(args['tokens'], args['ct'], ns)]}))\n"
    )
    ns_fields = ["meta-llama/Llama-3.1-8B-Instruct", "bfloat16", 2 << 20, "tp1-pp1-rank0"]
    arg = json.dumps({"ns": ns_fields, "tokens": [int(t) for t in TOKENS], "ct": CT})
    env = dict(os.environ, PYTHONHASHSEED="12345")  # a different str-hash seed than ours
    out = subprocess.run(
        [sys.executable, "-c", script, arg], capture_output=True, text=True, env=env, timeout=60, check=True
    )
    theirs = json.loads(out.stdout)
    assert theirs["ns"] == NS
    assert [bytes.fromhex(k) for k in theirs["keys"]] == chunk_keys(TOKENS, CT, NS)


@pytest.mark.parametrize("i", [0, 1, CT - 1, CT, 2 * CT + 3, 4 * CT, 5 * CT - 1])
def test_changing_token_i_changes_keys_from_chunk_i_div_ct_on(i):
    base = chunk_keys(TOKENS, CT, NS)
    changed_tokens = list(TOKENS)
    changed_tokens[i] = int(changed_tokens[i]) + 1
    changed = chunk_keys(changed_tokens, CT, NS)
    first = i // CT
    assert changed[:first] == base[:first]
    assert all(a != b for a, b in zip(changed[first:], base[first:]))
    assert len(changed) == len(base)


def test_changing_a_token_in_the_partial_tail_changes_nothing():
    changed_tokens = list(TOKENS)
    changed_tokens[-1] = int(changed_tokens[-1]) + 1
    assert chunk_keys(changed_tokens, CT, NS) == chunk_keys(TOKENS, CT, NS)


def test_different_namespace_different_keys():
    other = namespace_id_for("meta-llama/Llama-3.1-8B-Instruct", "float16", 2 << 20, "tp1-pp1-rank0")
    assert other != NS
    a, b = chunk_keys(TOKENS, CT, NS), chunk_keys(TOKENS, CT, other)
    assert all(x != y for x, y in zip(a, b))


def test_parent_continues_a_prefix():
    keys = chunk_keys(TOKENS, CT, NS)
    assert chunk_keys(TOKENS[2 * CT :], CT, NS, parent=keys[1]) == keys[2:]


def test_chunk_boundaries_matter():
    # Same tokens, different chunk size -> different keys.
    assert chunk_keys(TOKENS[: 4 * CT], 2 * CT, NS)[0] not in chunk_keys(TOKENS[: 4 * CT], CT, NS)


def test_bad_arguments():
    with pytest.raises(ValueError):
        chunk_keys(TOKENS, 0, NS)
    with pytest.raises(ValueError):
        chunk_keys(np.zeros((2, CT), dtype=np.int64), CT, NS)


@pytest.mark.parametrize(
    "fields",
    [
        ("other-model", "bfloat16", 2 << 20, "tp1-pp1-rank0", b"", 32),
        ("meta-llama/Llama-3.1-8B-Instruct", "float16", 2 << 20, "tp1-pp1-rank0", b"", 32),
        ("meta-llama/Llama-3.1-8B-Instruct", "bfloat16", 1 << 20, "tp1-pp1-rank0", b"", 32),
        ("meta-llama/Llama-3.1-8B-Instruct", "bfloat16", 2 << 20, "tp2-pp1-rank0", b"", 32),
        ("meta-llama/Llama-3.1-8B-Instruct", "bfloat16", 2 << 20, "tp1-pp1-rank0", b"tenant-a", 32),
        ("meta-llama/Llama-3.1-8B-Instruct", "bfloat16", 2 << 20, "tp1-pp1-rank0", b"", 16),
        # Field boundaries are length-prefixed: moving a character across fields changes the id.
        ("meta-llama/Llama-3.1-8B-Instructb", "float16", 2 << 20, "tp1-pp1-rank0", b"", 32),
    ],
)
def test_namespace_id_depends_on_every_field(fields):
    assert namespace_id_for(*fields) != NS
    assert len(namespace_id_for(*fields)) == 32
