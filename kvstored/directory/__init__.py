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
- resp.py, slots.py, commands.py: the Redis protocol's side, no I/O: RESP frames and what an error
  reply asks for, key slots and the cluster's slot map, the directory's commands encoded;
- connection.py, cluster.py: a lean Redis Cluster client (raw RESP, one connection per master,
  MOVED / ASK / failovers followed within a call's deadline);
- node.py: the I/O glue: two such clients (writes, lookups) behind a circuit breaker, the write
  loop, lookups.

Nothing here is imported unless a directory is configured (the peer tier imports node.py then);
hiredis is its one dependency beyond the daemon's own.
"""
