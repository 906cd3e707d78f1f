# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Node B loading what only node A holds, through the peer tier, beside the raw transports beneath
it (a raw TCP socket, raw ucxx), B's cold fs tier and the S3 tier on radosgw (issue 11 part 8; not
a test).

Method, baselines, targets and results: docs/benchmarks.md.
"""
