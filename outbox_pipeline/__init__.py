"""outbox_pipeline: a transactional outbox relay from PostgreSQL to Kafka.

The engine (this package's top-level modules and ``strategies``) imports neither Dagster nor Spark;
the Dagster wiring lives in ``outbox_pipeline.orchestration`` and ``outbox_pipeline.definitions``.
"""

from .config import OutboxTable
from .enqueue import Enqueued, Message, enqueue, enqueue_many
from .errors import ConfigurationError, InvalidMessageError, OutboxError, SchemaError
from .schema import init_db

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
