"""outbox_pipeline: a transactional outbox relay from PostgreSQL to Kafka.

Layers, lowest first (each imports only those below it; tests/test_layout.py keeps the rule):

1. the top-level modules (config, settings, errors, server, timestamps, partitioning, connection_path) and
   ``strategies`` (one module per relay strategy, its SQL and its tables);
2. ``store``: the outbox in PostgreSQL: rows, the write path, the schema;
3. ``observe``: liveness, lag, status, metrics;
4. ``relay``: the relay loop, its sessions, its Kafka side, the worker processes;
5. ``operate``: dead letters, rewinds, switching strategy, maintenance;
6. ``drain``: the bulk drain's engine (what Spark executors call);
7. ``runs``: the relay work Dagster runs execute, as plain functions;
8. ``cli``, ``bench``, ``verify``, ``localstack``: the commands and the local stack;
9. ``orchestration`` and ``definitions``: the only Dagster rooms.

Everything but the last layer is engine and imports neither Dagster nor Spark. This module is the public API
(``Message``, ``enqueue``, ``enqueue_many``, ``OutboxTable``, ``init_db``): it re-exports from ``store``.
"""

from .config import OutboxTable
from .errors import ConfigurationError, InvalidMessageError, OutboxError, SchemaError
from .store.enqueue import Enqueued, Message, enqueue, enqueue_many
from .store.schema import init_db

__all__ = [
    "ConfigurationError",
    "Enqueued",
    "InvalidMessageError",
    "Message",
    "OutboxError",
    "OutboxTable",
    "SchemaError",
    "enqueue",
    "enqueue_many",
    "init_db",
]
