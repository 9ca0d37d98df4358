"""Engine room: the wal strategy's relay: the replication stream of one logical slot (stream.py) and the wire format
it carries, pgoutput's messages inside the streaming replication protocol's frames (pgoutput.py).

Writers emit transactional logical decoding messages (``pg_logical_emit_message(true, ...)``); the relay streams them
in commit order from a ``pgoutput`` slot, and confirms a position to the slot once Kafka has every message before it.
"""
