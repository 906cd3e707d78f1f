# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The fleet directory: who holds which chunk across a fleet, kept in a Redis Cluster (or Valkey).

Beside the peer mesh (kvstored/peer/): the mesh follows every peer's events, which stops paying
past a handful of nodes; the directory costs each node its own writes, one heartbeat and one
round trip per lookup that its local tiers and the mesh miss, whatever the fleet's size.

- config.py: the directory's settings and its URL (hosts, AUTH, TLS);
- keys.py: the key layout (what is stored where), no I/O;
- changes.py: the writer's bookkeeping (net changes per interval, the refresh pass), no I/O;
- lookups.py: the reader's bookkeeping (holders of a lookup's chunks, the heartbeat cache), no I/O;
- node.py: the I/O: one Redis Cluster client behind a circuit breaker, the write loop, lookups.

redis-py is imported only by node.py's connect(), i.e. only when a directory is configured.
"""
