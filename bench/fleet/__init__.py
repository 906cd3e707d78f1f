# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The fleet measured (issue #21 part 4; not a test): N real daemons, each in a network namespace,
under the same bounded load per node, for the mesh (static peers, every node follows every other)
and for the fleet directory (a real Redis Cluster, no static peers): per node upkeep CPU, RSS and
bytes in per second against N, and Redis's own CPU and memory.

Modules: run (one set-up at one N), cli (the sweep, the table, the plot).
Method and results: docs/benchmarks.md ("The fleet, measured"), docs/scale-out.md.
"""
