# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""KV events: the bus every tier's stores and removals are published on (bus.py), and the ZMQ
publisher in vLLM's wire format (zmq_publisher.py)."""
