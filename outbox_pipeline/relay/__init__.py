"""The relay: its loop, its PostgreSQL sessions, its Kafka side, the worker processes `outbox relay` starts, and the
wal strategy's relay (wal/). Each module: docs/architecture.md#relay."""

from . import wal
from .loop import OutcomeObserver, Relay
from .presence import WorkerIdInUseError, WorkerPresence, present
from .publisher import (
    DEFAULT_PRODUCER_CONFIG,
    REQUIRED_PRODUCER_CONFIG,
    KafkaPublisher,
    PendingBatch,
    check_producer_config,
)
from .relay_settings import RelaySettings
from .stats import RelayInstruments, RelayStats
from .transactional import TransactionalProducers
from .wakeups import WakeUps
from .wal import WalRelay
from .workers import RelayWorker, WorkerResult, WorkerSpec, build_relay, run_worker_processes

# The wal relay's own names are in ``wal``.
__all__ = [
    "DEFAULT_PRODUCER_CONFIG",
    "REQUIRED_PRODUCER_CONFIG",
    "KafkaPublisher",
    "OutcomeObserver",
    "PendingBatch",
    "Relay",
    "RelayInstruments",
    "RelaySettings",
    "RelayStats",
    "RelayWorker",
    "TransactionalProducers",
    "WakeUps",
    "WalRelay",
    "WorkerIdInUseError",
    "WorkerPresence",
    "WorkerResult",
    "WorkerSpec",
    "build_relay",
    "check_producer_config",
    "present",
    "run_worker_processes",
    "wal",
]
