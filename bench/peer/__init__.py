# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Node B loading what only node A holds, through the peer tier, beside the raw transports beneath
it (a raw TCP socket, raw ucxx), B's cold fs tier and the S3 tier on radosgw (not a test). With
--netns (root): A and B in two network namespaces joined by a veth pair, one set of rows per MTU,
beside raw TCP over one and two connections and raw ucxx on that link.

Method, baselines, targets and results: docs/benchmarks.md.
"""
