# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
from tests.vllm.conftest import VLLM_ERROR


def test_vllm_is_installed():
    assert not VLLM_ERROR, VLLM_ERROR
