"""Engine, layer 4: the relay. Its loop (loop.py), its PostgreSQL sessions and wake-ups, its settings and stats, who
it is (presence), and its Kafka side: the publisher, transactional producers, Kafka's errors and topics' limits; the
worker processes `outbox relay` starts (workers.py); the wal strategy's replication stream (wal/). The strategies it
runs are a layer of their own below `store`.

May import: the top-level modules, `strategies`, `store`, `observe`.
"""
