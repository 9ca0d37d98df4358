"""Engine room (store): the wal strategy's outbox, which keeps no rows.

Writers emit one transactional logical decoding message per outbox message (``pg_logical_emit_message``); the relay
streams them from a logical replication slot in commit order (relay/wal/). ``format``: what a message carries, one
copy of the layout for the Python writer, the SQL writers and the relay. ``objects``: the slot, the publication and
the SQL that emits.
"""
