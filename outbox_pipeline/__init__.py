"""outbox_pipeline: a transactional outbox relay from PostgreSQL to Kafka. This module is the public API (``Message``,
``enqueue``, ``enqueue_many``, ``OutboxTable``, ``init_db`` and the errors), re-exported from ``store``; the layers and
every module: docs/architecture.md#layers."""

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
