# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""vLLM 0.33 integration of kvstored.

- `tier.KvstoredTierManager`: the daemon as a secondary tier of vLLM's TieringOffloadingSpec
  (`"secondary_tiers": [{"type": "kvstored", "kvstored_socket": ...}]`).
- `direct.KvstoredOffloadingSpec`: an OffloadingSpec whose worker copies GPU blocks straight into
  the daemon's shared-memory pool (`"spec_name": "KvstoredOffloadingSpec"`).
- `plugin.register`: the `vllm.general_plugins` entry point that registers both names.

Importing this package does not import vLLM: `blockcopy` (the worker's copy path), `driver`,
`region` and `namespace` work without it (the GPU check script uses them on a machine without vLLM).
"""
