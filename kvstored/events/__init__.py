"""KV events: the bus every tier's stores and removals are published on (bus.py), and the ZMQ
publisher in vLLM's wire format (zmq_publisher.py)."""
