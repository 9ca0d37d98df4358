"""What an operator and the relay ask of the outbox: who is alive, what is pending and why, `outbox status`, the lag
objective, a worker's metrics. The relay uses it, so nothing here imports the relay; each module:
docs/architecture.md#observe."""

from . import status
from .horizon import find_horizon
from .lag import (
    DeadLetterBacklog,
    PartitionLag,
    dead_letter_backlog,
    describe_holders,
    explain_pending,
    held_keys,
    holders,
    partition_lag,
    pending_in_scope,
)
from .lag_slo import LagThresholds, LagVerdict, Severity, evaluate_lag, evaluate_wal_lag
from .liveness import (
    WORKER_LOCK_CLASS,
    Liveness,
    LivenessMode,
    LiveWorker,
    Reaped,
    holders_alive,
    live_workers,
    liveness_from_env,
    lock_held,
    lock_key,
    reap,
)
from .metrics import LagSampler, MetricsServer, RelayMetrics, WorkerMetrics, serve_worker_metrics
from .status import partition_status
from .wal_lag import NO_PARTITIONS, WalLag

# wal_lag() and orphan_slot() share their module's name: exported here, they would hide the module
# (``outbox_pipeline.observe.wal_lag.WalLag`` would stop resolving); import them from their modules.
__all__ = [
    "NO_PARTITIONS",
    "WORKER_LOCK_CLASS",
    "DeadLetterBacklog",
    "LagSampler",
    "LagThresholds",
    "LagVerdict",
    "LiveWorker",
    "Liveness",
    "LivenessMode",
    "MetricsServer",
    "PartitionLag",
    "Reaped",
    "RelayMetrics",
    "Severity",
    "WalLag",
    "WorkerMetrics",
    "dead_letter_backlog",
    "describe_holders",
    "evaluate_lag",
    "evaluate_wal_lag",
    "explain_pending",
    "find_horizon",
    "held_keys",
    "holders",
    "holders_alive",
    "live_workers",
    "liveness_from_env",
    "lock_held",
    "lock_key",
    "partition_lag",
    "partition_status",
    "pending_in_scope",
    "reap",
    "serve_worker_metrics",
    "status",
]
