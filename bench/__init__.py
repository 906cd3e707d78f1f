# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""kvstored's benchmarks (not tests): run each as `python -m bench.<script>` from the repository root;
what they measure and what they found: docs/benchmarks.md."""
